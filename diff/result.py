"""What `trace diff` found, as small dataclasses; reports read their fields.

`to_json()` of each gives the keys and values of the JSON report (docs/diff.md), which
consumers parse, so it must not change by accident (tests/test_diff_json_stable.py). Most
classes emit their fields in declaration order through `json_fields`, leaving out a field
declared with `opt()` while it is None: a new optional field (a baseline's numbers, say) is
one line. Divergence, Origin, TokenInfo and Growth spell their keys out, because parts of
them are spread into the parent object (a divergence's `detail`, a token flip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

import numpy as np

from gemma4_trace.traces.layers import LayerInfo

from .audio_where import AudioPlace
from .metrics import PRIMARY, THRESHOLD_METRICS
from .tolerances import Tolerances

# per-layer facts shown in reports, in the report's order
LAYER_KEYS = ("layer_type", "kv_role", "kv_source", "head_dim", "num_heads", "num_kv_heads")


def opt(default=None):
    """A field left out of the JSON while it is None."""
    return field(default=default, metadata={"omit_none": True})


def json_fields(obj) -> dict:
    """The dataclass's fields as a JSON dict, in field order, without unset optional ones."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if v is None and f.metadata.get("omit_none"):
            continue
        out[f.name] = v
    return out


def jsonable(x):
    """Plain JSON values: dataclasses through their to_json, numpy scalars as Python, inf as text."""
    if hasattr(x, "to_json"):
        return jsonable(x.to_json())
    if isinstance(x, LayerInfo):
        return {k: getattr(x, k) for k in LAYER_KEYS}
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    return x


TensorStatus = Literal["ok", "diverged", "shape", "rows", "not compared", "partly compared"]
Verdict = Literal["introduced", "inherited", "unknown"]
FlipLabel = Literal["near tie", "real error", "unknown", "unknown (no REF logits)", "unknown (REF logits unusable)"]


# ---------------------------------------------------------------- first divergence details
@dataclass
class Element:
    """One element of a row: its index in the row's shape, both values, named axes."""

    index: tuple[int, ...]
    ref: float
    run: float
    names: dict[str, int]  # e.g. {"head": 1, "channel": 11} (diff/ledger.py element_names)

    def to_json(self) -> dict:
        return {"index": list(self.index), "ref": self.ref, "run": self.run, **self.names}


@dataclass
class RowDetail:
    """A float row that failed: its first failing and its worst element, all its metrics."""

    first: Element
    worst: Element
    metrics: dict[str, float]  # every row metric with a tolerance, by name
    precision: str

    def to_json(self) -> dict:
        return {
            **self.first.names,
            "index": list(self.first.index),
            "ref_value": self.first.ref,
            "run_value": self.first.run,
            "worst": self.worst,
            "metrics": self.metrics,
            "precision": self.precision,
        }


@dataclass
class MaskDetail:
    """Key positions where the two masks of one query row disagree (lists capped, counts not)."""

    allowed_in_run_blocked_in_ref: list[int]
    blocked_in_run_allowed_in_ref: list[int]
    n_allowed_in_run_blocked_in_ref: int
    n_blocked_in_run_allowed_in_ref: int
    ref_allowed: str  # "0-3, 7"
    run_allowed: str
    image_blocks: list[dict[str, int]] | None = (
        opt()
    )  # image blocks of the differing keys or the query: {image, first, last}

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class TokenFlip:
    """The first step whose chosen tokens differ, judged by REF's logits there."""

    reference_token: int
    candidate_token: int
    reference_margin: float | None = opt()  # REF's top-1 minus top-2 logit
    reference_gap: float | None = opt()  # REF's logit of its token minus of RUN's
    candidate_rank: int | None = opt()  # rank of RUN's token under REF's logits
    label: FlipLabel = "unknown"

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class Problem:
    """A tensor that could not be compared row by row (shape, row count, missing)."""

    message: str
    ref_shape: list[int] | None = opt()
    run_shape: list[int] | None = opt()

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class InputError:
    """The error of a divergent tensor's input (the residual stream before it)."""

    kind: str
    layer: int | None
    rel_l2: float
    threshold: float
    here: float  # rel-L2 of the divergent tensor itself
    output_rel_l2: float | None = None  # the layer's output, when it is a layer's tensor


