"""Three-way diff: `trace diff REF RUN --baseline BASE [--baseline-factor F]`.

BASE is a trusted run on the same inputs (the same quantization simulated in PyTorch, or
the last good release of the port). A RUN row leaves BASE's error envelope, and fails,
when for some metric all four hold (docs/quantized.md):

  1. RUN vs REF fails the tolerance (the usual two-way check),
  2. RUN vs REF exceeds F times BASE vs REF on the same row (for cosine: 1 - cosine),
  3. RUN vs REF exceeds the largest error BASE makes on any row of the same tensor and step,
     where RUN and BASE are independent noisy runs (see step_worst),
  4. RUN vs BASE fails the same tolerance, BASE taken as the reference.

Non-finite values never pass. Masks fail where RUN's differs from REF's *and* from BASE's;
tokens where RUN's differs from REF's *and* from BASE's. Without (4) a RUN that is BASE
plus round-off would fail wherever BASE's own error is near zero; without (2) every
quantized row fails against a float REF. Without (3) two equally good low-precision runs
fail each other: where attention is nearly one-hot, rounding flips a near-tied argmax on a
few rows, a different few in each run, so on some row one run's error is 5-10x the other's
(measured: HF bf16 against itself, eager vs SDPA). An error BASE itself makes in that
tensor and step is then inside its envelope wherever it occurs. Where RUN tracks BASE row by
row (the same quantization as BASE's simulation), (3) does not apply: a row RUN alone gets
wrong fails even below BASE's worst. (3) is computed, for a tensor with rows beyond the
tolerance, in a first pass over all three traces; the rows are then checked in a second.
"""

from __future__ import annotations

import math
import re

import numpy as np

from gemma4_trace.traces.errors import TraceToolError

from .metrics import ROW_METRICS, RowStats
from .result import BaselineFigures

DEFAULT_FACTOR = 4.0


def check_factor(factor) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
        raise TraceToolError(f"--baseline-factor must be a number >= 1, got {factor!r}")
    return float(factor)


def _excess(metric, stats: RowStats) -> np.ndarray:
    """The metric as an error that grows from 0 (cosine: 1 - cosine)."""
    v = getattr(stats, metric.name)
    return 1.0 - v if metric.fails_below else v


class Baseline:
    """Row checks of RUN against REF inside BASE's envelope."""

    def __init__(self, path, factor: float):
        self.path = str(path)
        self.factor = check_factor(factor)

    def step_worst(self, blocks, n_steps: int) -> dict[str, np.ndarray]:
        """Check (3)'s bound per threshold metric and step: BASE's largest finite error (excess)
        over the step's rows where RUN does not track BASE row by row (the median RUN vs BASE
        error is at least 1/F of the median BASE vs REF error: two independent noisy runs), and
        0 where it does (RUN is BASE's computation: its rows must follow BASE's, check 2 alone).
        `blocks` yields (REF rows, RUN rows, BASE rows, l2 floor, skip, step) per row."""
        names = [m.name for m in ROW_METRICS if m.threshold]
        base_err, run_base, steps = {n: [] for n in names}, {n: [] for n in names}, []
        for a, b, c, floor, skip, st in blocks:
            keep = ~skip
            vs_ref, vs_base = RowStats(a, c, floor), RowStats(c, b, floor)
            for m in ROW_METRICS:
                if m.threshold:
                    base_err[m.name].append(_excess(m, vs_ref)[keep])
                    run_base[m.name].append(_excess(m, vs_base)[keep])
            steps.append(st[keep])
        bound = {n: np.zeros(n_steps) for n in names}
        if not steps:
            return bound
        st = np.concatenate(steps)
        cuts = np.flatnonzero(np.diff(st)) + 1  # rows come in step order
        for n in names:
            for s, e, r in zip(
                np.split(st, cuts),
                np.split(np.concatenate(base_err[n]), cuts),
                np.split(np.concatenate(run_base[n]), cuts),
            ):
                e, r = e[np.isfinite(e)], r[np.isfinite(r)]
                if s.size and e.size and r.size and self.factor * np.median(r) >= np.median(e):
                    bound[n][s[0]] = e.max()
        return bound

    def failing(
        self, a, b, c, rs: RowStats, floor, limits: dict, skip, ceiling, lacks=None
    ) -> tuple[np.ndarray, np.ndarray, tuple]:
        """Like RowStats.failing for REF a, RUN b, BASE c: (fails, first failing metric index,
        stats for figures) per row. BASE's numbers are computed only for the rows that fail
        the plain tolerance (few in a float RUN, all in a quantized one). `ceiling()`: per metric,
        BASE's worst excess in each row's step (step_worst, by row), called only for such rows.
        `lacks`: rows BASE has no data for (REF's stand in): no envelope, the tolerance alone."""
        n = len(a)
        beyond = {m.name: m.fails(getattr(rs, m.name), limits[m.name]) for m in ROW_METRICS if m.threshold}
        cand = np.zeros(n, dtype=bool)
        for v in beyond.values():
            cand |= v
        rows = np.flatnonzero(cand & ~skip)
        checks = {m.name: (rs.nonfinite if not m.threshold else np.zeros(n, dtype=bool)) for m in ROW_METRICS}
        base = rvb = ceil = None
        if rows.size:
            ceil = ceiling()
            base = RowStats(a[rows], c[rows], floor[rows])  # BASE vs REF
            rvb = RowStats(c[rows], b[rows], floor[rows])  # RUN vs BASE, BASE as the reference
            for m in ROW_METRICS:
                if m.threshold:
                    run_exc = _excess(m, rs)[rows]
                    outside = (run_exc > self.factor * _excess(m, base)) & (run_exc > ceil[m.name][rows])
                    if lacks is not None:
                        outside |= lacks[rows]
                    vs_base = m.fails(getattr(rvb, m.name), limits[m.name][rows])
                    checks[m.name][rows] = beyond[m.name][rows] & outside & vs_base
        stacked = np.stack([checks[m.name] for m in ROW_METRICS])
        return stacked.any(axis=0) & ~skip, np.argmax(stacked, axis=0), (rows, base, rvb, ceil)

    def figures(self, metric, i: int, value: float, stats: tuple, threshold: float) -> BaselineFigures:
        rows, base, rvb, ceil = stats
        m = next(x for x in ROW_METRICS if x.name == metric)
        j = int(np.searchsorted(rows, i))
        if not m.threshold or j >= rows.size or rows[j] != i:  # non-finite: no envelope
            return BaselineFigures(
                self.path, self.factor, float("nan"), float("nan"), float("nan"), float("nan"), threshold
            )
        b_exc = float(_excess(m, base)[j])
        r_exc = 1.0 - value if m.fails_below else value
        ratio = r_exc / b_exc if b_exc > 0 else math.inf
        worst = float(ceil[m.name][i])
        return BaselineFigures(
            self.path,
            self.factor,
            float(getattr(base, m.name)[j]),
            ratio,
            1.0 - worst if m.fails_below else worst,
            float(getattr(rvb, m.name)[j]),
            threshold,
        )


