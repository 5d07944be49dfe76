"""Where a divergence comes from: the growth of the residual stream's error layer by layer
(the growth table and its largest jump) and the origin verdict (introduced in the divergent
tensor, or inherited from its input), from what the row pass recorded (Residuals)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gemma4_trace.traces import schema as S

from .align import PRE_KINDS, Plan
from .metrics import METRIC, PRIMARY
from .result import Divergence, Growth, InputError, Jump, Origin, Outlier
from .tolerances import StepTolerance

GROWTH_KIND = "layer_out"  # the growth table's rows
# a layer whose own error stands out under the tolerance (a match's outlier note): at some step its
# error is OUTLIER_RATIO times its input's, and OUTLIER_SPREAD times the typical (median) step-up of
# the other layers. Errors count at least OUTLIER_FLOOR x their tolerance (float32: 1e-7, the size of
# round-off in one layer), so an exact input makes no step-up out of round-off.
OUTLIER_RATIO = 20.0
OUTLIER_SPREAD = 10.0
OUTLIER_FLOOR = 1e-3
INTRODUCED_RATIO = 10.0  # error at least this many times the layer input's: introduced here

Key = tuple[str, int | None]  # (kind, layer)


@dataclass
class Residuals:
    """What the row pass records for growth and origin."""

    rel_rows: dict[Key, np.ndarray] = field(default_factory=dict)  # residual kinds: rel-L2 per row
    outside_rows: dict[Key, np.ndarray] = field(default_factory=dict)  # residual kinds: row leaves BASE's envelope
    sums: dict[Key, tuple[np.ndarray, np.ndarray, int]] = field(
        default_factory=dict
    )  # residual kinds: |d|^2, |a|^2, row size
    base_sums: dict[Key, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)  # the same for BASE vs REF
    thresholds: dict[Key, StepTolerance] = field(default_factory=dict)  # every compared tensor's
    absent: dict[Key, np.ndarray] = field(default_factory=dict)  # rows REF or RUN did not record: not compared


def growth(res: Residuals, plan: Plan) -> Growth:
    """The growth table: layer_out rel-L2 per layer x step, and the largest jump; the heatmap's
    rows for the tensors before and after the layers, and BASE's table under --baseline."""
    layers = sorted(l for k, l in res.sums if k == GROWTH_KIND)
    rows = [_step_rel(res.sums, res, plan, (GROWTH_KIND, l)) for l in layers]
    table, thresholds = [r[0] for r in rows], [r[1] for r in rows]
    embed = _step_rel(res.sums, res, plan, ("embeddings", None)) if ("embeddings", None) in res.sums else None
    per_layer = [max((v for v in row if v is not None), default=None) for row in table]
    out = Growth(
        layers,
        list(range(plan.numeric_steps)),
        table,
        thresholds,
        per_layer,
        _largest_jump(layers, table, thresholds, embed),
    )
    for kind in ("embeddings", "final_hidden"):
        if (kind, None) in res.sums:
            out.globals[kind] = _step_rel(res.sums, res, plan, (kind, None))
    for name in S.ENCODER_TOWERS:
        key = S.kind_key(GROWTH_KIND, name)
        band = [(l, *_tower_rel(res.sums, res, (k, l))) for k, l in sorted(res.sums, key=str) if k == key]
        if band:
            out.towers[name] = sorted(band)
    if res.base_sums:  # the text tower's residual stream (an encoder's rows are no steps)
        text = [key for key in res.base_sums if not S.KIND_BY_NAME[key[0]].encoder]
        out.base = {key: _step_rel(res.base_sums, res, plan, key)[0] for key in text}
        for key in res.base_sums:  # an encoder band's envelope: BASE's rel-L2 over the prefill's rows
            if key not in out.base:
                out.base[key] = [_tower_rel(res.base_sums, res, key)[0]] + [None] * (plan.numeric_steps - 1)
    return out


def _tower_rel(sums: dict, res: Residuals, key: Key) -> tuple[float | None, float | None]:
    """rel-L2 of an encoder tensor's rows taken together (RUN's or BASE's against REF, from `sums`),
    and its (prefill) tolerance."""
    nd, na, m = sums[key]
    tol = res.thresholds[key]
    keep = ~res.absent[key][: nd.size] if key in res.absent else np.ones(nd.size, dtype=bool)
    if not keep.any():
        return None, float(tol.limits[PRIMARY][0])
    snd, sna = float(nd[keep].sum()), float(na[keep].sum())
    floor = float(tol.l2_floor[0]) * math.sqrt(m * int(keep.sum()))
    rel = 0.0 if snd == 0 else math.sqrt(snd) / max(math.sqrt(sna), floor, 1e-300)
    return rel, float(tol.limits[PRIMARY][0])