@dataclass
class Origin:
    """Was the divergence introduced here or carried in from upstream?"""

    verdict: Verdict
    reason: str | None = None
    input: InputError | None = None

    def to_json(self) -> dict:
        i = self.input
        out = {}
        if i is not None:
            out = {
                "input_kind": i.kind,
                "input_layer": i.layer,
                "input_rel_l2": i.rel_l2,
                "input_threshold": i.threshold,
            }
            if i.output_rel_l2 is not None:
                out["output_rel_l2"] = i.output_rel_l2
            out["rel_l2_here"] = i.here
        out["verdict"] = self.verdict
        if self.reason is not None:
            out["reason"] = self.reason
        return out


@dataclass
class Divergence:
    """The first (step, data-flow order, position) where RUN leaves REF's tolerance."""

    step: int
    layer: int | None
    kind: str
    position: int
    metric: str  # a name in diff.metrics.METRICS
    value: float
    threshold: float
    detail: RowDetail | MaskDetail | TokenFlip | Problem
    layer_info: LayerInfo | None = None  # the layer's facts, for per-layer kinds
    origin: Origin | None = None
    sentence: str | None = None
    baseline: BaselineFigures | None = None  # under --baseline
    tower: str | None = None  # its tower, once either trace holds an encoder tower (else the text tower's)
    row_words: str | None = None  # an encoder's row for people: "patch 17 (image 2, its patch 5)"
    audio: AudioPlace | None = None  # an audio row's clip, frame, time and block (diff/audio_where.py)

    @property
    def phase(self) -> str:
        return "prefill" if self.step == 0 else "decode"

    def to_json(self) -> dict:
        out = {
            "step": self.step,
            "phase": self.phase,
            "layer": self.layer,
            "kind": self.kind,
            "position": self.position,
            "metric": self.metric,
            "value": self.value,
            "threshold": self.threshold,
            **self.detail.to_json(),
        }
        if self.tower is not None:  # additive: traces of the text tower alone keep their JSON byte for byte
            out["tower"] = self.tower
        if self.audio is not None:  # additive: clip, frame, time_s, block
            out.update(self.audio.to_json())
        if self.layer_info is not None:
            out.update(jsonable(self.layer_info))
        if self.origin is not None:
            out["origin"] = self.origin
        if self.baseline is not None:
            out["baseline"] = self.baseline
        if self.sentence is not None:
            out["sentence"] = self.sentence
        return out


@dataclass
class Hint:
    """The known porting bug the first divergence looks like (diff/hints.py), and the evidence."""

    name: str
    template: str  # the evidence, with {field}s for its numbers (diff/report.py hint_evidence fills them)
    numbers: dict[str, tuple[float, str]] = field(default_factory=dict)  # field -> (value, "sci" | "val" | "pct")
    evidence: str | None = None  # the filled-in template (diff_traces sets it)

    def to_json(self) -> dict:
        return {"name": self.name, "evidence": self.evidence}


# ---------------------------------------------------------------- the rest of the report
@dataclass
class TokenInfo:
    """Chosen tokens of both traces and how many agree."""

    reference: list[int]
    candidate: list[int]
    compared_steps: int = 0
    matches: int = 0
    accuracy: float = 0.0
    first_mismatch_step: int | None = None
    mismatch_steps: list[int] | None = opt()  # the first 100
    flip: TokenFlip | None = None  # at first_mismatch_step
    reference_text: str | None = opt()  # decoded, when a tokenizer is known
    candidate_text: str | None = opt()

    def to_json(self) -> dict:
        out = json_fields(self)
        flip = out.pop("flip")
        texts = {k: out.pop(k) for k in ("reference_text", "candidate_text") if k in out}
        return out | (flip.to_json() if flip is not None else {}) | texts


