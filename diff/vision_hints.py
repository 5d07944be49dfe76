"""Likely causes inside the vision tower (diff/hints.py's rules: decided from the numbers alone, a
signature that does not hold in full gives no hint). Each check takes hints.py's site of the first
divergence (its traces, tolerance and config) and reads that tensor's rows of the vision tower,
which are bounded by the tower's table (the real patches of every image, or its soft tokens).

- 2D RoPE axes swapped: q or k differ at every patch off the image's diagonal and match on it
  (x = y: swapping the axes changes nothing there);
- padding not masked: attention output differs at the patches of every image with padding patches
  (their median far above float rounding) and matches at those of an image that fills its patch
  budget;
- pooling: the pooled rows are REF's times one factor (the sqrt(hidden) scale), REF's in another
  order (the cell grid), or a per-channel affine map of REF's (std_bias / std_scale).
"""

from __future__ import annotations

import math

import numpy as np

from gemma4_trace.traces.rows import patch_grids

from .metrics import ranges_text, rel_l2_of_sums
from .result import Hint

VISION_ROPE_AXES = "vision 2D RoPE axes swapped"
VISION_PADDING = "vision padding patches not masked"
VISION_POOL_SCALE = "vision pooled rows scaled"
VISION_POOL_ORDER = "vision pooling cells in another order"
VISION_STANDARDIZE = "vision standardize (std_bias / std_scale) wrong"
NAMES = (VISION_ROPE_AXES, VISION_PADDING, VISION_POOL_SCALE, VISION_POOL_ORDER, VISION_STANDARDIZE)
MOST = 0.9  # the share of rows that must differ where the signature says every row differs
PADDED_OVER_CLEAN = 30  # how far the padded images' typical error must stand above the full images' worst
MAX_ORDER_ROWS = 4096  # pooled rows of one image the order check pairs (n^2 distances)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return rel_l2_of_sums(np.sum((b - a) ** 2, axis=-1), np.sum(a**2, axis=-1), 0.0)


def _both(s) -> tuple[np.ndarray, np.ndarray]:
    """Every row of the divergent vision tensor in both traces, float64, one vector per row."""
    a, b = s.ref.read(s.d.kind, s.d.layer), s.run.read(s.d.kind, s.d.layer)
    if a.shape != b.shape:
        raise ValueError("shapes differ")
    return a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)


def _tower(s):
    return s.ref.towers["vision"]


def rope_axes(s) -> Hint | None:
    grids = patch_grids(s.ref.extra_input("image_position_ids"), _tower(s))
    if grids is None:
        return None
    xy = np.concatenate(grids)
    a, b = _both(s)
    err = _rel(a, b)
    diag = xy[:, 0] == xy[:, 1]
    if diag.sum() < 2 or (~diag).sum() < 2:
        return None
    off = float(np.mean(err[~diag] > s.tol))
    if np.all(err[diag] <= s.tol) and off >= MOST:
        return Hint(
            VISION_ROPE_AXES,
            f"RUN's {s.d.kind} matches REF's at the {int(diag.sum())} patches on the images' diagonal (x = y, where "
            f"swapping the 2D RoPE's x and y halves changes nothing) and differs at {{off}} of the "
            f"{int((~diag).sum())} others",
            {"off": (off, "pct")},
        )
    return None