def _step_rel(sums: dict, res: Residuals, plan: Plan, key: Key) -> tuple[list, list]:
    """rel-L2 of each step's rows taken together, and its tolerance per step, for a residual
    kind (kind, layer) from `sums` (RUN's or BASE's against REF)."""
    none = [None] * plan.numeric_steps
    starts = np.array([a for a, _ in plan.step_positions[: plan.numeric_steps]])
    nd, na, m = sums[key]
    n = min(nd.size, plan.n_rows)
    st = starts[starts < n] if n else starts[:0]
    if n == 0 or st.size == 0:
        return none, none
    snd = np.add.reduceat(nd[:n], st)
    sna = np.add.reduceat(na[:n], st)
    cnt = np.diff(np.append(st, n))
    tol = res.thresholds[key]
    floor = tol.l2_floor[: st.size] * np.sqrt(m * cnt)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.sqrt(snd) / np.maximum(np.sqrt(sna), np.maximum(floor, 1e-300))
    rel[snd == 0] = 0.0
    values: list = [float(x) for x in rel]
    absent = res.absent.get(key)
    if absent is not None:  # a step none of whose rows was recorded in both traces: not compared, never "0"
        compared = np.add.reduceat((~absent[:n]).astype(np.int64), st)
        values = [None if c == 0 else v for v, c in zip(values, compared)]
    return (values + none[st.size :], [float(x) for x in tol.limits[PRIMARY][: plan.numeric_steps]])


def _input_of(d: Divergence, n_layers: int) -> tuple[str, int | None] | None:
    """The residual-stream tensor a divergent tensor is computed from (within its tower)."""
    spec = S.KIND_BY_NAME[d.kind]
    if spec.encoder:
        return _encoder_input(spec, d.layer)
    if d.layer is not None:
        return ("layer_out", d.layer - 1) if d.layer > 0 else ("embeddings", None)
    if d.kind == "per_layer_inputs":  # a projection of the embeddings plus a token-id lookup
        return ("embeddings", None)
    return {"final_hidden": ("layer_out", n_layers - 1), "logits": ("final_hidden", None)}.get(d.kind)


def _encoder_input(spec: S.Kind, layer: int | None) -> tuple[str, int | None] | None:
    """An encoder kind's input, row for row: the tower's first kind feeds layer 0, each layer's output
    the next; its pooled and soft-token rows are other rows (soft tokens), so no input row is theirs."""
    if layer is None:
        return None
    first = S.TOWER_BY_NAME[spec.tower].kinds[0]
    return (S.kind_key("layer_out", spec.tower), layer - 1) if layer > 0 else (first.key, None)


def origin(d: Divergence, res: Residuals, n_layers: int) -> Origin | None:
    """Was the divergence introduced in its tensor or carried in by its input?"""
    spec = S.KIND_BY_NAME[d.kind]
    if spec.encoder and spec.key == S.TOWER_BY_NAME[spec.tower].kinds[0].key:
        return Origin("introduced", "it is the tower's first tensor, computed from the raw image or audio input")
    if spec.dtype == "bool":
        return Origin("introduced", "the mask is computed from positions, not from data")
    if d.kind in PRE_KINDS and d.kind != "per_layer_inputs":
        return Origin(
            "introduced",
            "it is looked up from token ids (and vision features), not computed from an earlier tensor"
            if d.kind == "embeddings"
            else "it is computed from positions only",
        )
    inp = _input_of(d, n_layers)
    if spec.dtype == "int" or inp is None or METRIC[d.metric].group == "structure":
        return None
    rows = res.rel_rows.get(inp)
    if rows is None or d.position >= rows.size:
        return Origin(
            "unknown", f"{inp[0]} of layer {inp[1]} not compared" if inp[1] is not None else f"{inp[0]} not compared"
        )
    in_rel = float(rows[d.position])
    in_tol = float(res.thresholds[inp].limits[PRIMARY][d.step])
    out = res.rel_rows.get((S.kind_key("layer_out", spec.tower), d.layer)) if d.layer is not None else None
    here = d.detail.metrics[PRIMARY]
    err = InputError(inp[0], inp[1], in_rel, in_tol, here, None if out is None else float(out[d.position]))
    if inp in res.outside_rows:  # three-way: judged by BASE's envelope, not by the tolerance alone
        if res.outside_rows[inp][d.position]:
            return Origin("inherited", "the input already leaves the baseline's envelope", err)
        return Origin("introduced", "the input is inside the baseline's envelope", err)
    if not math.isfinite(here) or (in_rel <= in_tol and here >= INTRODUCED_RATIO * max(in_rel, 1e-30)):
        return Origin("introduced", None, err)
    return Origin(
        "inherited",
        "the input already carries a comparable error: accumulated drift or an upstream cause"
        if in_rel <= in_tol
        else "the input already exceeds its tolerance",
        err,
    )


