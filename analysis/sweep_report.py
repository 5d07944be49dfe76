"""A sweep's summary (analysis/corpus.py SweepSummary) as text, JSON and one HTML page with plots
(the diff report's style and SVG frame, diff/svg.py)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from gemma4_trace.diff.fmt import sci
from gemma4_trace.diff.svg import CSS, LogPlot, svg
from gemma4_trace.traces.atomic import write_bytes_atomic

from .corpus import PERCENTILES, DivergenceCount, SweepSummary, percentile_key


def _stats_lines(s: dict, who: str, short: str = "RUN") -> list[str]:
    if not s.get("positions"):
        return [f"{who}: no finite token position to compare"]
    k, dp, t, pp = s["kl"], s["delta_p"], s["top1"], s["perplexity"]
    pct = lambda d: "  ".join(f"{q} {sci(v)}" for q, v in d.items())  # noqa: E731
    se = f" +/- {sci(k['stderr'])}" if k["stderr"] is not None else ""
    return [
        f"{who}: {s['positions']} token positions"
        + (f" ({s['non_finite_positions']} non-finite left out)" if s["non_finite_positions"] else ""),
        f"  KL(REF||{short}) mean {sci(k['mean'])}{se}, max {sci(k['max'])}",
        f"  KL percentiles: {pct(k['percentiles'])}",
        f"  dp = p_{short} - p_REF of REF's token: mean {sci(dp['mean'])}, RMS {sci(dp['rms'])}",
        f"  dp percentiles: {pct(dp['percentiles'])}",
        f"  top-1 agreement {100 * t['agreement']:.2f}% +/- {100 * t['stderr']:.2f}%",
        f"  perplexity of REF's tokens: REF {pp['ref']:.4g}, {short} {pp['run']:.4g}, ratio {pp['ratio']:.6g} "
        f"(ln {sci(pp['ln_ratio'])})",
    ]


def _site(d: dict | None) -> str:
    if d is None:
        return "-"
    where = "" if d["layer"] is None else f"layer {d['layer']} "
    return f"step {d['step']} {where}{d['kind']}"


def format_summary(summary: SweepSummary, worst: int = 10) -> str:
    s = summary.settings
    lines = [
        f"sweep: {summary.prompts} prompts, runtime {s['runtime']}"
        + (f" judged against baseline {s['baseline_runtime']}" if s.get("baseline_runtime") else "")
        + f", {s['max_new_tokens']} new tokens each",
        *_stats_lines(summary.run, "RUN vs REF"),
    ]
    if summary.base is not None:
        lines += _stats_lines(summary.base, "BASE vs REF", "BASE")
    if summary.histogram:
        lines.append("first divergences (layer, kind): prompts")
        for h in summary.histogram:
            lines.append(f"  {'-' if h.layer is None else h.layer:>5} {h.kind:<18} {h.prompts}")
    lines.append(f"worst prompts (of {summary.prompts}):")
    for w in summary.worst_first[:worst]:
        lines.append(
            f"  {w.id}: {'match' if w.match else 'DIVERGES at ' + _site(w.first_divergence)}, "
            f"KL mean {sci(w.kl_mean)}, max {sci(w.kl_max)} ({w.report})"
        )
    n = summary.diverging
    lines.append(
        f"verdict: {n} of {summary.prompts} prompts diverge (exit 1)"
        if n
        else f"verdict: all {summary.prompts} prompts match (exit 0)"
    )
    return "\n".join(lines)


def _percentile_plot(s: dict) -> str:
    """KL at each percentile on a log scale (the distribution's shape across the set)."""
    pct = s["kl"]["percentiles"]
    vals = [pct[percentile_key(q)] for q in reversed(PERCENTILES)]  # 0.1 .. 99.9
    pos = [v for v in vals if v > 0]
    if not pos:
        return "<p>KL is 0 at every position</p>"
    p = LogPlot(pos, len(vals), width=640, height=220, left=60, top=10, bottom=40, right=20)
    out = p.grid("#eee", label_first=True)
    out.append(p.polyline([(p.x(i), p.y(v)) for i, v in enumerate(vals)], "#2c6fbb", "1.5"))
    for i, (q, v) in enumerate(zip(reversed(PERCENTILES), vals)):
        out.append(
            f'<circle cx="{p.x(i):.1f}" cy="{p.y(v):.1f}" r="3" fill="#2c6fbb"><title>p{q:g}: {sci(v)}</title></circle>'
            f'<text x="{p.x(i):.1f}" y="{p.height - 22}" font-size="10" text-anchor="middle">p{q:g}</text>'
        )
    return svg(p.width, p.height, out)


def _histogram_plot(hist: list[DivergenceCount]) -> str:
    if not hist:
        return "<p>no prompt diverges</p>"
    e = html.escape
    top = max(h.prompts for h in hist)
    row, width = 20, 600
    out = []
    for i, h in enumerate(hist):
        label = f"{'-' if h.layer is None else 'layer ' + str(h.layer)} {h.kind}"
        w = 400 * h.prompts / top
        y = i * row + 4
        out.append(
            f'<text x="0" y="{y + 12}" font-size="11">{e(label)}</text>'
            f'<rect x="170" y="{y}" width="{w:.1f}" height="{row - 6}" fill="#c0392b"/>'
            f'<text x="{176 + w:.1f}" y="{y + 12}" font-size="11">{h.prompts}</text>'
        )
    return svg(width, len(hist) * row + 8, out)


def render_summary_html(summary: SweepSummary) -> str:
    e = html.escape
    n = summary.diverging
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trace sweep: {'divergence' if n else 'match'}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>trace sweep: {summary.prompts} prompts, runtime {e(str(summary.settings['runtime']))}</h1>",
        f'<div class="verdict {"bad" if n else "good"}">{e(format_summary(summary, worst=0))}</div>',
    ]
    if summary.run.get("positions"):
        parts += ["<h2>KL(REF||RUN) percentiles over every token position</h2>", _percentile_plot(summary.run)]
    parts += ["<h2>First divergence by (layer, kind)</h2>", _histogram_plot(summary.histogram)]
    parts.append(
        "<h2>Prompts, worst first</h2><table><tr><th>prompt</th><th>verdict</th><th>first divergence</th>"
        "<th>KL mean</th><th>KL max</th><th>top-1</th></tr>"
    )
    for w in summary.worst_first:
        parts.append(
            f'<tr><td class="l"><a href="{e(w.report)}">{e(w.id)}</a></td>'
            f'<td>{"match" if w.match else "diverges"}</td><td class="l">{e(_site(w.first_divergence))}</td>'
            f"<td>{sci(w.kl_mean)}</td><td>{sci(w.kl_max)}</td>"
            f"<td>{'-' if w.top1 is None else format(w.top1, '.3f')}</td></tr>"
        )
    parts += ["</table>", "<h2>Settings</h2><table>"]
    parts += [f'<tr><th class="l">{e(k)}</th><td class="l">{e(str(v))}</td></tr>' for k, v in summary.settings.items()]
    parts += ["</table>", "</body></html>"]
    return "\n".join(parts)


def _atomic_text(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), prefix=".sweep-partial-")


def write_summary(summary: SweepSummary, out_dir) -> None:
    """DIR/summary.json and DIR/summary.html, each complete or absent."""
    out_dir = Path(out_dir)
    _atomic_text(out_dir / "summary.json", json.dumps(summary.to_json(), indent=1) + "\n")
    _atomic_text(out_dir / "summary.html", render_summary_html(summary))
