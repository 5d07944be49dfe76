"""What one row of a kind is, and how many a trace holds: the only place a kind's row index is read.

A kind's rows are token positions (the text tower), steps (logits, the chosen token), or an encoder
tower's patches, frames or soft tokens (made in the prefill, image after image, clip after clip).
The diff, the importer and every analysis ask here instead of comparing an index themselves.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import schema as S
from .layers import TowerInfo


def tower_rows(spec: S.Kind, info: TowerInfo) -> int:
    """Rows an encoder kind holds: its tower's patches or frames, or its soft tokens."""
    return info.tokens if spec.index == S.ROW_SOFT_TOKEN else info.rows


def row_count(spec: S.Kind, n_positions: int, n_steps: int, towers: Mapping[str, TowerInfo]) -> int | None:
    """Rows a complete dataset of `spec` holds in a run of n_positions positions over n_steps steps
    (None: an encoder kind of a tower the trace does not have)."""
    if spec.encoder:
        info = towers.get(spec.tower)
        return None if info is None else tower_rows(spec, info)
    return n_steps if spec.by_step else n_positions


def row_word(spec: S.Kind) -> str:
    """What one row is, for people: "position", "step", "patch", "frame", "soft token"."""
    return spec.index.replace("_", " ")


def layer_counts(n_text_layers: int, towers: Mapping[str, TowerInfo]) -> dict[str, int]:
    """{tower: its layer count} for the towers a trace holds (the text tower always)."""
    return {S.TEXT: n_text_layers} | {name: t.layers for name, t in towers.items()}


def item_of(spec: S.Kind, info: TowerInfo, row: int) -> tuple[int, int]:
    """(item, row within it) of an encoder row: which image or clip (from 0) it belongs to."""
    counts = info.item_tokens if spec.index == S.ROW_SOFT_TOKEN else info.item_rows
    item, first = 0, 0
    while item + 1 < len(counts) and row >= first + counts[item]:
        first += counts[item]
        item += 1
    return item, row - first


def rows_word(index: str, n: int = 2) -> str:
    """A row index for people, counted: "patch" / "patches", "frame" / "frames", "soft tokens"."""
    word = index.replace("_", " ")
    return word if n == 1 else word + ("es" if word.endswith("ch") else "s")


def steps_of_rows(spec: S.Kind, n_rows: int, position_steps: np.ndarray, n_steps: int) -> np.ndarray:
    """The step of each row of a dataset: `position_steps` gives a position's step, an encoder's rows
    are the prefill's, a step kind's rows are its steps 0..n_steps-1."""
    if spec.by_step:
        return np.arange(n_steps)
    if spec.encoder:
        return np.zeros(n_rows, dtype=np.int64)
    return position_steps


def patch_grids(position_ids, info: TowerInfo) -> list[np.ndarray] | None:
    """(x, y) of each image's real patches in row order, from the processor's image_position_ids
    (images, patches, 2; padding (-1, -1)); None where they do not fit the tower's table (a trace is
    untrusted: then no row names a place in its image)."""
    pos = np.asarray(position_ids)
    if pos.ndim != 3 or pos.shape[-1] != 2 or pos.shape[0] != len(info.item_rows) or pos.dtype.kind not in "iu":
        return None
    grids = [p[(p != -1).all(axis=-1)] for p in pos]
    if [len(g) for g in grids] != list(info.item_rows) or any(len(g) and g.min() < 0 for g in grids):
        return None
    return grids


def grid_place(spec: S.Kind, grid: np.ndarray, within: int, pooling: int | None) -> tuple[int, int] | None:
    """(row, col) in its image of an image's `within`-th patch, or of its pooled token (the pooled
    grid is pooling x pooling patches a cell, row-major): None where the grid cannot say."""
    if spec.index == S.ROW_PATCH:
        if within >= len(grid):
            return None
        x, y = grid[within]
        return int(y), int(x)
    if spec.index == S.ROW_SOFT_TOKEN and pooling and len(grid):
        width = (int(grid[:, 0].max()) + 1) // pooling
        return (within // width, within % width) if width > 0 else None
    return None


def image_counts(position_ids, pooling: int) -> tuple[list[int], list[int]] | None:
    """(real patches, soft tokens) of each image from the processor's image_position_ids (images,
    patches, 2; padding (-1, -1)), as Gemma4Model.get_image_features splits its soft tokens; None
    when the pooling kernel leaves no token."""
    pos = np.asarray(position_ids)
    patches = int(pos.shape[1])
    output_length = patches // (pooling * pooling) if pooling >= 1 else 0
    if output_length < 1:
        return None
    k_squared = int((patches // output_length) ** 0.5) ** 2
    real = [int(x) for x in (pos != -1).all(axis=-1).sum(axis=-1)]
    return real, [r // k_squared for r in real]