def check_baseline(ref, run, base) -> None:
    """Raise TraceToolError (exit 2) when BASE cannot judge RUN against REF."""
    from .align import check_compatible

    where = f"BASE {base.path}"
    try:
        check_compatible(ref, base)
    except TraceToolError as e:
        raise TraceToolError(f"{where} cannot be a baseline here: {e}") from None
    need = min(ref.n_steps, run.n_steps)
    recorded = base.mode == "reference"  # fed its own tokens: an envelope only until they leave REF's
    if recorded and ref.has("token") and base.has("token"):
        rt, bt = ref.tokens(), base.tokens()
        leave = np.flatnonzero(rt[: min(need, rt.size, bt.size)] != bt[: min(need, rt.size, bt.size)])
        need = min(need, int(leave[0]) + 1) if leave.size else need
    if base.n_steps < need:
        how = (
            f"record BASE with --max-new-tokens {need} or more"
            if recorded
            else "replay BASE on REF's inputs (teacher-forced)"
        )
        raise TraceToolError(f"{where} has {base.n_steps} steps, REF and RUN compare {need}: {how}")
    if (base.mode == "isolated") != (run.mode == "isolated"):
        raise TraceToolError(f"{where} is {base.mode} and RUN is {run.mode}: a baseline must be replayed the same way")
    if base.mode == "free-running" and ref.has("token") and base.has("token"):
        rt, bt = ref.tokens()[:need], base.tokens()[:need]
        if bt.size < rt.size or (bt != rt).any():
            raise TraceToolError(f"{where} is free-running and its tokens leave REF's: replay it teacher-forced")
    for kind, layer in base.kinds_present():
        if ref.has(kind, layer) and kind not in ("mask", "token"):
            a, b = ref.dataset(kind, layer).shape[1:], base.dataset(kind, layer).shape[1:]
            if a != b:
                what = kind + (f" of layer {layer}" if layer is not None else "")
                raise TraceToolError(f"{where}: {what} rows are {tuple(b)}, REF's are {tuple(a)}")


_SCHEME = re.compile(r"(?:^|[-+])(w\d+(?:g\d+)?(?:a\d+)?)$")  # static-w8, static-w4g32, bug-...+w8a8


def quantization_note(run, base) -> str | None:
    """One line when BASE and RUN ran different quantizations (by their provenance runtime
    names: static-w8 vs static-w4g32, or a float BASE): allowed, but the envelope is then
    another scheme's."""
    names = [t.provenance["runtime"] for t in (base, run)]
    schemes = [m[1] if (m := _SCHEME.search(n)) else None for n in names]
    if schemes[0] == schemes[1]:
        return None
    what = [f"{n} ({s or 'no quantization in its name'})" for n, s in zip(names, schemes)]
    return f"BASE ran {what[0]}, RUN {what[1]}: RUN is judged by the envelope of another quantization than its own"
