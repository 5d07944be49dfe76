"""The paired block walker: the same rows of REF and RUN (and BASE), read block by block.

Every pass of the diff over a tensor (core's row checks, calibrate's worst errors, the logit
metrics) reads through here, so memory is bounded by one constant: BLOCK_BYTES of rows per
trace (rows of `value_bytes` per value where the caller widens them, e.g. to float64)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from .metrics import RowSums, compare_mask_block, row_sums

BLOCK_BYTES = 16 << 20  # rows read at once per trace


class Block(NamedTuple):
    """One block of rows of a (kind, layer): REF's, RUN's and BASE's values, their steps, and the
    figures the comparison needs of REF and RUN (computed here or by a diff worker process)."""

    first: int  # the block's first row
    ref: np.ndarray | None  # None: a worker process read the rows and sent their figures only
    run: np.ndarray | None
    base: np.ndarray | None  # None: no three-way comparison for this tensor
    base_lacks: np.ndarray | None  # (rows,) bool: rows BASE has no data for (REF's stand in there)
    steps: np.ndarray  # (rows,) the step of each row
    figures: RowSums | np.ndarray  # float rows: RowSums; masks: per-row count of differing keys


def figures_of(a: np.ndarray, b: np.ndarray) -> RowSums | np.ndarray:
    """What the comparison needs of REF rows a and RUN rows b: RowSums, or for boolean masks the
    count of differing keys per row."""
    return compare_mask_block(a, b) if a.dtype == bool else row_sums(a, b)


def block_figures(ref, run, kind: str, layer, rows: slice, n_rows: int, a: np.ndarray, b: np.ndarray):
    """figures_of REF's rows a and RUN's rows b, rows `rows` of (kind, layer) compared over n_rows,
    as compared_blocks has them (rows REF or RUN did not report compare equal): what a diff worker
    process computes."""
    absent, _ = absent_rows(ref, run, kind, layer, n_rows)
    if absent is not None and absent[rows].any():
        b = b.copy()
        _stand_in(b, a, absent[rows])
    return figures_of(a, b)


class Task(NamedTuple):
    """One block: rows r0..r1-1 of (kind, layer), a tensor compared over n_rows; `logits`: the
    logit-distribution metrics of those steps too (logits.step_metrics), from the same read."""

    kind: str
    layer: int | None
    r0: int
    r1: int
    n_rows: int
    logits: bool = False


def tasks_of(ds, kind: str, layer, n_rows: int, logits: bool = False) -> Iterator[Task]:
    """The blocks of rows 0..n_rows-1 of dataset `ds` of (kind, layer), as the diff reads them
    (every figure is per row, so the logit metrics take the same blocks)."""
    block = block_rows(ds)
    for r0 in range(0, n_rows, block):
        yield Task(kind, layer, r0, min(n_rows, r0 + block), n_rows, logits)


def block_rows(ds, value_bytes: int | None = None) -> int:
    """Rows of dataset `ds` per block: BLOCK_BYTES of them, whole HDF5 chunks where it is chunked."""
    row_bytes = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * (value_bytes or ds.dtype.itemsize))
    chunk = (ds.chunks or (1,))[0]
    return max(chunk, (BLOCK_BYTES // row_bytes) // chunk * chunk)


def paired_blocks(
    ref, run, kind: str, layer, end: int, value_bytes: int | None = None
) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """(rows, REF's rows, RUN's rows) over rows 0..end-1 of (kind, layer), block by block."""
    block = block_rows(ref.dataset(kind, layer), value_bytes)
    for r0 in range(0, end, block):
        rows = slice(r0, min(end, r0 + block))
        yield rows, ref.read(kind, layer, rows), run.read(kind, layer, rows)


def compared_blocks(
    ref, run, base, kind: str, layer, end: int, row_steps: np.ndarray, absent: np.ndarray | None
) -> Iterator[Block]:
    """The diff's blocks of rows 0..end-1, BASE's rows with them when `base` is given. A row BASE
    lacks or holds NaN/Inf in has REF's standing in (and is flagged in base_lacks: no envelope
    there); a row REF or RUN did not report (`absent`) has REF's standing in for RUN's and BASE's,
    so it compares equal."""
    for rows, a, b in paired_blocks(ref, run, kind, layer, end):
        c = lacks = None
        if base is not None:  # a row BASE lacks has no envelope there: RUN is judged by the tolerance alone
            c, lacks = _usable_base_rows(base.read(kind, layer, rows), a)
            base_flags = base.rows_present(kind, layer)
            if base_flags is not None:
                flags = base_flags[rows]
                lacks[: len(flags)] |= ~flags
                _stand_in(c, a, lacks)
        gone = absent[rows] if absent is not None else None
        if gone is not None and gone.any():  # a row REF or RUN lacks is not compared: REF's stands in
            _stand_in(b, a, gone)
            if c is not None:
                _stand_in(c, a, gone)
        yield Block(rows.start, a, b, c, lacks, row_steps[rows], figures_of(a, b))


def _usable_base_rows(c: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BASE's rows, REF's standing in for those BASE lacks (a BASE that stopped reporting) or
    holds NaN/Inf in; and which rows those are (no envelope there)."""
    lacks = np.arange(len(a)) >= len(c)
    if lacks.any():
        full = np.zeros((len(a), *c.shape[1:]), dtype=c.dtype)
        full[: len(c)] = c
        c = full
    if c.dtype.kind == "f":
        lacks |= ~np.isfinite(c.reshape(len(c), -1)).all(axis=1)
    if lacks.any():
        _stand_in(c, a, lacks)
    return c, lacks


def _stand_in(dst: np.ndarray, src: np.ndarray, rows: np.ndarray) -> None:
    """dst[rows] = src[rows]; mask rows of different widths (REF's grow, a static runtime's are
    max_seq wide) are copied over the common columns and blocked beyond them."""
    if dst.shape[1:] == src.shape[1:]:
        dst[rows] = src[rows]
        return
    w = min(dst.shape[1], src.shape[1])
    dst[rows] = 0
    dst[rows, :w] = src[rows, :w]


def absent_rows(ref, run, kind: str, layer, n_rows: int) -> tuple[np.ndarray | None, str]:
    """(n_rows,) bool: rows REF or RUN did not report (a trace's rows_present flags), or None
    when both reported all; and which trace lacks them ("REF", "RUN", "REF and RUN"). Such rows
    are left out of the comparison (REF's stands in for RUN's, compared_blocks)."""
    flags = [(who, r.rows_present(kind, layer)) for who, r in (("REF", ref), ("RUN", run))]
    flags = [(who, f[:n_rows]) for who, f in flags if f is not None and not f[:n_rows].all()]
    if not flags:
        return None, ""
    absent = np.zeros(n_rows, dtype=bool)
    for _, f in flags:
        absent[: len(f)] |= ~f
    return absent, " and ".join(who for who, _ in flags)
