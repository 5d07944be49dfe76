"""What the diff's walk (diff/core.py) keeps as it goes, and nothing of how it reads: the first
divergence (the earliest candidate in data-flow order, and how far each tensor still needs reading
to beat it), each tensor's summary (rows compared and failed, the worst value of each metric, its
status), the tensors one trace lacks, the rows a runtime did not report, the residual kinds'
per-row figures growth and origin are computed from, and the notes the result closes with."""

from __future__ import annotations

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.rows import grid_place, item_of, patch_grids, row_word

from .align import Plan
from .audio_where import DEFAULT_FRAME_MS, audio_place
from .baseline import Baseline
from .metrics import METRIC, PRIMARY, THRESHOLD_METRICS, RowStats, element_detail, ranges_text
from .origin import Key, Residuals
from .result import Divergence, Element, Problem, RowDetail, Skipped, TensorSummary
from .tolerances import StepTolerance

NOT_READ = "rows after the first divergence are not read (trace diff --full compares every row)"


def element_names(kind: str, idx: tuple) -> dict[str, int]:
    """Named axes of one element of a row: (1, 11) of q is {"head": 1, "channel": 11}; a row's last
    axis is also "channel"."""
    axes = S.KIND_BY_NAME[kind].axes
    if not idx or len(idx) != len(axes):
        return {"channel": idx[0]} if len(idx) == 1 else {}
    return {a.report: i for a, i in zip(axes, idx) if a.report} | {"channel": idx[-1]}


def image_grids(ref, towers: dict) -> dict[str, tuple[list[np.ndarray], int | None]]:
    """{"vision": (each image's real patches (x, y), the pooling kernel)} from REF's
    image_position_ids and config, where they fit its tower table; {} otherwise."""
    info = towers.get("vision")
    if info is None:
        return {}
    try:
        grids = patch_grids(ref.extra_input("image_position_ids"), info)
    except (TraceToolError, ValueError, TypeError):
        return {}
    pooling = (ref.model_config.get("vision_config") or {}).get("pooling_kernel_size")
    ok = isinstance(pooling, int) and not isinstance(pooling, bool) and 1 <= pooling <= 64
    return {} if grids is None else {"vision": (grids, pooling if ok else None)}


