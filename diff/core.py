"""compare: one streaming pass over both traces in data-flow order, then the result data.

Memory is bounded by a row block of the largest dataset (BLOCK_BYTES per trace plus a
few temporaries of that size) and per-row metric vectors; never the whole trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.rows import item_of, layer_counts, row_count, row_word, steps_of_rows

from .align import Plan, check_compatible, dataflow_sequence, make_plan, plan_notes
from .baseline import DEFAULT_FACTOR, Baseline, check_baseline, quantization_note
from .blocks import Block, Task, absent_rows, compared_blocks, tasks_of
from .isolation import rank_layers
from .logits import logit_metrics, logit_steps
from .metrics import (
    METRIC,
    METRIC_ORDER,
    PRIMARY,
    THRESHOLD_METRICS,
    RowStats,
    RowSums,
    compare_mask_block,
    element_detail,
    image_blocks,
    mask_row_detail,
    ranges_text,
)
from .origin import Residuals, origin
from .origin import growth as growth_table
from .parallel import BlockPool, workers_wanted
from .result import (
    BaselineInfo,
    DiffResult,
    Divergence,
    Element,
    MaskDetail,
    Problem,
    RowDetail,
    Skipped,
    Steps,
    TensorSummary,
    TraceInfo,
)
from .tokens import judge_tokens
from .tolerances import StepTolerance, Tolerances, load_tolerances, precision_class


def element_names(kind: str, idx: tuple) -> dict[str, int]:
    """Named axes of one element of a row: (1, 11) of q is {"head": 1, "channel": 11}; a row's last
    axis is also "channel"."""
    axes = S.KIND_BY_NAME[kind].axes
    if not idx or len(idx) != len(axes):
        return {"channel": idx[0]} if len(idx) == 1 else {}
    return {a.report: i for a, i in zip(axes, idx) if a.report} | {"channel": idx[-1]}


def _same_row_shape(spec: S.Kind, da, db) -> bool:
    if spec.grows:  # key axis widths may differ (a static runtime's max_seq): compare the rest
        return da.ndim == db.ndim == spec.row_ndim + 1 and da.shape[1:-1] == db.shape[1:-1]
    return da.shape[1:] == db.shape[1:]


def _info(r: TraceReader, path) -> TraceInfo:
    p = r.provenance
    return TraceInfo(
        str(path),
        p["mode"],
        p["dtype"],
        p["runtime"],
        p["device"],
        r.n_steps,
        r.n_positions,
        p["model_name"],
        p["model_config_sha256"],
    )


class _Differ:
    def __init__(
        self,
        ref: TraceReader,
        run: TraceReader,
        tol: Tolerances,
        base: TraceReader | None = None,
        baseline: Baseline | None = None,
        full: bool = False,
        pool: BlockPool | None = None,
    ):
        self.ref, self.run, self.tol = ref, run, tol
        self.pool = pool  # worker processes reading blocks (diff/parallel.py); None: this process
        self._logit_parts: dict[Task, tuple] = {}  # logit metrics that came with the logits' figures
        self.full = full  # every row of every tensor (the whole error map), no early stop
        self.base, self.baseline = base, baseline  # three-way (diff/baseline.py) when given
        self.layers = ref.layers
        self.towers = {**run.towers, **ref.towers}  # encoder towers either trace records (REF's table wins)
        self.seq = dataflow_sequence(layer_counts(len(self.layers), self.towers))
        self.order = {key: i for i, key in enumerate(self.seq)}
        self.notes: list[str] = []
        self.skipped: list[Skipped] = []
        self.tensors: list[TensorSummary] = []
        self.best: tuple[tuple, Divergence] | None = None  # (search key, divergence)
        self.res = Residuals()  # for growth and origin
        self.absent: dict[tuple[str, int | None], np.ndarray] = {}  # rows a trace lacks (rows_present): not compared
        self.res.absent = self.absent  # the growth table's steps with no row compared are "not compared"

    # ------------------------------------------------------------ candidates
    def _offer(self, d: Divergence) -> None:
        spec = S.KIND_BY_NAME[d.kind]
        if self.towers:  # the JSON names each divergence's tower once the traces hold encoder towers
            d.tower = spec.tower
        if spec.encoder:
            d.row_words = self._row_words(spec, d.position)
        key = (d.step, self.order[(d.kind, d.layer)], d.position)
        if self.best is None or key < self.best[0]:
            self.best = (key, d)

    def _row_limit(self, spec: S.Kind, layer) -> int | None:
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

    def _position_of(self, spec: S.Kind, row: int) -> tuple[int, int]:
        """(step, position) of a dataset row: an encoder's rows are the prefill's, their position the row."""
        if spec.by_step:
            return row, self.plan.step_positions[row][1] - 1
        if spec.encoder:
            return 0, row
        return int(self.row_steps[row]), row

    def _row_words(self, spec: S.Kind, row: int) -> str:
        """'patch 17 (image 2, its patch 5)': an encoder row for people."""
        item, within = item_of(spec, self.towers[spec.tower], row)
        what = S.TOWER_BY_NAME[spec.tower].item
        return f"{row_word(spec)} {row} ({what} {item + 1}, its {row_word(spec)} {within})"

    def _last_prefill_position(self) -> int:  # where step-indexed kinds' step 0 sits
        return self.plan.step_positions[0][1] - 1

    # ------------------------------------------------------------ main pass
    def run_all(self) -> None:
        ref, run = self.ref, self.run
        self.ref_tokens = ref.tokens() if ref.has("token") else None
        self.run_tokens = run.tokens() if run.has("token") else None
        self.plan: Plan = make_plan(ref, run, self.ref_tokens, self.run_tokens)
        self.notes += plan_notes(ref, run, self.base, self.plan, self.ref_tokens)  # may shorten the numeric steps
        self.row_steps = self.plan.row_steps()
        tokens = judge_tokens(ref, self.base, self.plan, self.ref_tokens, self.run_tokens, self.tol)
        self.tokens = tokens.info
        self.notes += tokens.notes
        self.skipped += tokens.skipped
        if tokens.divergence is not None:
            self._offer(tokens.divergence)
        present_ref = set(ref.kinds_present())
        present_run = set(run.kinds_present())
        # a RUN of tokens alone (an engine that exposes no logits, api.TokenOnly) is compared by its
        # tokens; a RUN with tensors but no logits lost them, and that is a divergence
        tokens_only = not any(S.KIND_BY_NAME[k].dtype != "int" for k, _ in present_run)
        if self.pool is not None:
            self.pool.plan(ref, run, self._planned(present_ref & present_run), self._wanted)
        for kind, layer in self.seq:
            if S.KIND_BY_NAME[kind].dtype == "int":  # chosen tokens: compared above
                continue
            a, b = (kind, layer) in present_ref, (kind, layer) in present_run
            if not a and not b:
                continue
            if a != b:
                where = "REF" if a else "RUN"
                self.skipped.append(Skipped(kind, layer, f"only in {where}"))
                if kind == "logits" and not (a and tokens_only):
                    self._offer(
                        Divergence(
                            0,
                            None,
                            kind,
                            self._last_prefill_position(),
                            "missing",
                            1.0,
                            0.0,
                            Problem(f"logits stored only in {where}"),
                        )
                    )
                continue
            self._compare(kind, layer)

    def _tolerance(self, kind, layer) -> StepTolerance:
        ra = self.ref.source_dtype(kind, layer)
        rb = self.run.source_dtype(kind, layer)
        prec = precision_class(ra, rb, self.ref.provenance["dtype"], self.run.provenance["dtype"])
        t = self.tol.resolve(kind, layer, prec, self.plan.numeric_steps)
        self.res.thresholds[(kind, layer)] = t
        return t

    # ------------------------------------------------------------ one (kind, layer)
    def _extent(self, spec: S.Kind, layer) -> tuple[int, int | None]:
        """(rows the compared steps need, rows both traces hold of them; None: row shapes differ)."""
        da, db = self.ref.dataset(spec.key, layer), self.run.dataset(spec.key, layer)
        n_rows = self._rows_needed(spec)
        if not _same_row_shape(spec, da, db):
            return n_rows, None
        return n_rows, min(n_rows, da.shape[0], db.shape[0])

    def _rows_needed(self, spec: S.Kind) -> int:
        """Rows of a kind the compared steps need (an encoder's: all its tower's)."""
        n = row_count(spec, self.plan.n_rows, self.plan.numeric_steps, self.towers)
        return 0 if n is None else n

    def _planned(self, both: set) -> Iterator[Task]:
        """Every block the pass may take from the worker pool, in the order it takes them: the
        tensors compared two-way (seq order), the logit metrics' blocks with the logits' own
        (one read for both) or after the rest."""
        steps = logit_steps(self.ref, self.run, self.plan.numeric_steps)
        for kind, layer in self.seq:
            spec = S.KIND_BY_NAME[kind]
            if spec.dtype == "int" or (kind, layer) not in both or self._three_way(kind, layer):
                continue
            _, rows = self._extent(spec, layer)
            together = kind == "logits" and rows == steps
            if rows:
                yield from tasks_of(self.ref.dataset(kind, layer), kind, layer, rows, logits=together)
            steps = 0 if together else steps
        if steps:
            yield from tasks_of(self.ref.dataset("logits"), "logits", None, steps, logits=True)

    def _logit_part(self, task: Task):
        """One block's logit metrics: kept when the pass took the block's figures, else taken now."""
        part = self._logit_parts.pop(task, None)
        return part if part is not None else self.pool.take(task)[1]

    def _wanted(self, task: Task) -> bool:
        """Whether a planned block can still matter: the row limit only shrinks as the pass goes."""
        if task.logits or self.full or S.KIND_BY_NAME[task.kind].residual:
            return True
        limit = self._row_limit(S.KIND_BY_NAME[task.kind], task.layer)
        return limit is None or task.r0 < limit

    def _compare(self, kind: str, layer) -> None:
        spec = S.KIND_BY_NAME[kind]
        da, db = self.ref.dataset(kind, layer), self.run.dataset(kind, layer)
        n_rows, _ = self._extent(spec, layer)
        summary = TensorSummary(kind, layer, n_rows)
        self.tensors.append(summary)
        if not _same_row_shape(spec, da, db):
            summary.status = "shape"
            pos = self._last_prefill_position() if spec.by_step else 0
            msg = f"row shape {tuple(da.shape[1:])} in REF vs {tuple(db.shape[1:])} in RUN"
            self._offer(
                Divergence(0, layer, kind, pos, "shape", 1.0, 0.0, Problem(msg, list(da.shape), list(db.shape)))
            )
            return
        short = min(da.shape[0], db.shape[0])
        if short < n_rows:
            summary.status = "rows"
            who = "REF" if da.shape[0] < db.shape[0] else "RUN"
            step, pos = self._position_of(spec, short)
            self._offer(
                Divergence(
                    step,
                    layer,
                    kind,
                    pos,
                    "rows",
                    float(short),
                    float(n_rows),
                    Problem(f"{who} has {short} rows, the compared steps need {n_rows}"),
                )
            )
            n_rows = short
        self._absent_rows(kind, layer, n_rows, summary)
        tol = self._tolerance(kind, layer)
        summary.threshold = 0.0 if spec.dtype == "bool" else float(tol.limits[PRIMARY][0])
        summary.precision = tol.precision
        scan = self._scan_mask if spec.dtype == "bool" else self._scan_rows
        if scan(spec, layer, n_rows, tol, summary):
            summary.status = "diverged"
        elif summary.rows_compared < n_rows:  # rows after the first divergence are not read
            summary.status = "not compared" if summary.rows_compared == 0 else "partly compared"
            summary.reason = NOT_READ
        if summary.rows_compared == 0 and summary.worst is not None:  # no row read: no value, never a perfect one
            summary.worst = dict.fromkeys(summary.worst)

    def _absent_rows(self, kind: str, layer, n_rows: int, summary: TensorSummary) -> None:
        """Rows a runtime did not report: left out of the comparison and named in the report."""
        absent, who = absent_rows(self.ref, self.run, kind, layer, n_rows)
        if absent is not None:
            self.absent[(kind, layer)] = absent
            summary.absent_rows = int(absent.sum())
            summary.absent_positions = ranges_text(np.flatnonzero(absent))
            summary.absent_in = who

    def _image_blocks_of(self, ra: np.ndarray, rb: np.ndarray, position: int) -> list[dict] | None:
        return image_blocks(self.ref.model_config, self.ref.prompt_ids, ra, rb, position)

    def _blocks(self, spec: S.Kind, layer, n_rows: int, keep: bool) -> Iterator[Block]:
        """The blocks of rows that can still beat the best divergence so far (all rows when `keep`)."""
        limit = None if keep or self.full else self._row_limit(spec, layer)
        end = n_rows if limit is None else min(n_rows, limit)
        row_steps = steps_of_rows(spec, n_rows, self.row_steps, self.plan.numeric_steps)
        three_way = self._three_way(spec.key, layer)
        if self.pool is not None and not three_way:
            return self._pooled_blocks(spec.key, layer, n_rows, end, row_steps)
        return compared_blocks(
            self.ref,
            self.run,
            self.base if three_way else None,
            spec.key,
            layer,
            end,
            row_steps,
            self.absent.get((spec.key, layer)),
        )

    def _pooled_blocks(self, kind: str, layer, n_rows: int, end: int, row_steps: np.ndarray) -> Iterator[Block]:
        """compared_blocks' blocks of rows 0..end-1 with their figures from the worker pool (no rows)."""
        together = kind == "logits" and n_rows == logit_steps(self.ref, self.run, self.plan.numeric_steps)
        for task in tasks_of(self.ref.dataset(kind, layer), kind, layer, n_rows, logits=together):
            if task.r0 >= end:
                return
            figures, r1 = self.pool.take(task), min(task.r1, end)
            if together:
                figures, self._logit_parts[task] = figures
            if r1 < task.r1:  # the pass needs fewer rows than the worker read: its figures are per row
                figures = figures.head(r1 - task.r0) if isinstance(figures, RowSums) else figures[: r1 - task.r0]
            yield Block(task.r0, None, None, None, None, row_steps[task.r0 : r1], figures)

    def _rows_of(self, kind: str, layer, k: Block, i: int) -> tuple[np.ndarray, np.ndarray]:
        """REF's and RUN's row i of block k (read again when a worker compared the block)."""
        if k.ref is not None:
            return k.ref[i], k.run[i]
        row = slice(k.first + i, k.first + i + 1)
        return self.ref.read(kind, layer, row)[0], self.run.read(kind, layer, row)[0]

    def _base_step_worst(self, spec: S.Kind, layer, n_rows: int, tol: StepTolerance) -> dict[str, np.ndarray]:
        """Check 3's bound per step of this tensor (diff/baseline.py), from one pass over all three."""
        blocks = (
            (k.ref, k.run, k.base, tol.l2_floor[k.steps], tol.skip[k.steps] | k.base_lacks, k.steps)  # BASE's own rows
            for k in self._blocks(spec, layer, n_rows, keep=True)
        )
        return self.baseline.step_worst(blocks, len(tol.skip))

    def _three_way(self, kind: str, layer) -> bool:
        return self.base is not None and self.base.has(kind, layer)

    def _scan_mask(self, spec: S.Kind, layer, n_rows: int, tol: StepTolerance, summary: TensorSummary) -> bool:
        """Boolean rows compare exactly: the first row with a differing key diverges."""
        found = False
        for k in self._blocks(spec, layer, n_rows, keep=False):
            count = k.figures
            fails = (count > 0) & ~tol.skip[k.steps]
            if k.base is not None:  # a difference BASE has too is inside its envelope
                fails &= compare_mask_block(k.base, k.run) > 0
            summary.mismatched_rows = (summary.mismatched_rows or 0) + int(fails.sum())
            summary.rows_compared = k.first + len(k.steps)
            if fails.any() and not found:
                i = int(np.argmax(fails))
                step, pos = self._position_of(spec, k.first + i)
                a_row, b_row = self._rows_of(spec.key, layer, k, i)
                detail = MaskDetail(**mask_row_detail(a_row, b_row))
                detail.image_blocks = self._image_blocks_of(a_row, b_row, pos)
                self._offer(Divergence(step, layer, spec.key, pos, "mask_keys", float(count[i]), 0.0, detail))
                found = True
            if found and not self.full:
                break
        return found

    def _scan_rows(self, spec: S.Kind, layer, n_rows: int, tol: StepTolerance, summary: TensorSummary) -> bool:
        """Float rows: every row metric against its tolerance; residual kinds are read whole."""
        keep = spec.residual
        if keep:
            rel_all = np.zeros(n_rows, dtype=np.float32)
            sums = (np.zeros(n_rows), np.zeros(n_rows))  # |RUN - REF|^2, |REF|^2 per row: the heatmap's
            base_nd = np.zeros(n_rows) if self._three_way(spec.key, layer) else None  # |BASE - REF|^2
        worst = {m.name: m.best for m in THRESHOLD_METRICS}
        found = False
        step_worst = {}  # BASE's worst per step: read on first need (no row beyond the tolerance: never)

        def ceiling(st):
            if not step_worst:
                step_worst.update(self._base_step_worst(spec, layer, n_rows, tol))
            return {m: v[st] for m, v in step_worst.items()}

        for k in self._blocks(spec, layer, n_rows, keep):
            r0, a, b, c, st = k.first, k.ref, k.run, k.base, k.steps
            r1 = r0 + len(st)
            rs = RowStats.of_sums(k.figures, tol.l2_floor[st])
            limits = {f: v[st] for f, v in tol.limits.items()}
            bstats = None
            if c is None:
                fails, which = rs.failing(limits, tol.skip[st])
            else:
                fails, which, bstats = self.baseline.failing(
                    a, b, c, rs, tol.l2_floor[st], limits, tol.skip[st], lambda st=st: ceiling(st), k.base_lacks
                )
                if keep:
                    self.res.outside_rows.setdefault((spec.key, layer), np.zeros(n_rows, dtype=bool))[r0:r1] = fails
            for m in THRESHOLD_METRICS:
                worst[m.name] = m.worst(worst[m.name], getattr(rs, m.name))
            summary.failed_rows = (summary.failed_rows or 0) + int(fails.sum())
            if keep:
                rel_all[r0:r1] = rs.rel_l2
                sums[0][r0:r1], sums[1][r0:r1] = rs.nd, rs.na
                if base_nd is not None and c is not None:
                    base_nd[r0:r1] = RowStats(a, c, tol.l2_floor[st]).nd
            if not found and fails.any():
                i = int(np.argmax(fails))
                a_row, b_row = self._rows_of(spec.key, layer, k, i)
                self._offer_row(spec, layer, r0 + i, a_row, b_row, rs, i, METRIC_ORDER[which[i]], tol, bstats)
                found = True
            summary.rows_compared = r1
            if found and not keep and not self.full:
                break
        summary.worst = worst
        if keep:
            self.res.rel_rows[(spec.key, layer)] = rel_all
            size = int(np.prod(self.ref.dataset(spec.key, layer).shape[1:]))
            self.res.sums[(spec.key, layer)] = (*sums, size)
            if base_nd is not None:
                self.res.base_sums[(spec.key, layer)] = (base_nd, sums[1], size)
        return found

    def _offer_row(
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
        step, pos = self._position_of(spec, row)
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
        self._offer(d)


NOT_READ = "rows after the first divergence are not read (trace diff --full compares every row)"


def _not_compared_note(tensors: list[TensorSummary]) -> str | None:
    none = sum(t.status == "not compared" for t in tensors)
    part = sum(t.status == "partly compared" for t in tensors)
    if not none and not part:
        return None
    counts = " and ".join(
        x for x in (f"{none} not compared" if none else "", f"{part} partly compared" if part else "") if x
    )
    counts = f"{counts} (of {len(tensors)} tensors)"
    return f"{counts}: {NOT_READ}"


def _skipped_note(skipped: list[Skipped]) -> str:
    shown = ", ".join(s.kind + (f" L{s.layer}" if s.layer is not None else "") + f" ({s.reason})" for s in skipped[:12])
    return (
        "tensors in only one trace (not compared): "
        + shown
        + (f" and {len(skipped) - 12} more" if len(skipped) > 12 else "")
    )


def _absent_note(tensors: list[TensorSummary]) -> str:
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


def compare(
    ref_path,
    run_path,
    tolerances_path=None,
    baseline_path=None,
    baseline_factor: float = DEFAULT_FACTOR,
    full: bool = False,
) -> DiffResult:
    """Compare a candidate trace against a reference; raise TraceToolError on bad input.
    The result holds numbers and facts only (diff_traces adds the divergence's sentence).

    With `baseline_path`, RUN is judged by BASE's error envelope (diff/baseline.py). With `full`,
    every row of every tensor is compared (no early stop after the first divergence)."""
    tol = load_tolerances(tolerances_path)
    baseline = Baseline(baseline_path, baseline_factor) if baseline_path is not None else None
    with contextlib.ExitStack() as stack:
        workers = workers_wanted(ref_path, run_path)
        pool = BlockPool(ref_path, run_path, workers) if workers else None  # workers start first
        if pool is not None:
            stack.callback(pool.close)
        ref = stack.enter_context(TraceReader(ref_path))
        run = stack.enter_context(TraceReader(run_path))
        check_compatible(ref, run)
        base = stack.enter_context(TraceReader(baseline_path)) if baseline is not None else None
        if base is not None:
            check_baseline(ref, run, base)
        d = _Differ(ref, run, tol, base, baseline, full, pool)
        d.run_all()
        other = quantization_note(run, base) if base is not None else None
        if other:
            d.notes.append(other)
        return _result(d, ref_path, run_path, baseline_path)


def _result(d: _Differ, ref_path, run_path, baseline_path) -> DiffResult:
    """The finished pass as a DiffResult: the first divergence with its layer and origin, the
    growth table and the figures computed after the pass."""
    ref, run, base, plan = d.ref, d.run, d.base, d.plan
    growth = growth_table(d.res, plan)
    first = d.best[1] if d.best is not None else None
    if first is not None:
        if first.layer is not None and not S.KIND_BY_NAME[first.kind].encoder:
            first.layer_info = ref.layers[first.layer]
        first.origin = origin(first, d.res, len(ref.layers))
    if d.skipped:
        d.notes.append(_skipped_note(d.skipped))
    if d.absent:
        d.notes.append(_absent_note(d.tensors))
    not_read = _not_compared_note(d.tensors)
    if not_read:
        d.notes.append(not_read)
    return DiffResult(
        match=first is None,
        first_divergence=first,
        tokens=d.tokens,
        growth=growth,
        tensors=d.tensors,
        skipped=d.skipped,
        notes=d.notes,
        steps=Steps(
            ref.n_steps,
            run.n_steps,
            plan.token_steps,
            plan.numeric_steps,
            ref.prompt_len,
            plan.n_rows,
            plan.free_running,
        ),
        reference=_info(ref, ref_path),
        candidate=_info(run, run_path),
        tolerances=d.tol,
        layers=list(ref.layers),
        baseline=None if base is None else BaselineInfo(_info(base, baseline_path), d.baseline.factor),
        isolation=rank_layers(growth) if run.mode == "isolated" else None,
        logits=logit_metrics(ref, run, plan.numeric_steps, d._logit_part if d.pool is not None else None),
    )
