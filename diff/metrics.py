"""Per-row metrics on blocks of rows, and the element-level detail of one failing row.

All work stays in float32 on the block (no float64 copies of tensors); per-row sums are
small vectors. NaN or Inf in either row never passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Metric:
    """One way two traces can disagree. The tolerance parser, the comparer and every report
    read this table; a metric with `threshold` is a TOML field and a RowStats attribute."""

    name: str
    label: str  # in reports: "rel-L2 9.1e-4 > 1e-4"
    group: str  # "row": per-row float metric | "mask" | "token" | "structure": could not compare
    threshold: bool = False  # has a tolerance per (kind, layer, step)
    fails_below: bool = False  # the tolerance is a minimum (cosine), not a maximum
    off: float = math.inf  # threshold that disables the check (TOML `false`)
    lo: float = 0.0  # valid thresholds: lo <= t (<= hi)
    hi: float = math.inf
    what: str = ""  # the threshold in words, for errors about its range
    best: float = 0.0  # value for identical rows
    summary: str = ""  # key of the worst value in a tensor summary (JSON)
    summary_label: str = ""  # its column heading in the HTML report
    plain: bool = False  # print as a plain number (4 significant digits), not scientific

    def fails(self, values: np.ndarray, limit) -> np.ndarray:
        return values < limit if self.fails_below else values > limit

    def worst(self, a: float, values: np.ndarray) -> float:
        return min(a, float(values.min())) if self.fails_below else max(a, float(values.max()))


METRICS: tuple[Metric, ...] = (
    Metric("nonfinite", "non-finite values", "row"),  # NaN/Inf in either row: never passes
    Metric("rel_l2", "rel-L2", "row", threshold=True, summary="max_rel_l2", summary_label="max rel-L2"),
    Metric("max_abs", "max-abs", "row", threshold=True, summary="max_abs", summary_label="max abs"),
    Metric(
        "cosine",
        "cosine",
        "row",
        threshold=True,
        fails_below=True,
        off=-math.inf,
        lo=-1.0,
        hi=1.0,
        what="a minimum similarity",
        best=1.0,
        summary="min_cosine",
        summary_label="min cosine",
        plain=True,
    ),
    Metric("mask_keys", "mask keys", "mask"),  # key positions allowed in one trace, blocked in the other
    Metric("shape", "shape", "structure"),
    Metric("rows", "rows", "structure"),
    Metric("missing", "missing", "structure"),
    Metric("token", "token", "token"),
)
METRIC = {m.name: m for m in METRICS}
ROW_METRICS = tuple(m for m in METRICS if m.group == "row")  # RowStats checks them in this order
THRESHOLD_METRICS = tuple(m for m in METRICS if m.threshold)
METRIC_ORDER = tuple(m.name for m in ROW_METRICS)
PRIMARY = "rel_l2"  # the error measure of growth tables, origin verdicts and tensor summaries' tolerance


class RowSums(NamedTuple):
    """The sums of a block of rows that every row metric derives from (one entry per row): what a
    diff worker process sends back instead of the rows (diff/parallel.py)."""

    nd: np.ndarray  # |RUN - REF|^2, float64
    na: np.ndarray  # |REF|^2
    nb: np.ndarray  # |RUN|^2
    ab: np.ndarray  # REF . RUN
    max_abs: np.ndarray  # max |RUN - REF|
    bad: np.ndarray  # bool: NaN or Inf in either row
    width: int  # values per row

    def head(self, n: int) -> RowSums:
        """The first n rows."""
        return RowSums(*(x[:n] for x in self[:6]), self.width)


def row_sums(a: np.ndarray, b: np.ndarray) -> RowSums:
    """RowSums of REF rows a and RUN rows b: float32 differences, float64 sums."""
    n = a.shape[0]
    a = a.reshape(n, -1)
    b = b.reshape(n, -1)
    m = a.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.subtract(b, a)  # (n, m) float32
        nd, na, nb, ab = _dot_rows(((d, d), (a, a), (b, b), (a, b)))
        np.abs(d, out=d)
        max_abs = d.max(axis=1).astype(np.float64) if m else np.zeros(n)
    bad = ~np.isfinite(nd + na + nb)
    if bad.any():  # sums can overflow on huge finite values: look at the rows themselves
        rows = np.flatnonzero(bad)
        really = ~(np.isfinite(a[rows]).all(axis=1) & np.isfinite(b[rows]).all(axis=1))
        bad[rows[~really]] = False
        # recompute overflowed rows in float64 (rare)
        for r in rows[~really]:
            a64, b64 = a[r].astype(np.float64), b[r].astype(np.float64)
            nd[r], na[r], nb[r], ab[r] = ((b64 - a64) ** 2).sum(), (a64**2).sum(), (b64**2).sum(), (a64 * b64).sum()
    return RowSums(nd, na, nb, ab, max_abs, bad, m)


SUB_BLOCK = 1 << 18  # bytes of float32 rows widened to float64 at a time (in cache)


def _dot_rows(pairs) -> list[np.ndarray]:
    """Per-row float64 dot products of float32 (n, m) pairs, as np.einsum("ij,ij->i", x, y,
    dtype=float64) computes them. A row that fits einsum's cast buffer (np.getbufsize() values)
    is summed in one inner loop over its float64 values, so the rows are widened here a few at a
    time and summed in float64 instead: the same sums bit for bit (tests/test_diff_parallel.py),
    without einsum's buffered cast, in about half the time."""
    n, m = pairs[0][0].shape
    if not 0 < m <= np.getbufsize():
        return [np.einsum("ij,ij->i", x, y, dtype=np.float64) for x, y in pairs]
    out = [np.empty(n) for _ in pairs]
    step = max(1, SUB_BLOCK // (4 * m))
    for r0 in range(0, n, step):
        rows = slice(r0, r0 + step)
        wide = {}
        for (x, y), o in zip(pairs, out):
            xw = wide.setdefault(id(x), x[rows].astype(np.float64))
            yw = wide.setdefault(id(y), y[rows].astype(np.float64))
            np.einsum("ij,ij->i", xw, yw, out=o[rows])
    return out


class RowStats:
    """Metrics of a block of rows: rel_l2, max_abs, cosine, nonfinite (one entry per row), from
    the rows themselves or from their RowSums."""

    __slots__ = ("nd", "na", "rel_l2", "max_abs", "cosine", "nonfinite")

    def __init__(self, a: np.ndarray, b: np.ndarray, floor: np.ndarray):
        self._derive(row_sums(a, b), floor)

    @classmethod
    def of_sums(cls, sums: RowSums, floor: np.ndarray) -> RowStats:
        stats = cls.__new__(cls)
        stats._derive(RowSums(*(x.copy() for x in sums[:6]), sums.width), floor)
        return stats

    def _derive(self, s: RowSums, floor: np.ndarray) -> None:
        nd, na, nb, ab, bad = s.nd, s.na, s.nb, s.ab, s.bad
        self.max_abs = s.max_abs
        self.nonfinite = bad
        self.nd, self.na = nd, na
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            self.rel_l2 = rel_l2_of_sums(nd, na, floor * math.sqrt(max(s.width, 1)))
            norm = np.sqrt(na * nb)
            self.cosine = np.where(
                norm > 0, ab / np.where(norm > 0, norm, 1.0), np.where((na == 0) & (nb == 0), 1.0, 0.0)
            )
        self.rel_l2[bad] = np.inf
        self.max_abs[bad] = np.inf
        self.cosine[bad] = -np.inf

    def failing(self, limits: dict[str, np.ndarray], skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(fails per row, index into METRIC_ORDER of the first failing metric per row)."""
        checks = np.stack(
            [
                m.fails(getattr(self, m.name), limits[m.name]) if m.threshold else getattr(self, m.name)
                for m in ROW_METRICS
            ]
        )
        fails = checks.any(axis=0) & ~skip
        return fails, np.argmax(checks, axis=0)


def rel_l2_of_sums(nd: np.ndarray, na: np.ndarray, floor_norm) -> np.ndarray:
    """rel-L2 from per-row sums: sqrt(nd) / max(sqrt(na), floor_norm), nd = |RUN - REF|^2 and
    na = |REF|^2 of a row. The one zero rule: 0 for identical rows whatever REF's norm, and a row
    whose REF norm and floor are 0 divides by 1e-300 (a huge value, never a pass)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        denom = np.maximum(np.sqrt(na), floor_norm)
        return np.where(nd == 0, 0.0, np.sqrt(nd) / np.where(denom > 0, denom, 1e-300))


def rel_l2_rows(ref: np.ndarray, run: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """Per-row rel-L2 of RUN against REF (rows: the first axis), as `trace diff` computes it with
    an l2_floor of `floor` (inf where a row is not finite)."""
    n = ref.shape[0]
    return RowStats(np.asarray(ref, dtype=np.float32), np.asarray(run, dtype=np.float32), np.full(n, floor)).rel_l2


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log of the softmax of each row (the last axis), in float64."""
    x = np.asarray(x, dtype=np.float64)
    out = x - x.max(axis=-1, keepdims=True)
    out -= np.log(np.exp(out).sum(axis=-1, keepdims=True))
    return out


def kl_rows(log_p: np.ndarray, log_q: np.ndarray, p: np.ndarray | None = None) -> np.ndarray:
    """KL(P || Q) = sum p (log p - log q) of each row, in nats, from log-probabilities (>= 0: a
    rounding's -1e-17 is 0); `p`: exp(log_p) when the caller has it."""
    terms = log_p - log_q
    terms *= np.exp(log_p) if p is None else p
    return np.maximum(terms.sum(axis=-1), 0.0)


def element_detail(a_row: np.ndarray, b_row: np.ndarray, metric: str, tol: dict) -> dict:
    """First failing element and worst element of one row (indices in the row's shape)."""
    shape = a_row.shape
    a = a_row.reshape(-1).astype(np.float64)
    b = b_row.reshape(-1).astype(np.float64)
    m = max(a.size, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(b - a)
        nonfinite = ~(np.isfinite(a) & np.isfinite(b))
        if metric == "nonfinite":
            crit = nonfinite
        elif metric == "max_abs":
            crit = d > tol["max_abs"]
        elif metric == "rel_l2":
            # the element's share of the rel-L2 budget: some element must exceed it
            budget = tol["rel_l2"] * max(float(np.sqrt((a * a).sum())), tol["l2_floor"] * math.sqrt(m)) / math.sqrt(m)
            crit = d > budget
        else:
            crit = d > float(np.sqrt((d * d).sum() / m))
        d_rank = np.where(nonfinite, np.inf, d)
    first = int(np.argmax(crit)) if crit.any() else int(np.argmax(d_rank))
    worst = int(np.argmax(d_rank))
    return {
        "first": tuple(int(x) for x in np.unravel_index(first, shape)) if shape else (),
        "first_ref": float(a[first]),
        "first_run": float(b[first]),
        "worst": tuple(int(x) for x in np.unravel_index(worst, shape)) if shape else (),
        "worst_ref": float(a[worst]),
        "worst_run": float(b[worst]),
    }


def compare_mask_block(ra: np.ndarray, rb: np.ndarray) -> np.ndarray:
    """Per-row count of key positions where the two boolean masks differ (missing columns = blocked)."""
    w = min(ra.shape[1], rb.shape[1])
    count = np.count_nonzero(ra[:, :w] != rb[:, :w], axis=1)
    if ra.shape[1] > w:
        count += np.count_nonzero(ra[:, w:], axis=1)
    if rb.shape[1] > w:
        count += np.count_nonzero(rb[:, w:], axis=1)
    return count


def mask_row_detail(ra: np.ndarray, rb: np.ndarray, limit: int = 16) -> dict:
    width = max(ra.shape[0], rb.shape[0])
    a = np.zeros(width, dtype=bool)
    b = np.zeros(width, dtype=bool)
    a[: ra.shape[0]] = ra
    b[: rb.shape[0]] = rb
    run_only = np.flatnonzero(b & ~a)
    ref_only = np.flatnonzero(a & ~b)
    return {
        "allowed_in_run_blocked_in_ref": [int(x) for x in run_only[:limit]],
        "blocked_in_run_allowed_in_ref": [int(x) for x in ref_only[:limit]],
        "n_allowed_in_run_blocked_in_ref": int(run_only.size),
        "n_blocked_in_run_allowed_in_ref": int(ref_only.size),
        "ref_allowed": ranges_text(np.flatnonzero(a)),
        "run_allowed": ranges_text(np.flatnonzero(b)),
    }


def ranges_text(idx: np.ndarray) -> str:
    """'0-3, 7' for [0, 1, 2, 3, 7]."""
    if idx.size == 0:
        return "none"
    out, start, prev = [], int(idx[0]), int(idx[0])
    for x in idx[1:]:
        x = int(x)
        if x != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = x
        prev = x
    out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)


def image_blocks(model_config: dict, prompt_ids, ra: np.ndarray, rb: np.ndarray, position: int) -> list[dict] | None:
    """The image blocks (runs of the config's image_token_id in REF's prompt, numbered from 1)
    that hold a key the two mask rows disagree on, or the query: [{"image", "first", "last"}]."""
    token = model_config.get("image_token_id")
    ids = np.asarray(prompt_ids)
    if not isinstance(token, int) or not (ids == token).any():
        return None
    w = max(ra.shape[0], rb.shape[0])
    keys = np.flatnonzero(np.pad(ra, (0, w - ra.shape[0])) != np.pad(rb, (0, w - rb.shape[0])))
    is_img = np.concatenate([[False], ids == token, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(is_img))  # starts and stops of the runs
    out = []
    for n, (first, stop) in enumerate(zip(edges[::2], edges[1::2]), 1):
        if first <= position < stop or ((keys >= first) & (keys < stop)).any():
            out.append({"image": n, "first": int(first), "last": int(stop) - 1})
    return out or None
