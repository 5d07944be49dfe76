"""compare: one streaming pass over both traces in data-flow order, then the result data. The walk
is here; what it keeps (the first divergence, the tensors' summaries, the figures growth and origin
are computed from, the notes) is diff/ledger.py's.

Memory is bounded by a row block of the largest dataset (BLOCK_BYTES per trace plus a
few temporaries of that size) and per-row metric vectors; never the whole trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.rows import layer_counts, row_count, steps_of_rows

from .align import Plan, check_compatible, dataflow_sequence, make_plan, plan_notes
from .audio_where import frame_ms
from .baseline import DEFAULT_FACTOR, Baseline, check_baseline, quantization_note
from .blocks import Block, Task, absent_rows, compared_blocks, tasks_of
from .isolation import rank_layers
from .ledger import KeptRows, Ledger, image_grids
from .logits import logit_metrics, logit_steps
from .metrics import METRIC_ORDER, RowStats, RowSums, compare_mask_block, image_blocks, mask_row_detail
from .origin import growth as growth_table
from .origin import origin, own_error_outlier
from .parallel import BlockPool, workers_wanted
from .result import BaselineInfo, DiffResult, Divergence, MaskDetail, Steps, TensorSummary, TraceInfo
from .tokens import judge_tokens
from .tolerances import StepTolerance, Tolerances, load_tolerances, precision_class


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
    """The walk: steps' tokens, then every (kind, layer) of both traces in data-flow order (encoder
    towers first), each tensor's blocks of rows as far as they can still matter. What it finds goes
    into its ledger (diff/ledger.py), which keeps the records."""

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
        self.book = Ledger(self.seq, self.towers, baseline)
        self.book.grids = image_grids(ref, self.towers)
        self.book.frame_ms = frame_ms(ref.model_config)

    # ------------------------------------------------------------ main pass
    def run_all(self) -> None:
        ref, run, book = self.ref, self.run, self.book
        self.ref_tokens = ref.tokens() if ref.has("token") else None
        self.run_tokens = run.tokens() if run.has("token") else None
        self.plan: Plan = make_plan(ref, run, self.ref_tokens, self.run_tokens)
        book.notes += plan_notes(ref, run, self.base, self.plan, self.ref_tokens)  # may shorten the numeric steps
        self.row_steps = self.plan.row_steps()
        book.begin(self.plan, self.row_steps)
        tokens = judge_tokens(ref, self.base, self.plan, self.ref_tokens, self.run_tokens, self.tol)
        self.tokens = tokens.info
        book.notes += tokens.notes
        book.skipped += tokens.skipped
        if tokens.divergence is not None:
            book.offer(tokens.divergence)
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
                book.only_in(kind, layer, "REF" if a else "RUN", kind == "logits" and not (a and tokens_only))
                continue
            self._compare(kind, layer)

    def _tolerance(self, kind, layer) -> StepTolerance:
        ra = self.ref.source_dtype(kind, layer)
        rb = self.run.source_dtype(kind, layer)
        prec = precision_class(ra, rb, self.ref.provenance["dtype"], self.run.provenance["dtype"])
        return self.tol.resolve(kind, layer, prec, self.plan.numeric_steps)

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
        limit = self.book.row_limit(S.KIND_BY_NAME[task.kind], task.layer)
        return limit is None or task.r0 < limit

    def _compare(self, kind: str, layer) -> None:
        spec, book = S.KIND_BY_NAME[kind], self.book
        da, db = self.ref.dataset(kind, layer), self.run.dataset(kind, layer)
        n_rows, _ = self._extent(spec, layer)
        summary = book.tensor(kind, layer, n_rows)
        if not _same_row_shape(spec, da, db):
            book.shape_differs(summary, spec, layer, da.shape, db.shape)
            return
        short = min(da.shape[0], db.shape[0])
        if short < n_rows:
            book.too_few_rows(summary, spec, layer, short, n_rows, "REF" if da.shape[0] < db.shape[0] else "RUN")
            n_rows = short
        book.absent_rows(summary, *absent_rows(self.ref, self.run, kind, layer, n_rows))
        tol = self._tolerance(kind, layer)
        book.tolerance(summary, spec, tol)
        scan = self._scan_mask if spec.dtype == "bool" else self._scan_rows
        book.close(summary, scan(spec, layer, n_rows, tol, summary), n_rows)

    def _image_blocks_of(self, ra: np.ndarray, rb: np.ndarray, position: int) -> list[dict] | None:
        return image_blocks(self.ref.model_config, self.ref.prompt_ids, ra, rb, position)

    def _blocks(self, spec: S.Kind, layer, n_rows: int, keep: bool) -> Iterator[Block]:
        """The blocks of rows that can still beat the best divergence so far (all rows when `keep`)."""
        limit = None if keep or self.full else self.book.row_limit(spec, layer)
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
            self.book.absent.get((spec.key, layer)),
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
            self.book.mask_rows(summary, fails, k.first + len(k.steps))
            if fails.any() and not found:
                i = int(np.argmax(fails))
                step, pos = self.book.position_of(spec, k.first + i)
                a_row, b_row = self._rows_of(spec.key, layer, k, i)
                detail = MaskDetail(**mask_row_detail(a_row, b_row))
                detail.image_blocks = self._image_blocks_of(a_row, b_row, pos)
                self.book.offer(Divergence(step, layer, spec.key, pos, "mask_keys", float(count[i]), 0.0, detail))
                found = True
            if found and not self.full:
                break
        return found

    def _scan_rows(self, spec: S.Kind, layer, n_rows: int, tol: StepTolerance, summary: TensorSummary) -> bool:
        """Float rows: every row metric against its tolerance; residual kinds are read whole."""
        keep = spec.residual
        kept = KeptRows(self.book.res, (spec.key, layer), n_rows, self._three_way(spec.key, layer)) if keep else None
        self.book.float_scan(summary)
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
                    kept.outside(r0, r1, fails)
            self.book.float_rows(summary, rs, fails, r1)
            if keep:
                kept.add(r0, r1, rs, a, c, tol.l2_floor[st])
            if not found and fails.any():
                i = int(np.argmax(fails))
                a_row, b_row = self._rows_of(spec.key, layer, k, i)
                self.book.offer_row(spec, layer, r0 + i, a_row, b_row, rs, i, METRIC_ORDER[which[i]], tol, bstats)
                found = True
            if found and not keep and not self.full:
                break
        if keep:
            kept.finish(int(np.prod(self.ref.dataset(spec.key, layer).shape[1:])))
        return found


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
            d.book.notes.append(other)
        return _result(d, ref_path, run_path, baseline_path)


def _result(d: _Differ, ref_path, run_path, baseline_path) -> DiffResult:
    """The finished pass as a DiffResult: the first divergence with its layer and origin, the
    growth table and the figures computed after the pass."""
    ref, run, base, plan, book = d.ref, d.run, d.base, d.plan, d.book
    growth = growth_table(book.res, plan)
    first = book.best[1] if book.best is not None else None
    if first is not None:
        if first.layer is not None and not S.KIND_BY_NAME[first.kind].encoder:
            first.layer_info = ref.layers[first.layer]
        first.origin = origin(first, book.res, len(ref.layers))
    book.notes += book.closing_notes()
    if first is None and run.mode != "isolated":  # under the tolerance: does one layer still stand out?
        growth.outlier = own_error_outlier(growth)
    return DiffResult(
        match=first is None,
        first_divergence=first,
        tokens=d.tokens,
        growth=growth,
        tensors=book.tensors,
        skipped=book.skipped,
        notes=book.notes,
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
