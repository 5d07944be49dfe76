"""Rows a runtime reports at only some of a step's positions (TraceWriter.add's `positions=`): spread
over the step's rows, zeros where none was reported, and the ranges it did not report, which the
trace flags in the kind's rows_present dataset (schema.rows_present_path)."""

from __future__ import annotations

import numpy as np


def spread_rows(kind, layer, arr: np.ndarray, positions, start: int, stop: int, by_step: bool):
    """Rows reported at some of a step's positions -> the step's full rows (zeros where absent) and
    the absent row ranges [a, b) relative to `start`."""
    if by_step:
        raise ValueError(f"{kind} has one row per step; positions= is for position-indexed kinds")
    pos = np.asarray(positions.tolist() if hasattr(positions, "tolist") else list(positions)).reshape(-1)
    if pos.dtype.kind not in "iu":
        raise ValueError(f"{kind} layer {layer}: positions must be integers, got {pos.dtype}")
    n = stop - start
    if pos.size == 0 or pos.size > n or np.any(np.diff(pos) <= 0) or pos[0] < start or pos[-1] >= stop:
        raise ValueError(
            f"{kind} layer {layer}: positions must be increasing absolute positions within this "
            f"step's {start}..{stop - 1}, got {pos[:8].tolist()}{' ...' if pos.size > 8 else ''}"
        )
    if arr.ndim == 0 or arr.shape[0] != pos.size:
        raise ValueError(f"{kind} layer {layer}: {arr.shape[0] if arr.ndim else 0} rows for {pos.size} positions")
    full = np.zeros((n, *arr.shape[1:]), dtype=arr.dtype)
    full[pos - start] = arr
    present = np.zeros(n + 2, dtype=bool)
    present[1:-1][pos - start] = True
    edges = np.flatnonzero(np.diff(present.astype(np.int8)))  # run boundaries, shifted by one
    runs = list(zip(edges[::2], edges[1::2]))  # present runs [a, b)
    absent, prev = [], 0
    for a, b in runs:
        if a > prev:
            absent.append((prev, int(a)))
        prev = int(b)
    if prev < n:
        absent.append((prev, n))
    return full, absent


def present_flags(rows: int, absent: list[tuple[int, int]]) -> np.ndarray:
    """(rows,) bool: False in the [a, b) ranges `absent` names, True elsewhere."""
    present = np.ones(rows, dtype=bool)
    for a, b in absent:
        present[a:b] = False
    return present
