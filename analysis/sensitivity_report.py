"""`trace sensitivity --report FILE.html`: the ranking as a self-contained page (the diff
report's style and SVG frame, diff/svg.py), rendered from the typed result
(analysis/sensitivity.py Sensitivity) and its text summary."""

from __future__ import annotations

import html
from pathlib import Path

from gemma4_trace.diff.svg import CSS, svg
from gemma4_trace.traces.atomic import atomic_output

from .runner import METRICS
from .sensitivity import Sensitivity


def _cell(x, top1: bool = False) -> str:
    return "-" if x is None else f"{x:.3f}" if top1 else f"{x:.2e}"  # the text summary's digits


BAR = 80  # px: the longest bar; with the 13 number columns the table fits a 1400 px window


def _bar(value, top: float, color: str) -> str:
    width = int(BAR * value / top) if value is not None and top > 0 else 0
    return svg(width + 2, 10, f'<rect width="{width}" height="10" fill="{color}"/>', role=False)


# the ranked table is wider than a text page: the page takes the window, a number never wraps, a
# heading wraps onto as many lines as it needs (the 16 columns fit a 1400 px window)
WIDE = "body{max-width:none}td{white-space:nowrap}th{vertical-align:bottom}"


def render_sensitivity_html(result: Sensitivity, summary: str, ref_name: str) -> str:
    """The text summary, the ranked table with every metric, and two bars per unit: KL mean with
    only the unit quantized (where measured) and its first-ranking error (the isolated replay's
    layer_out, or for llama.cpp the weight rel-L2)."""
    e = html.escape
    ranking = result.units
    weight = result.first_ranking == "weight"
    first = "weight rel-L2" if weight else "isolated layer_out"
    top_kl = max((u.only_quantized["kl_mean"] for u in ranking if u.only_quantized), default=0.0)
    top_first = max((u.isolated for u in ranking if u.isolated is not None), default=0.0)
    head = (
        f"<tr><th>rank</th><th>unit</th><th>precision</th><th>{first}</th>"
        "<th>only quantized: KL mean</th><th>KL p99</th><th>top&#8209;1</th><th>layer_out (all)</th>"
        "<th>layer_out (its layer)</th><th>only float: KL mean</th><th>KL p99</th><th>top&#8209;1</th>"
        f"<th>layer_out (all)</th><th class=l>KL mean, only quantized</th><th class=l>{first}</th></tr>"
    )
    rows = []
    for k, u in enumerate(ranking, 1):
        q, f = u.only_quantized or {}, u.only_float or {}
        cells = [
            str(k),
            e(str(u.unit)),
            e(str(u.precision)),
            _cell(u.isolated),
            *(_cell(q.get(m), m == "top1") for m in METRICS),
            _cell(u.unit_layer_out),
            *(_cell(f.get(m), m == "top1") for m in METRICS),
        ]
        bars = [_bar(q.get("kl_mean"), top_kl, "#c0392b"), _bar(u.isolated, top_first, "#4f86c6")]
        rows.append(
            f'<tr id="{e(str(u.unit))}">'
            + "".join(f"<td{' class=l' if i in (1, 2) else ''}>{c}</td>" for i, c in enumerate(cells))
            + "".join(f"<td class=l>{b}</td>" for b in bars)
            + "</tr>"
        )
    a = result.all_quantized
    blue = (
        "the unit's weight rel-L2 (dequantized vs float; llama.cpp cannot isolate layers)."
        if weight
        else "the unit's layer's own error in the isolated replay (every layer fed REF's input)."
    )
    title = f"trace sensitivity: {e(str(result.runtime))} by {e(str(result.granularity))}"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{title}</title>",
            f"<style>{CSS}{WIDE}</style></head><body>",
            f"<h1>{title} on {e(ref_name)}</h1>",
            f"<pre>{e(summary)}</pre>",
            "<h2>All quantized</h2>",
            "<table><tr><th>KL mean</th><th>KL p99</th><th>top&#8209;1</th><th>layer_out</th></tr><tr>"
            + "".join(f"<td>{_cell(a[m], m == 'top1')}</td>" for m in METRICS)
            + "</tr></table>",
            "<h2>Units, ranked</h2>",
            "<table>" + head + "".join(rows) + "</table>",
            '<p class="legend">KL: mean (and 99th percentile) over the steps of KL(REF||RUN) of the next-token '
            "distributions, nats; top-1: the fraction of steps where RUN's argmax is REF's token; layer_out: the "
            "worst per-row rel-L2 of layer_out (over all layers, or the unit's own layer). 'only quantized': only "
            "this unit at its precision, every other unit float; 'only float': only this unit float, every other "
            "unit quantized (full replays, for the first ranking's first units; '-' where none ran). Red bar: KL "
            f"mean with only the unit quantized, relative to the largest; blue bar: {blue}</p>",
            "</body></html>",
        ]
    )


def write_sensitivity_html(result: Sensitivity, summary: str, ref_name: str, path, force: bool = False) -> None:
    """Written whole or not at all (the traces' atomic writer)."""
    text = render_sensitivity_html(result, summary, ref_name)
    with atomic_output(path, force) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
