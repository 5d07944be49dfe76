"""Layers ranked by local error, for a candidate replayed with `trace replay --isolate`.

In an isolated trace every layer was fed REF's input, so the error of its output against
REF is its own, not drift carried from the layers above. The ranking is by the growth
table's measure (layer_out rel-L2 of each step's rows taken together), worst step first:
a layer with a real bug stands out at the top even where quantization noise is everywhere.
"""

from __future__ import annotations

from .result import IsolationRanking, LayerError


def rank_layers(growth) -> IsolationRanking:
    """The growth table's layers ordered by their worst step's error, largest first."""
    out = []
    for layer, row, thr in zip(growth.layers, growth.table, growth.thresholds):
        steps = [(v, s) for s, v in enumerate(row) if v is not None]
        if steps:
            v, s = max(steps)
            out.append(LayerError(layer, v, s, thr[s]))
    out.sort(key=lambda e: (-e.rel_l2, e.layer))
    return IsolationRanking(out)