class Ledger:
    """The records of one diff: `offer` keeps the earliest divergence, the rest fill the tensors'
    summaries and the figures the result is computed from after the walk."""

    def __init__(self, seq: list, towers: dict, baseline: Baseline | None = None):
        self.towers = towers  # encoder towers either trace records
        self.order = {key: i for i, key in enumerate(seq)}  # (kind, layer) -> its place in data-flow order
        self.baseline = baseline
        self.notes: list[str] = []
        self.skipped: list[Skipped] = []
        self.tensors: list[TensorSummary] = []
        self.best: tuple[tuple, Divergence] | None = None  # (search key, divergence)
        self.res = Residuals()  # for growth and origin
        self.absent: dict[Key, np.ndarray] = {}  # rows a trace lacks (rows_present): not compared
        self.res.absent = self.absent  # the growth table's steps with no row compared are "not compared"
        self.plan: Plan | None = None
        self.row_steps: np.ndarray | None = None
        # {tower: (each item's grid of real patches (x, y), the pooling kernel)}: where a row sits in its image
        self.grids: dict[str, tuple[list[np.ndarray], int | None]] = {}
        self.frame_ms = DEFAULT_FRAME_MS  # an audio frame's length (the config's audio_ms_per_token)

    def begin(self, plan: Plan, row_steps: np.ndarray) -> None:
        """The aligned steps, once known: where each row sits."""
        self.plan, self.row_steps = plan, row_steps

    # ------------------------------------------------------------ candidates
    def offer(self, d: Divergence) -> None:
        spec = S.KIND_BY_NAME[d.kind]
        if self.towers:  # the JSON names each divergence's tower once the traces hold encoder towers
            d.tower = spec.tower
        if spec.encoder:
            d.row_words = self.row_words(spec, d.position)
            d.audio = audio_place(d.kind, self.towers[spec.tower], d.position, self.frame_ms)
        key = (d.step, self.order[(d.kind, d.layer)], d.position)
        if self.best is None or key < self.best[0]:
            self.best = (key, d)

    def row_limit(self, spec: S.Kind, layer) -> int | None:
        """Rows of this dataset that can still beat the best candidate so far."""
        if self.best is None:
            return None
        s_best, o_best, _ = self.best[0]
        s_lim = s_best + (1 if self.order[(spec.key, layer)] < o_best else 0)
        if spec.by_step:
            return s_lim
        if spec.encoder:  # every row is the prefill's
            return 0 if s_lim == 0 else None
        return 0 if s_lim == 0 else self.plan.step_positions[s_lim - 1][1]

    def position_of(self, spec: S.Kind, row: int) -> tuple[int, int]:
        """(step, position) of a dataset row: an encoder's rows are the prefill's, their position the row."""
        if spec.by_step:
            return row, self.plan.step_positions[row][1] - 1
        if spec.encoder:
            return 0, row
        return int(self.row_steps[row]), row

    def row_words(self, spec: S.Kind, row: int) -> str:
        """'patch 17 (image 2, its patch 5: row 0, col 5)': an encoder row for people."""
        item, within = item_of(spec, self.towers[spec.tower], row)
        what = S.TOWER_BY_NAME[spec.tower].item
        place = ""
        if spec.tower in self.grids:
            grids, pooling = self.grids[spec.tower]
            at = grid_place(spec, grids[item], within, pooling)
            place = "" if at is None else f": row {at[0]}, col {at[1]}"
        return f"{row_word(spec)} {row} ({what} {item + 1}, its {row_word(spec)} {within}{place})"

    def last_prefill_position(self) -> int:  # where step-indexed kinds' step 0 sits
        return self.plan.step_positions[0][1] - 1

    def only_in(self, kind: str, layer, where: str, diverges: bool) -> None:
        """A tensor one trace lacks: not compared; lost logits are a divergence (`diverges`)."""
        self.skipped.append(Skipped(kind, layer, f"only in {where}"))
        if diverges:
            self.offer(
                Divergence(
                    0,
                    None,
                    kind,
                    self.last_prefill_position(),
                    "missing",
                    1.0,
                    0.0,
                    Problem(f"logits stored only in {where}"),
                )
            )

    def offer_row(
        self,
        spec: S.Kind,
        layer,
        row: int,
        a_row,
        b_row,
        rs: RowStats,
        i: int,
        metric: str,
        tol: StepTolerance,
        bstats=None,
    ) -> None:
        """A float row that fails its tolerance: its worst metric, first and worst elements."""
        step, pos = self.position_of(spec, row)
        t = tol.at(step)
        if METRIC[metric].threshold:
            value, threshold = float(getattr(rs, metric)[i]), t[metric]
        else:  # non-finite: how many NaN/Inf, which never pass
            value = float(np.count_nonzero(~np.isfinite(a_row)) + np.count_nonzero(~np.isfinite(b_row)))
            threshold = 0.0
        det = element_detail(a_row, b_row, metric, t)
        first, worst = (
            Element(det[w], det[f"{w}_ref"], det[f"{w}_run"], element_names(spec.key, det[w]))
            for w in ("first", "worst")
        )
        metrics = {m.name: float(getattr(rs, m.name)[i]) for m in THRESHOLD_METRICS}
        d = Divergence(
            step, layer, spec.key, pos, metric, value, threshold, RowDetail(first, worst, metrics, tol.precision)
        )
        if bstats is not None:
            d.baseline = self.baseline.figures(metric, i, value, bstats, threshold)
        self.offer(d)

    # ------------------------------------------------------------ one tensor's summary
    def tensor(self, kind: str, layer, n_rows: int) -> TensorSummary:
        summary = TensorSummary(kind, layer, n_rows)
        self.tensors.append(summary)
        return summary

    def shape_differs(self, summary: TensorSummary, spec: S.Kind, layer, ref_shape: tuple, run_shape: tuple) -> None:
        summary.status = "shape"
        pos = self.last_prefill_position() if spec.by_step else 0
        msg = f"row shape {tuple(ref_shape[1:])} in REF vs {tuple(run_shape[1:])} in RUN"
        self.offer(
            Divergence(0, layer, spec.key, pos, "shape", 1.0, 0.0, Problem(msg, list(ref_shape), list(run_shape)))
        )

    def too_few_rows(self, summary: TensorSummary, spec: S.Kind, layer, short: int, n_rows: int, who: str) -> None:
        summary.status = "rows"
        step, pos = self.position_of(spec, short)
        self.offer(
            Divergence(
                step,
                layer,
                spec.key,
                pos,
                "rows",
                float(short),
                float(n_rows),
                Problem(f"{who} has {short} rows, the compared steps need {n_rows}"),
            )
        )

    def absent_rows(self, summary: TensorSummary, absent: np.ndarray | None, who: str | None) -> None:
        """Rows a runtime did not report: left out of the comparison and named in the report."""
        if absent is not None:
            self.absent[(summary.kind, summary.layer)] = absent
            summary.absent_rows = int(absent.sum())
            summary.absent_positions = ranges_text(np.flatnonzero(absent))
            summary.absent_in = who

    def tolerance(self, summary: TensorSummary, spec: S.Kind, tol: StepTolerance) -> None:
        self.res.thresholds[(summary.kind, summary.layer)] = tol
        summary.threshold = 0.0 if spec.dtype == "bool" else float(tol.limits[PRIMARY][0])
        summary.precision = tol.precision

    @staticmethod
    def mask_rows(summary: TensorSummary, fails: np.ndarray, rows_compared: int) -> None:
        summary.mismatched_rows = (summary.mismatched_rows or 0) + int(fails.sum())
        summary.rows_compared = rows_compared

    @staticmethod
    def float_scan(summary: TensorSummary) -> None:
        """A float tensor's scan starts: no worst value yet."""
        summary.worst = {m.name: m.best for m in THRESHOLD_METRICS}

    @staticmethod
    def float_rows(summary: TensorSummary, rs: RowStats, fails: np.ndarray, rows_compared: int) -> None:
        """One block's rows into the tensor's worst values and failures."""
        for m in THRESHOLD_METRICS:
            summary.worst[m.name] = m.worst(summary.worst[m.name], getattr(rs, m.name))
        summary.failed_rows = (summary.failed_rows or 0) + int(fails.sum())
        summary.rows_compared = rows_compared

    @staticmethod
    def close(summary: TensorSummary, diverged: bool, n_rows: int) -> None:
        """The tensor's status once its scan ends."""
        if diverged:
            summary.status = "diverged"
        elif summary.rows_compared < n_rows:  # rows after the first divergence are not read
            summary.status = "not compared" if summary.rows_compared == 0 else "partly compared"
            summary.reason = NOT_READ
        if summary.rows_compared == 0 and summary.worst is not None:  # no row read: no value, never a perfect one
            summary.worst = dict.fromkeys(summary.worst)

    # ------------------------------------------------------------ the end
    def closing_notes(self) -> list[str]:
        """The notes on what was not compared: tensors in one trace only, rows not reported, rows not read."""
        notes = []
        if self.skipped:
            notes.append(skipped_note(self.skipped))
        if self.absent:
            notes.append(absent_note(self.tensors))
        not_read = not_compared_note(self.tensors)
        if not_read:
            notes.append(not_read)
        return notes