def _largest_jump(layers: list[int], table, thresholds, embed) -> Jump | None:
    """The largest ratio of a layer's error to its input's at the same step, over every step;
    the input of layer 0 is the embeddings. The input's error counts at least at its
    tolerance, so round-off-sized errors make no jumps."""
    jump = None
    for s in range(len(table[0]) if table else 0):
        prev = (embed[0][s], embed[1][s]) if embed is not None else (None, None)
        for l, row, trow in zip(layers, table, thresholds):
            v = row[s]
            if v is not None and prev[0] is not None:
                base = max(prev[0], prev[1] or 0.0)
                if base > 0 and (jump is None or v / base > jump.ratio):
                    jump = Jump(l, v / base, prev[0], v, s)
            prev = (v, trow[s]) if v is not None else prev
    return jump


def own_error_outlier(growth: Growth) -> Outlier | None:
    """The layer and step where one layer's own error stands out against the rest (see OUTLIER_RATIO),
    or None. Each layer's step-up is its layer_out rel-L2 over its input's (layer 0's input: the
    embeddings, unless they are exact to round-off) at the same step. The input's error counts at
    least at its median over the steps (kernels whose round-off varies from step to step make a
    quiet step now and then: no step-up out of that), and both at least OUTLIER_FLOOR x the larger
    of their two tolerances; under --baseline each over BASE's first, so the envelope's own growth
    (a quantized layer's) is no step-up."""
    table, thresholds, layers = growth.table, growth.thresholds, growth.layers
    if not table or not table[0]:
        return None
    embed = growth.globals.get("embeddings")
    rows = ([(("embeddings", None), *embed)] if embed is not None else []) + [
        ((GROWTH_KIND, l), row, trow) for l, row, trow in zip(layers, table, thresholds)
    ]
    usual = {key: float(np.median([v for v in values if v is not None and math.isfinite(v)] or [0.0]))
             for key, values, _ in rows}  # fmt: skip

    def counted(key, v, floor, s):
        v = max(v, floor)
        if growth.base is None:
            return v
        b = (growth.base.get(key) or [None] * (s + 1))[s]
        return v / max(b if b is not None else 0.0, floor)

    ups = []  # (step-up, layer, step, the input's error as counted)
    for s in range(len(table[0])):
        prev = None  # (key, value, tolerance) of the last row with a value at this step
        for key, values, tols in rows:
            v, t = values[s], tols[s]
            if v is None or t is None or not math.isfinite(v):
                continue
            floor = OUTLIER_FLOOR * max(t, prev[2]) if prev is not None else 0.0
            # layer 0 fed exact embeddings: any port whose kernels differ from REF's starts its round-off
            # there, so its step-up says nothing of a bug
            if prev is not None and key[0] == GROWTH_KIND and not (prev[0][0] == "embeddings" and prev[1] < floor):
                fed = max(prev[1], usual[prev[0]], floor)
                ups.append((counted(key, v, floor, s) / counted(prev[0], fed, floor, s), key[1], s, fed))
            prev = (key, v, t)
    if not ups:
        return None
    top = max(ups)
    others = [u[0] for u in ups if u[1] != top[1]]
    typical = float(np.median(others)) if others else 1.0
    if top[0] < OUTLIER_RATIO or top[0] < OUTLIER_SPREAD * max(typical, 1.0):
        return None
    ratio, layer, step, fed = top
    return Outlier(layer, ratio, fed, table[layers.index(layer)][step], step, typical, growth.base is not None)
