"""Alignment of two traces: refuse incompatible ones, decide which steps and rows compare."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader

# model_config keys that change tensor shapes or the computation's structure
ARCH_KEYS = (
    "num_hidden_layers",
    "layer_types",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "head_dim",
    "global_head_dim",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "num_kv_shared_layers",
    "sliding_window",
    "attention_k_eq_v",
    "use_double_wide_mlp",
    "enable_moe_block",
    "num_experts",
    "kv_sharing_modes",
)
_ONE_LAYER = S.dataflow({S.TEXT: 1})
PRE_KINDS = tuple(s.kind for s in itertools.takewhile(lambda s: s.layer is None, _ONE_LAYER))  # the text tower's


def dataflow_sequence(layers: int | dict[str, int]) -> list[tuple[str, int | None]]:
    """Every (kind key, layer) in the order the diff searches them within a step: `layers` is the
    text tower's layer count, or {tower: layer count} with the encoder towers (searched first)."""
    counts = layers if isinstance(layers, dict) else {S.TEXT: layers}
    return [(s.key, s.layer) for s in S.dataflow(counts)]


def _arch(cfg: dict) -> dict:
    out = {k: cfg[k] for k in ARCH_KEYS if k in cfg}
    text = cfg.get("text_config")
    if isinstance(text, dict):
        out.update({f"text_config.{k}": text[k] for k in ARCH_KEYS if k in text})
    return out


def check_compatible(ref: TraceReader, run: TraceReader) -> None:
    """Raise TraceToolError naming what differs when the traces are not of one model and prompt."""
    diffs = []
    if len(ref.layers) != len(run.layers):
        diffs.append(f"layer count {len(ref.layers)} vs {len(run.layers)}")
    else:
        for i, (a, b) in enumerate(zip(ref.layers, run.layers)):
            for f in S.LAYER_FIELDS:
                va, vb = getattr(a, f), getattr(b, f)
                if va != vb:
                    diffs.append(f"layer {i} {f} {va} vs {vb}")
    try:
        ca, cb = _arch(ref.model_config), _arch(run.model_config)
    except ValueError:
        ca = cb = {}
    for k in sorted(set(ca) & set(cb)):
        if ca[k] != cb[k]:
            diffs.append(f"{k} {_short(ca[k])} vs {_short(cb[k])}")
    for name in sorted(set(ref.towers) & set(run.towers)):
        a, b = ref.towers[name], run.towers[name]
        if (a.layers, a.hidden, a.heads, a.head_dim) != (b.layers, b.hidden, b.heads, b.head_dim):
            diffs.append(f"{name} tower {_tower_words(a)} vs {_tower_words(b)}")
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise TraceToolError(f"traces are of different model architectures (REF vs RUN): {shown}")
    for name in sorted(set(ref.towers) & set(run.towers)):
        a, b = ref.towers[name], run.towers[name]
        if (a.item_rows, a.item_tokens) != (b.item_rows, b.item_tokens):
            raise TraceToolError(
                f"traces encode different inputs in the {name} tower: REF {_items(a)}, RUN {_items(b)}"
            )
    a, b = ref.prompt_ids, run.prompt_ids
    if a.shape != b.shape or not np.array_equal(a, b):
        n = min(a.size, b.size)
        first = next((i for i in range(n) if a[i] != b[i]), n)
        where = (
            f"first difference at index {first}: {a[first]} vs {b[first]}"
            if first < n
            else "one is a prefix of the other"
        )
        raise TraceToolError(f"traces have different prompts: REF has {a.size} ids, RUN has {b.size} ({where})")
    n = min(ref.n_steps, run.n_steps)
    if ref.step_positions[:n] != run.step_positions[:n]:
        s = next(i for i in range(n) if ref.step_positions[i] != run.step_positions[i])
        raise TraceToolError(
            f"traces feed different positions at step {s}: REF {ref.step_positions[s]} vs RUN {run.step_positions[s]}"
        )


def _tower_words(t) -> str:
    return f"({t.layers} layers, hidden {t.hidden}, {t.heads} heads of {t.head_dim})"