class KeptRows:
    """A residual kind's figures for every row (its rows are read whole): rel-L2, |RUN - REF|^2 and
    |REF|^2 per row (the heatmap's), |BASE - REF|^2 in a three-way diff, and the rows outside BASE's
    envelope; into the ledger's Residuals when the scan ends."""

    def __init__(self, res: Residuals, key: Key, n_rows: int, three_way: bool):
        self.res, self.key, self.n_rows = res, key, n_rows
        self.rel = np.zeros(n_rows, dtype=np.float32)
        self.sums = (np.zeros(n_rows), np.zeros(n_rows))
        self.base_nd = np.zeros(n_rows) if three_way else None

    def outside(self, r0: int, r1: int, fails: np.ndarray) -> None:
        self.res.outside_rows.setdefault(self.key, np.zeros(self.n_rows, dtype=bool))[r0:r1] = fails

    def add(self, r0: int, r1: int, rs: RowStats, a, c, l2_floor) -> None:
        self.rel[r0:r1] = rs.rel_l2
        self.sums[0][r0:r1], self.sums[1][r0:r1] = rs.nd, rs.na
        if self.base_nd is not None and c is not None:
            self.base_nd[r0:r1] = RowStats(a, c, l2_floor).nd

    def finish(self, size: int) -> None:
        self.res.rel_rows[self.key] = self.rel
        self.res.sums[self.key] = (*self.sums, size)
        if self.base_nd is not None:
            self.res.base_sums[self.key] = (self.base_nd, self.sums[1], size)


def not_compared_note(tensors: list[TensorSummary]) -> str | None:
    none = sum(t.status == "not compared" for t in tensors)
    part = sum(t.status == "partly compared" for t in tensors)
    if not none and not part:
        return None
    counts = " and ".join(
        x for x in (f"{none} not compared" if none else "", f"{part} partly compared" if part else "") if x
    )
    counts = f"{counts} (of {len(tensors)} tensors)"
    return f"{counts}: {NOT_READ}"


def skipped_note(skipped: list[Skipped]) -> str:
    shown = ", ".join(s.kind + (f" L{s.layer}" if s.layer is not None else "") + f" ({s.reason})" for s in skipped[:12])
    return (
        "tensors in only one trace (not compared): "
        + shown
        + (f" and {len(skipped) - 12} more" if len(skipped) > 12 else "")
    )


def absent_note(tensors: list[TensorSummary]) -> str:
    parts = [
        f"{t.kind}{f' L{t.layer}' if t.layer is not None else ''} positions {t.absent_positions} (absent in "
        f"{t.absent_in})"
        for t in tensors
        if t.absent_rows
    ]
    return (
        "rows not reported (not compared): "
        + "; ".join(parts[:12])
        + (f"; and {len(parts) - 12} more tensors" if len(parts) > 12 else "")
    )