@dataclass
class TensorSummary:
    """How one (kind, layer) compared: rows, status, worst value of each metric."""

    kind: str
    layer: int | None
    rows: int
    rows_compared: int = 0
    status: TensorStatus = "ok"  # "not compared" / "partly compared": rows after the first divergence are
    # not read ("ok" would claim they passed)
    threshold: float | None = opt()  # the primary metric's tolerance at step 0 (0 for masks)
    precision: str | None = opt()
    failed_rows: int | None = opt()  # float kinds
    mismatched_rows: int | None = opt()  # masks
    absent_rows: int | None = opt()  # rows a trace did not report (rows_present): not compared
    absent_positions: str | None = opt()  # their positions, "0-11"
    absent_in: str | None = opt()  # "RUN", "REF" or "REF and RUN"
    reason: str | None = opt()  # why rows were not compared ("not compared" / "partly compared")
    worst: dict[str, float | None] | None = None  # metric name -> worst value over compared rows (None: no row)

    def to_json(self) -> dict:
        out = json_fields(self)
        worst = out.pop("worst")
        if worst is not None:
            out.update({m.summary: worst[m.name] for m in THRESHOLD_METRICS})
        return out


@dataclass
class Jump:
    """The largest step up in error from one layer to the next."""

    layer: int
    ratio: float
    before: float
    after: float
    step: int | None = opt()  # the step where it is largest

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class Outlier(Jump):
    """One layer's own error standing out under the tolerance (a match's note; JSON: growth.outlier).
    ratio: its step-up (under --baseline, of its error over BASE's); before: its input's error as
    counted (at least that input's median over the steps); after: its own layer_out rel-L2 at that
    step; typical: the other layers' median step-up."""

    typical: float = 0.0
    over_base: bool = False


@dataclass
class Growth:
    """rel-L2 of the residual stream (layer_out) per layer x step, against its tolerance."""

    layers: list[int]
    steps: list[int]
    table: list[list[float | None]]  # [layer][step]
    thresholds: list[list[float | None]]
    max_over_steps: list[float | None]
    largest_jump: Jump | None
    metric: str = PRIMARY
    kind: str = "layer_out"
    # for the HTML heatmap only (not in the JSON): rel-L2 per step of the residual tensors outside
    # the layers ({"embeddings": (values, tolerances), "final_hidden": ...}), and under --baseline
    # BASE's rel-L2 against REF per step of every residual tensor ({(kind, layer): values})
    globals: dict[str, tuple[list[float | None], list[float | None]]] = field(default_factory=dict)
    base: dict[tuple[str, int | None], list[float | None]] | None = None
    # the heatmap's band of each encoder tower (prefill only): [(layer, layer_out rel-L2, tolerance)]
    towers: dict[str, list[tuple[int, float | None, float | None]]] = field(default_factory=dict)
    outlier: Outlier | None = None  # set on a match (diff/origin.py own_error_outlier)

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "kind": self.kind,
            "layers": self.layers,
            "steps": self.steps,
            "table": self.table,
            "thresholds": self.thresholds,
            "max_over_steps": self.max_over_steps,
            "largest_jump": self.largest_jump,
            **({"outlier": self.outlier} if self.outlier is not None else {}),
        }


