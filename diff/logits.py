"""Logit-distribution metrics per step, as quantization work reads them.

For each compared step, with p = softmax(REF logits) and q = softmax(RUN logits) over the
vocabulary (float64):
- kl: KL(REF || RUN) = sum p (log p - log q), in nats
- top1: 1 when both put the same token first
- top5: |top-5 of REF & top-5 of RUN| / 5
- drop: p[t] - q[t] for REF's top-1 token t (how much probability RUN takes from it)
Summary: KL mean / 99th percentile (linear interpolation) / max (and its step), top-1
agreement rate, mean top-5 overlap, drop mean / max (and its step). A step whose logits hold
NaN or Inf gets NaN and is left out of the summary. Logits are read in row blocks (blocks.py).
"""

from __future__ import annotations

import math

import numpy as np

from .blocks import paired_blocks, tasks_of
from .metrics import kl_rows, log_softmax
from .result import LogitMetrics, LogitSummary

TOP_K = 5


SUB_BLOCK = 1 << 20  # bytes of float64 logits worked on at a time (in cache; every figure is per row)


def step_metrics(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """(kl, top1, top5, drop) for rows of REF logits a and RUN logits b (n, vocab)."""
    step = max(1, SUB_BLOCK // (8 * max(1, a.shape[1])))
    if len(a) <= step:
        return _step_metrics(a, b)
    parts = [_step_metrics(a[r : r + step], b[r : r + step]) for r in range(0, len(a), step)]
    return tuple(np.concatenate(figure) for figure in zip(*parts))


def _step_metrics(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    ok = np.isfinite(a).all(axis=1) & np.isfinite(b).all(axis=1)
    if not ok.all():
        a, b = np.where(ok[:, None], a, 0.0), np.where(ok[:, None], b, 0.0)
    la, lb = log_softmax(a), log_softmax(b)  # log p, log q
    p = np.exp(la)
    kl = kl_rows(la, lb, p)
    ta, tb = a.argmax(axis=1), b.argmax(axis=1)
    top1 = (ta == tb).astype(np.float64)
    k = min(TOP_K, a.shape[1])
    sa = np.argpartition(-a, k - 1, axis=1)[:, :k]
    sb = np.argpartition(-b, k - 1, axis=1)[:, :k]
    top5 = np.array([len(np.intersect1d(x, y)) / k for x, y in zip(sa, sb)])
    rows = np.arange(len(a))
    drop = p[rows, ta] - np.exp(lb[rows, ta])
    nan = np.where(ok, 0.0, np.nan)
    return kl + nan, top1 + nan, top5 + nan, drop + nan


def logit_steps(ref, run, n_steps: int) -> int:
    """How many of steps 0..n_steps-1 logit_metrics compares: 0 without logits in both or when the
    vocabularies differ (the diff reports that as a shape divergence)."""
    if not (ref.has("logits") and run.has("logits")):
        return 0
    da, db = ref.dataset("logits"), run.dataset("logits")
    if da.shape[1:] != db.shape[1:] or da.ndim != 2:
        return 0
    return min(n_steps, da.shape[0], db.shape[0])


def logit_metrics(ref, run, n_steps: int, part=None) -> LogitMetrics | None:
    """Per-step metrics over steps 0..n_steps-1 of two open traces (None: logit_steps is 0),
    block by block; `part(task)` gives a block's step_metrics when a worker computed them."""
    n = logit_steps(ref, run, n_steps)
    if n == 0:
        return None
    if part is None:  # float64 blocks
        parts = [step_metrics(a, b) for _, a, b in paired_blocks(ref, run, "logits", None, n, value_bytes=8)]
    else:
        parts = [part(task) for task in tasks_of(ref.dataset("logits"), "logits", None, n, logits=True)]
    kl, top1, top5, drop = (np.concatenate([p[i] for p in parts]) for i in range(4))
    return LogitMetrics(kl.tolist(), top1.tolist(), top5.tolist(), drop.tolist(), _summary(kl, top1, top5, drop))


def _summary(kl, top1, top5, drop) -> LogitSummary:
    ok = np.isfinite(kl)
    if not ok.any():
        nan = math.nan
        return LogitSummary(0, nan, nan, nan, None, nan, nan, nan, nan, None)
    idx = np.flatnonzero(ok)
    k, d = kl[ok], drop[ok]
    return LogitSummary(
        steps=int(ok.sum()),
        kl_mean=float(k.mean()),
        kl_p99=float(np.percentile(k, 99)),
        kl_max=float(k.max()),
        kl_max_step=int(idx[np.argmax(k)]),
        top1_agreement=float(top1[ok].mean()),
        top5_overlap=float(top5[ok].mean()),
        drop_mean=float(d.mean()),
        drop_max=float(d.max()),
        drop_max_step=int(idx[np.argmax(d)]),
    )