def padding(s) -> Hint | None:
    info = _tower(s)
    budget = s.ref.extra_shapes().get("pixel_values", (0, 0))[1]
    padded = [i for i, n in enumerate(info.item_rows) if n < budget]
    full = [i for i, n in enumerate(info.item_rows) if n == budget]
    if not padded or not full:
        return None  # no image without padding to tell this from a wrong attention
    a, b = _both(s)
    err = _rel(a, b)
    starts = np.cumsum((0, *info.item_rows))
    rows = {i: err[starts[i] : starts[i + 1]] for i in range(len(info.item_rows))}
    clean = max(float(rows[i].max()) for i in full)
    typical = min(float(np.median(rows[i])) for i in padded)
    # every padded image off by far more than float rounding, every full one within it
    if clean <= s.tol and typical > PADDED_OVER_CLEAN * max(clean, 1e-12) and typical > 0:
        return Hint(
            VISION_PADDING,
            f"RUN's {s.d.kind} differs at every image with padding patches (image(s) {_items(padded)}: median "
            f"rel-L2 {{typical}}) and matches at those that fill the {budget}-patch budget (image(s) "
            f"{_items(full)}: at most {{clean}})",
            {"typical": (typical, "sci"), "clean": (clean, "sci")},
        )
    return None


def _items(items: list[int]) -> str:
    return ranges_text(np.asarray(items) + 1)


def pool_scale(s) -> Hint | None:
    a, b = _both(s)
    k = float(np.sum(a * b) / np.sum(a * a))
    fit = _rel(k * a, b)
    if not (np.all(fit <= s.tol) and abs(k - 1) > 1e-3):
        return None
    hidden = _tower(s).hidden
    root = math.sqrt(hidden)
    which = next((name for name, v in ((f"1/sqrt({hidden})", 1 / root), (f"sqrt({hidden})", root)) if
                  abs(k / v - 1) < 1e-2), None)  # fmt: skip
    return Hint(
        VISION_POOL_SCALE,
        "RUN's pooled rows are REF's times {k}"
        + (f" ({which}: the pooler's sqrt(hidden) scale missing or applied twice)" if which else "")
        + "; rel-L2 after dividing it out at most {fit}",
        {"k": (k, "val"), "fit": (float(fit.max()), "sci")},
    )


def pool_order(s) -> Hint | None:
    a, b = _both(s)
    moved, start = 0, 0
    for n in _tower(s).item_tokens:
        if n > MAX_ORDER_ROWS:
            return None
        ra, rb = a[start : start + n], b[start : start + n]
        d2 = (rb**2).sum(1)[:, None] + (ra**2).sum(1)[None, :] - 2 * rb @ ra.T  # RUN row x REF row
        best = d2.argmin(1)
        if not np.all(_rel(ra[best], rb) <= s.tol) or len(set(best.tolist())) != n:
            return None  # not a permutation of the image's own cells
        moved += int(np.sum(best != np.arange(n)))
        start += n
    if moved == 0:
        return None
    return Hint(
        VISION_POOL_ORDER,
        f"RUN's pooled rows are REF's in another order: {moved} of {len(a)} cells moved, every row found among its "
        "own image's (the pooling grid's cell index: x and y swapped, or another grid width)",
    )


def standardize(s) -> Hint | None:
    vc = s.config.get("vision_config") or {}
    if vc.get("standardize") is not True:
        return None
    a, b = (x.reshape(len(x), -1) for x in _both(s))
    if len(a) < 3:
        return None
    am, bm = a.mean(0), b.mean(0)
    var = ((a - am) ** 2).sum(0)
    if np.any(var == 0):
        return None
    slope = ((a - am) * (b - bm)).sum(0) / var
    fit = _rel(b, slope * (a - am) + bm)
    if np.all(fit <= s.tol) and not np.allclose(slope, 1, rtol=1e-3):
        return Hint(
            VISION_STANDARDIZE,
            "RUN's pooled rows are a per-channel affine map of REF's (slopes {lo} .. {hi}; rel-L2 of the fit at most "
            "{fit}): std_bias / std_scale skipped, applied twice or swapped",
            {"lo": (float(slope.min()), "val"), "hi": (float(slope.max()), "val"), "fit": (float(fit.max()), "sci")},
        )
    return None


CHECKS = {
    "vision.q": (rope_axes,),
    "vision.k": (rope_axes,),
    "vision.attn_out": (padding,),
    "vision.pooled": (pool_scale, pool_order, standardize),
}