@dataclass
class Skipped:
    kind: str
    layer: int | None
    reason: str

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class Steps:
    reference: int
    candidate: int
    compared: int  # steps whose tokens compare
    numbers_compared: int  # steps whose tensors compare
    prompt_len: int
    positions_compared: int
    free_running: bool

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class TraceInfo:
    path: str
    mode: str
    dtype: str
    runtime: str
    device: str
    steps: int
    positions: int
    model_name: str
    model_config_sha256: str

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class DiffResult:
    match: bool
    first_divergence: Divergence | None
    tokens: TokenInfo
    growth: Growth
    tensors: list[TensorSummary]
    skipped: list[Skipped]
    notes: list[str]
    steps: Steps
    reference: TraceInfo
    candidate: TraceInfo
    tolerances: Tolerances
    layers: list[LayerInfo] = field(default_factory=list)
    baseline: BaselineInfo | None = None  # under --baseline
    isolation: IsolationRanking | None = None  # for an isolated candidate
    logits: LogitMetrics | None = None  # when both traces store logits
    hint: Hint | None = None  # a known bug's signature matched (diff/hints.py); JSON only when set
    patch_map: object | None = None  # a vision divergence over its image (diff/patch_map.py); HTML only
    audio_map: object | None = None  # an audio divergence over each clip's frames (diff/audio_map.py); HTML only

    def to_json(self) -> dict:
        return jsonable(
            {
                "match": self.match,
                "first_divergence": self.first_divergence,
                **({"hint": self.hint} if self.hint is not None else {}),
                "tokens": self.tokens,
                "steps": self.steps,
                "growth": self.growth,
                "tensors": self.tensors,
                "skipped": self.skipped,
                "notes": self.notes,
                "reference": self.reference,
                "candidate": self.candidate,
                **({"baseline": self.baseline} if self.baseline is not None else {}),
                **({"isolation": self.isolation} if self.isolation is not None else {}),
                **({"logit_metrics": self.logits} if self.logits is not None else {}),
                "tolerances": self.tolerances,
                "layers": self.layers,
            }
        )


# ---------------------------------------------------------------- feature results
@dataclass
class BaselineFigures:
    """The baseline's numbers at the first divergence (JSON: first_divergence.baseline)."""

    path: str
    factor: float
    base_value: float  # BASE vs REF, the divergence's metric on the same row
    ratio: float  # value / base_value (for cosine: (1 - value) / (1 - base_value)); inf if BASE is exact
    base_step_worst: float  # check 3's bound: BASE vs REF, its worst over this tensor and step (best: not applied)
    run_vs_base: float  # RUN vs BASE, BASE as the reference, same metric and row
    run_vs_base_threshold: float  # the tolerance it is judged by (the same as RUN vs REF's)

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class BaselineInfo:
    """BASE and the factor it was used with (JSON: top-level "baseline")."""

    trace: TraceInfo
    factor: float
    against_ref: BaseAgainstRef | None = None  # BASE judged against REF alone (diff_traces fills it)

    def to_json(self) -> dict:
        out = {**self.trace.to_json(), "factor": self.factor}
        if self.against_ref is not None:
            out["against_ref"] = json_fields(self.against_ref)
        return out


@dataclass
class BaseAgainstRef:
    """What `trace diff REF BASE` says of the baseline itself (JSON: baseline.against_ref): RUN's
    match under --baseline is relative to this."""

    match: bool
    first_divergence: str | None  # its sentence, as the text report's first line
    tokens_matched: int
    tokens_compared: int
    tokens: list[int]  # BASE's tokens over the compared steps


@dataclass
class LayerError:
    layer: int
    rel_l2: float  # worst over steps
    step: int  # where it is worst
    threshold: float  # the tolerance at that step

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class IsolationRanking:
    ranking: list[LayerError]  # worst local error first
    metric: str = "rel_l2"
    kind: str = "layer_out"

    def to_json(self) -> dict:
        return {"metric": self.metric, "kind": self.kind, "ranking": self.ranking}


@dataclass
class LogitSummary:
    steps: int  # steps with finite logits in both traces
    kl_mean: float
    kl_p99: float
    kl_max: float
    kl_max_step: int | None
    top1_agreement: float
    top5_overlap: float
    drop_mean: float
    drop_max: float
    drop_max_step: int | None

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class LogitMetrics:
    kl: list[float]  # one entry per compared step
    top1: list[float]
    top5: list[float]
    drop: list[float]
    summary: LogitSummary

    def to_json(self) -> dict:
        return {
            "kl": self.kl,
            "top1": self.top1,
            "top5": self.top5,
            "ref_token_prob_drop": self.drop,
            "summary": self.summary,
        }
