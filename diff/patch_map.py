"""Where in the image a vision divergence sits: each patch's (or pooled token's) error of the first
divergent vision tensor, laid over the image's patch grid (the HTML report's "Vision" section).

Computed after the diff, like the hints (diff/hints.py): both traces' rows of that one tensor, the
image's real patches from REF's image_position_ids and their colours from its pixel_values (the
processor's patch layout: patch_size x patch_size pixels of 3 channels, channel last). Bounded: a
tower of more than MAX_ROWS rows, or inputs that do not fit its table (a trace is untrusted), give
no map. Not in the JSON (the per-row errors of one tensor; the sentence names the worst place); the HTML
report draws it (diff/patch_svg.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.rows import item_of, patch_grids

from .result import DiffResult

MAX_ROWS = 1 << 16  # rows of the tensor (every image's patches) a map reads
MAX_SIDE = 1 << 12  # patches along an image's side a map draws (a hostile position would make it huge)


@dataclass
class ImageMap:
    """One image: its grid (rows x cols cells: patches, or pooled tokens) and each cell's figures."""

    rows: int
    cols: int
    cells: list[tuple[int, int, float, str]] = field(default_factory=list)  # (row, col, rel-L2, colour "#rrggbb")


@dataclass
class PatchMap:
    kind: str  # the divergent vision kind's key ("vision.attn_out")
    layer: int | None
    threshold: float  # its rel-L2 tolerance: a cell over it is "diverged"
    images: list[ImageMap]
    first: tuple[int, int] | None = None  # (image, row within it) of the first divergence


def patch_map(result: DiffResult, ref_path, run_path) -> PatchMap | None:
    """The map of the first divergence when it is in the vision tower (None otherwise, or when the
    traces cannot say where their rows sit)."""
    d = result.first_divergence
    if d is None or d.kind not in S.KIND_BY_NAME:
        return None
    spec = S.KIND_BY_NAME[d.kind]
    if spec.tower != "vision" or spec.index not in (S.ROW_PATCH, S.ROW_SOFT_TOKEN):
        return None
    try:
        with TraceReader(ref_path) as ref, TraceReader(run_path) as run:
            return _map(ref, run, spec, d)
    except (TraceToolError, OSError, ValueError, KeyError, TypeError):
        return None  # a map is a picture of what the diff said; no picture is no error


def _map(ref: TraceReader, run: TraceReader, spec: S.Kind, d) -> PatchMap | None:
    info = ref.towers.get("vision")
    if info is None or info.rows > MAX_ROWS or not (ref.has(d.kind, d.layer) and run.has(d.kind, d.layer)):
        return None
    positions = ref.extra_input("image_position_ids")
    grids = patch_grids(positions, info)
    pixels = ref.extra_input("pixel_values")
    pooling = (ref.model_config.get("vision_config") or {}).get("pooling_kernel_size")
    if grids is None or pixels is None or pixels.ndim != 3 or pixels.shape[:2] != positions.shape[:2]:
        return None
    if any(len(g) and int(g.max()) >= MAX_SIDE for g in grids):
        return None
    a, b = ref.read(d.kind, d.layer), run.read(d.kind, d.layer)
    if a.shape != b.shape:
        return None
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    err = np.sqrt(((a - b) ** 2).sum(1)) / np.maximum(np.sqrt((a**2).sum(1)), 1e-30)
    patch = spec.index == S.ROW_PATCH
    if not patch and not (isinstance(pooling, int) and not isinstance(pooling, bool) and 1 <= pooling <= 64):
        return None
    counts = info.item_rows if patch else info.item_tokens
    images, start = [], 0
    for i, (grid, n) in enumerate(zip(grids, counts)):
        colours = _patch_colours(pixels[i][(positions[i] != -1).all(-1)])
        images.append(_image(grid, err[start : start + n], colours, None if patch else pooling))
        start += n
    item, within = item_of(spec, info, d.position)
    return PatchMap(d.kind, d.layer, d.threshold, images, (item, within))


def _patch_colours(rows: np.ndarray) -> np.ndarray:
    """Each real patch's mean colour (0..255 RGB) from its pixels (0..1, the processor's rescale)."""
    rows = rows.astype(np.float64)
    if rows.shape[1] % 3:
        return np.full((len(rows), 3), 128.0)
    mean = rows.reshape(len(rows), -1, 3).mean(1)  # (p, p, 3) per patch: channel last
    return np.clip(np.nan_to_num(mean) * 255.0, 0, 255)


def _image(grid: np.ndarray, err: np.ndarray, colours: np.ndarray, pooling: int | None) -> ImageMap:
    xs, ys = grid[:, 0], grid[:, 1]
    if pooling is None:  # one cell per patch, at its (row, col)
        m = ImageMap(int(ys.max()) + 1, int(xs.max()) + 1)
        for (x, y), e, c in zip(grid, err, colours):
            m.cells.append((int(y), int(x), float(e), _hex(c)))
        return m
    width = (int(xs.max()) + 1) // pooling  # pooled cells, row-major over the pooled grid
    cell = (ys // pooling) * width + xs // pooling
    m = ImageMap((int(ys.max()) + 1) // pooling, width)
    for t, e in enumerate(err):
        inside = cell == t
        c = colours[inside].mean(0) if inside.any() else np.full(3, 128.0)
        m.cells.append((t // width, t % width, float(e), _hex(c)))
    return m


def _hex(rgb) -> str:
    return "#" + "".join(f"{int(round(v)):02x}" for v in rgb)