def _items(t) -> str:
    return f"rows {'+'.join(map(str, t.item_rows))}, soft tokens {'+'.join(map(str, t.item_tokens))}"


def _short(v) -> str:
    t = str(v)
    return t if len(t) <= 60 else t[:57] + "..."


@dataclass
class Plan:
    """Which steps compare: tokens over `token_steps`, numbers over steps 0..numeric_steps-1."""

    token_steps: int
    numeric_steps: int
    step_positions: list[tuple[int, int]]
    free_running: bool
    first_token_mismatch: int | None

    @property
    def n_rows(self) -> int:  # position rows compared
        return self.step_positions[self.numeric_steps - 1][1]

    def row_steps(self) -> np.ndarray:
        lengths = [b - a for a, b in self.step_positions[: self.numeric_steps]]
        return np.repeat(np.arange(self.numeric_steps), lengths)


def make_plan(ref: TraceReader, run: TraceReader, ref_tokens, run_tokens) -> Plan:
    steps = min(ref.n_steps, run.n_steps)
    mismatch = None
    if ref_tokens is not None and run_tokens is not None:
        n = min(steps, ref_tokens.size, run_tokens.size)
        diff = np.flatnonzero(ref_tokens[:n] != run_tokens[:n])
        mismatch = int(diff[0]) if diff.size else None
    # a candidate that fed its own tokens (free-running, or a second reference recording: another
    # dtype, another transformers release) has other inputs once its tokens differ from REF's
    free = "free-running" in (ref.mode, run.mode) or run.mode == "reference"
    numeric = mismatch + 1 if (free and mismatch is not None) else steps
    return Plan(steps, numeric, list(ref.step_positions[:steps]), free, mismatch)


def plan_notes(ref: TraceReader, run: TraceReader, base: TraceReader | None, plan: Plan, ref_tokens) -> list[str]:
    """What the plan leaves uncompared, in words: steps one trace lacks, steps after a
    free-running flip, a BASE recording's steps after its tokens leave REF's (this shortens
    plan.numeric_steps), what selective recordings left out."""
    notes = []
    if ref.n_steps != run.n_steps:
        fewer, more = ("RUN", "REF") if run.n_steps < ref.n_steps else ("REF", "RUN")
        notes.append(
            f"{fewer} has {min(ref.n_steps, run.n_steps)} steps, {more} has {max(ref.n_steps, run.n_steps)}: "
            f"compared the first {plan.token_steps}"
        )
    m = plan.first_token_mismatch
    if run.mode == "reference":
        notes.append("RUN is a reference recording: it fed its own tokens, so it is compared as free-running")
    if plan.free_running and m is not None and plan.numeric_steps < plan.token_steps:
        notes.append(
            f"free-running trace: tokens differ from step {m}, so tensors of steps {m + 1}.."
            f"{plan.token_steps - 1} were not compared (their inputs differ)"
        )
    notes += _base_steps(base, plan, ref_tokens)
    for who, r in (("REF", ref), ("RUN", run)):
        if r.selection is not None:
            notes.append(
                f"{who} is a selective recording, keeping only {r.selection.describe()}: the rest was not compared"
            )
    return notes


def _base_steps(base: TraceReader | None, plan: Plan, ref_tokens) -> list[str]:
    """A BASE that is a reference recording fed its own tokens: once they leave REF's, its
    later steps had other inputs than REF's and give no envelope, so the numbers of those
    steps are not compared. (A free-running BASE that leaves them is refused instead, as it
    can be replayed teacher-forced; a recording cannot.)"""
    if base is None or base.mode != "reference" or ref_tokens is None or not base.has("token"):
        return []
    bt = base.tokens()
    n = min(plan.numeric_steps, bt.size, ref_tokens.size)
    leave = np.flatnonzero(bt[:n] != ref_tokens[:n])
    if not (leave.size and leave[0] + 1 < plan.numeric_steps):
        return []
    m = int(leave[0])
    note = (
        f"BASE is a reference recording whose tokens leave REF's at step {m}: its later steps had "
        f"other inputs, so tensors and tokens of steps {m + 1}..{plan.numeric_steps - 1} were not judged"
    )
    plan.numeric_steps = m + 1
    return [note]
