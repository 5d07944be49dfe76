"""Layers ranked by local error, for a candidate replayed with `trace replay --isolate`.

In an isolated trace every layer was fed REF's input, so the error of its output against
REF is its own, not drift carried from the layers above. The ranking is by the growth
table's measure (layer_out rel-L2 of each step's rows taken together), worst step first:
a layer with a real bug stands out at the top even where quantization noise is everywhere.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from .result import json_fields

SHOWN = 5  # layers in the text summary (all in the JSON and HTML)


@dataclass
class LayerError:
    layer: int
    rel_l2: float  # worst over steps
    step: int  # where it is worst
    threshold: float  # the tolerance at that step

    def to_json(self) -> dict:
        return json_fields(self)


@dataclass
class IsolationRanking:
    ranking: list[LayerError]  # worst local error first
    metric: str = "rel_l2"
    kind: str = "layer_out"

    def to_json(self) -> dict:
        return {"metric": self.metric, "kind": self.kind, "ranking": self.ranking}


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


def ranking_text(r: IsolationRanking, sci) -> str:
    items = [f"L{e.layer} {sci(e.rel_l2)} (step {e.step})" for e in r.ranking[:SHOWN]]
    more = f", {len(r.ranking) - SHOWN} more" if len(r.ranking) > SHOWN else ""
    return ("isolated replay (every layer fed REF's input): layers by local error, layer_out rel-L2 at the worst step: "
            + ", ".join(items) + more)


def ranking_html(r: IsolationRanking, sci) -> str:
    top = r.ranking[0].rel_l2 if r.ranking else 0.0
    rows = []
    for rank, e in enumerate(r.ranking, 1):
        width = int(300 * e.rel_l2 / top) if top > 0 else 0
        bar = f'<svg width="{width + 2}" height="10"><rect width="{width}" height="10" fill="#c0392b"/></svg>'
        rows.append(f"<tr><td>{rank}</td><td>L{e.layer}</td><td>{html.escape(sci(e.rel_l2))}</td>"
                    f"<td>{e.step}</td><td>{html.escape(sci(e.threshold))}</td><td class=l>{bar}</td></tr>")
    return ("<p class=legend>Every layer was fed REF's input (trace replay --isolate): each error is the layer's own.</p>"
            "<table><tr><th>rank</th><th>layer</th><th>layer_out rel-L2</th><th>worst step</th><th>tolerance</th>"
            "<th class=l></th></tr>" + "".join(rows) + "</table>")
