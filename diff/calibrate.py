"""`trace calibrate REF BASE [BASE...] -o tol.toml`: tolerances from known-good runs.

For every (kind, layer) and for prefill and decode separately, the worst per-row rel-L2
of the BASE traces against REF, times a margin, becomes one `[[rule]]` of a tolerances
file (docs/tolerances.md). `trace diff REF BASE --tolerances tol.toml` is then a match by
construction:
- errors are measured with the diff's own RowStats and the l2_floor written in the rule;
- thresholds are rounded *up* to 3 significant digits, and a row fails only when its
  value is strictly greater than the threshold;
- a threshold is never below the built-in default of the tensors' precision (a tensor the
  BASE runs reproduce exactly must not forbid round-off);
- a token flip of a teacher-forced BASE is accepted as a near tie with a margin above
  REF's logit gap there.
What cannot be calibrated is refused (exit 2): a BASE with non-finite values, masks or
shapes that differ from REF's, or a free-running BASE whose tokens leave REF's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.atomic import atomic_output, check_output_path
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.rows import row_count, steps_of_rows

from .align import check_compatible, dataflow_sequence, make_plan
from .blocks import paired_blocks
from .metrics import RowStats
from .tolerances import DEFAULTS, NEAR_TIE_MARGIN, precision_class

DEFAULT_MARGIN = 2.0
PHASES = ("prefill", "decode")
EXACT_KINDS = ("mask", "token")  # compared exactly by the diff: nothing to calibrate


@dataclass
class _Worst:
    """Worst rel-L2 of one (kind, layer) per phase over all BASE runs, and where it was."""

    floor: float
    default: float
    rel: dict = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    seen: dict = field(default_factory=lambda: {p: False for p in PHASES})


def round_up(x: float, digits: int = 3) -> float:
    """The smallest float of `digits` significant digits that is >= x (printed form parses back)."""
    if x <= 0 or not math.isfinite(x):
        return x
    exp = math.floor(math.log10(x)) - (digits - 1)
    v = math.ceil(x / 10.0**exp) * 10.0**exp
    v = float(f"{v:.{digits - 1}e}")
    while v < x:  # the decimal's nearest float fell below x
        v = float(f"{v * (1 + 10.0**-digits):.{digits - 1}e}")
    return v


def toml_comment_name(path) -> str:
    """A file's name as a double-quoted, escaped string safe inside a TOML comment: no newline
    (which would end the comment and let the name write configuration) nor any other
    control character (which TOML forbids in comments)."""
    name = json.dumps(Path(path).name, ensure_ascii=True)  # escapes \n, \r, every C0 control, non-ASCII
    return name.replace("\x7f", "\\u007f")  # DEL: json leaves it raw, TOML forbids it


def _precision(ref: TraceReader, base: TraceReader, kind, layer) -> str:
    return precision_class(
        ref.source_dtype(kind, layer), base.source_dtype(kind, layer), ref.provenance["dtype"], base.provenance["dtype"]
    )


def calibrate(reference, bases, margin: float = DEFAULT_MARGIN) -> tuple[str, dict]:
    """The tolerances TOML text for REF and known-good BASE traces, and a summary dict."""
    if not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 1.0:
        raise TraceToolError(f"--margin must be a number >= 1 (the known-good runs must pass), got {margin}")
    if not bases:
        raise TraceToolError("calibrate needs at least one known-good BASE trace")
    worst: dict[tuple[str, int | None], _Worst] = {}
    tokens = {"flips": 0, "gap": 0.0}
    with TraceReader(reference) as ref:
        seq = [kl for kl in dataflow_sequence(ref.layer_counts()) if kl[0] not in EXACT_KINDS]
        ref_tokens = ref.tokens() if ref.has("token") else None
        for path in bases:
            with TraceReader(path) as base:
                _one_base(ref, base, path, seq, ref_tokens, worst, tokens)
    rules, n_rules = _rules(worst, margin)
    near = None
    if tokens["flips"]:
        near = max(NEAR_TIE_MARGIN, round_up(tokens["gap"] * margin))
        if near <= tokens["gap"]:
            near = math.nextafter(tokens["gap"], math.inf)
    head = [
        "# written by `trace calibrate`: the worst rel-L2 of the known-good runs against REF,",
        f"# times {margin:g}, per kind, layer and phase (never below the built-in default).",
        f"# REF: {toml_comment_name(reference)}; BASE: {', '.join(toml_comment_name(b) for b in bases)}",
        "version = 1",
        "",
    ]
    text = "\n".join(head) + rules
    if near is not None:
        text += (
            "\n[tokens]\n# the known-good runs flip a token where REF's top-2 gap is small\n"
            f"near_tie_margin = {near!r}\naccept_near_ties = true\n"
        )
    summary = {
        "rules": n_rules,
        "bases": len(bases),
        "margin": margin,
        "token_flips": tokens["flips"],
        "near_tie_margin": near,
    }
    return text, summary


def _one_base(ref, base, path, seq, ref_tokens, worst, tokens) -> None:
    try:
        check_compatible(ref, base)
    except TraceToolError as e:
        raise TraceToolError(f"BASE {path}: {e}") from None
    base_tokens = base.tokens() if base.has("token") else None
    plan = make_plan(ref, base, ref_tokens, base_tokens)
    m = plan.first_token_mismatch
    if m is not None:
        if plan.free_running:
            raise TraceToolError(
                f"BASE {path} is free-running and its tokens leave REF's at step {m}; "
                "replay it teacher-forced (the default) to calibrate"
            )
        lg = ref.read("logits", None, slice(m, m + 1))[0].astype(np.float64) if ref.has("logits") else None
        if lg is None or not np.all(np.isfinite(lg)):
            raise TraceToolError(f"BASE {path} flips the token at step {m} and REF has no usable logits to judge it")
        tokens["flips"] += 1
        tokens["gap"] = max(tokens["gap"], float(lg[ref_tokens[m]] - lg[base_tokens[m]]))
    present = set(base.kinds_present())
    row_steps_pos = plan.row_steps()
    for kind, layer in seq:
        if not ref.has(kind, layer) or (kind, layer) not in present:
            continue
        spec = S.KIND_BY_NAME[kind]
        da, db = ref.dataset(kind, layer), base.dataset(kind, layer)
        where = f"BASE {path}: {kind}" + (f" layer {layer}" if layer is not None else "")
        if da.shape[1:] != db.shape[1:]:
            raise TraceToolError(f"{where}: row shape {tuple(db.shape[1:])} differs from REF's {tuple(da.shape[1:])}")
        n_rows = row_count(spec, plan.n_rows, plan.numeric_steps, ref.towers) or 0
        n_rows = min(n_rows, da.shape[0], db.shape[0])
        steps = steps_of_rows(spec, n_rows, row_steps_pos, plan.numeric_steps)
        prec = _precision(ref, base, kind, layer)
        w = worst.get((kind, layer))
        if w is None:
            w = worst[(kind, layer)] = _Worst(DEFAULTS[prec]["l2_floor"], DEFAULTS[prec]["rel_l2"])
        elif DEFAULTS[prec]["rel_l2"] > w.default:  # a looser precision in another BASE
            w.floor, w.default = max(w.floor, DEFAULTS[prec]["l2_floor"]), DEFAULTS[prec]["rel_l2"]
        kept = _rows_present(ref, base, kind, layer, n_rows)  # rows a runtime did not report are no data
        for rows, a, b in paired_blocks(ref, base, kind, layer, n_rows):
            st, keep = steps[rows], kept[rows]
            rs = RowStats(a, b, np.full(len(a), w.floor))
            if rs.nonfinite.any():
                i = int(np.argmax(rs.nonfinite))
                raise TraceToolError(f"{where}: non-finite values at step {int(st[i])}; not a known-good run")
            for phase, sel in (("prefill", (st == 0) & keep), ("decode", (st > 0) & keep)):
                if sel.any():
                    w.seen[phase] = True
                    w.rel[phase] = max(w.rel[phase], float(rs.rel_l2[sel].max()))
    if base.has("mask", 0) or ref.has("mask", 0):
        _check_masks(ref, base, path, plan)


def _rows_present(ref, base, kind: str, layer, n: int) -> np.ndarray:
    """(n,) bool: rows both traces hold (a runtime may report a subset of a step's rows)."""
    keep = np.ones(n, dtype=bool)
    for r in (ref, base):
        flags = r.rows_present(kind, layer) if S.KIND_BY_NAME[kind].by_position else None
        if flags is not None:
            keep[: min(n, len(flags))] &= flags[:n]
    return keep


def _check_masks(ref, base, path, plan) -> None:
    """Masks are compared exactly by the diff: a known-good run must have REF's."""
    from .metrics import compare_mask_block

    for layer in range(len(ref.layers)):
        if not (ref.has("mask", layer) and base.has("mask", layer)):
            continue
        n = min(plan.n_rows, ref.dataset("mask", layer).shape[0], base.dataset("mask", layer).shape[0])
        count = compare_mask_block(ref.read("mask", layer, slice(0, n)), base.read("mask", layer, slice(0, n)))
        count[~_rows_present(ref, base, "mask", layer, n)] = 0
        if count.any():
            pos = int(np.argmax(count > 0))
            raise TraceToolError(
                f"BASE {path}: mask of layer {layer} differs from REF's at position {pos}; not a known-good run"
            )


def _rules(worst: dict, margin: float) -> tuple[str, int]:
    out, n = [], 0
    for (kind, layer), w in worst.items():
        for phase in PHASES:
            if not w.seen[phase]:
                continue
            t = max(w.default, round_up(w.rel[phase] * margin))
            lines = ["[[rule]]", f'kind = "{kind}"']
            if layer is not None:
                lines.append(f"layer = {layer}")
            lines += [
                f'step = "{phase}"',
                f"rel_l2 = {t!r}",
                f"l2_floor = {w.floor!r}",
                f'note = "worst {w.rel[phase]:.3e}"',
                "",
            ]
            out.append("\n".join(lines))
            n += 1
    return "\n".join(out), n


def write_calibration(reference, bases, output, margin: float = DEFAULT_MARGIN, force: bool = False) -> str:
    """Calibrate and write the TOML atomically; return a one-line summary."""
    if not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 1.0:
        raise TraceToolError(f"--margin must be a number >= 1 (the known-good runs must pass), got {margin}")
    check_output_path(output, force, inputs=(reference, *bases))  # never over a trace it reads
    text, s = calibrate(reference, bases, margin)
    with atomic_output(output, force) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    flips = f", {s['token_flips']} token flip(s) accepted as near ties" if s["token_flips"] else ""
    return f"wrote {output}: {s['rules']} rules from {s['bases']} known-good run(s), margin {margin:g}{flips}"
