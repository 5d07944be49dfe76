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
    if worst and summary.worst_first:
        lines.append(f"worst prompts (of {summary.prompts}):")
    for w in summary.worst_first[:worst]:
        lines.append(
            f"  {w.id}: {'match' if w.match else 'DIVERGES at ' + _site(w.first_divergence)}, "
            f"KL mean {sci(w.kl_mean)}, max {sci(w.kl_max)} ({w.report})"
        )
    for title, items in (("failed to run", summary.failed), ("skipped (--skip-unsupported)", summary.skipped)):
        if items and worst:  # the HTML page (worst=0) has them in tables of their own
            lines.append(f"{title} ({len(items)}):")
            lines += [f"  {f['id']} (line {f['line']}): {f['reason']}" for f in items[: max(worst, 10)]]
            if len(items) > max(worst, 10):
                lines.append(f"  ... and {len(items) - max(worst, 10)} more (summary.json lists them all)")
    lines.append(verdict_line(summary))
    return "\n".join(lines)


def verdict_line(summary: SweepSummary) -> str:
    n, failed, skipped = summary.diverging, len(summary.failed), len(summary.skipped)
    more = (f", {failed} failed to run" if failed else "") + (f", {skipped} skipped" if skipped else "")
    if n:
        return f"verdict: {n} of {summary.prompts} prompts diverge{more} (exit 1)"
    if failed:
        return f"verdict: {summary.prompts} prompts match{more} (exit 1)"
    return f"verdict: all {summary.prompts} prompts match{more} (exit 0)"


def exit_code(summary: SweepSummary) -> int:
    """1 when a prompt diverges or failed to run, else 0."""
    return 1 if summary.diverging or summary.failed else 0


def _percentile_plot(series: list[tuple[str, dict, str]]) -> str:
    """KL at each percentile on a log scale (the distribution's shape across the set), one line per
    (name, statistics, colour): RUN, and BASE beside it when the sweep has one."""
    qs = list(reversed(PERCENTILES))  # 0.1 .. 99.9
    lines = [(name, [s["kl"]["percentiles"][percentile_key(q)] for q in qs], colour) for name, s, colour in series]
    pos = [v for _, vals, _ in lines for v in vals if v > 0]
    if not pos:
        return "<p>KL is 0 at every position</p>"
    p = LogPlot(pos, len(qs), width=640, height=220, left=60, top=10, bottom=40, right=20)
    out = p.grid("#eee", label_first=True)
    for i, q in enumerate(qs):
        out.append(f'<text x="{p.x(i):.1f}" y="{p.height - 22}" font-size="10" text-anchor="middle">p{q:g}</text>')
    # drawn last to first, RUN on top: where the lines meet, RUN's is the one seen (BASE's, drawn over it,
    # hid it exactly when the two are close)
    for k, (name, vals, colour) in reversed(list(enumerate(lines))):
        shown = [(i, v) for i, v in enumerate(vals) if v > 0]  # a KL of 0 has no place on a log scale
        out.append(f'<g data-series="{name.lower()}">')
        out.append(p.polyline([(p.x(i), p.y(v)) for i, v in shown], colour, "1.5"))
        for i, v in shown:
            out.append(
                f'<circle cx="{p.x(i):.1f}" cy="{p.y(v):.1f}" r="3" fill="{colour}">'
                f"<title>{name} p{qs[i]:g}: {sci(v)}</title></circle>"
            )
        out.append("</g>")
        if len(lines) > 1:  # the legend
            x = p.left + 10 + 90 * k
            out.append(
                f'<rect x="{x}" y="{p.height - 12}" width="12" height="4" fill="{colour}"/>'
                f'<text x="{x + 16}" y="{p.height - 8}" font-size="11">{name}</text>'
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
    n = summary.diverging or len(summary.failed)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trace sweep: {'divergence' if n else 'match'}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>trace sweep: {summary.prompts} prompts, runtime {e(str(summary.settings['runtime']))}</h1>",
        f'<div class="verdict {"bad" if n else "good"}">{e(format_summary(summary, worst=0))}</div>',
    ]
    series = [("RUN", summary.run, "#2c6fbb")]
    if summary.base is not None and summary.base.get("positions"):
        series.append(("BASE", summary.base, "#888888"))
    if summary.run.get("positions"):
        title = "KL(REF||RUN)" + (" and KL(REF||BASE)" if len(series) > 1 else "")
        parts += [f"<h2>{title} percentiles over every token position</h2>", _percentile_plot(series)]
    if summary.worst_first:
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
    if summary.worst_first:
        parts.append("</table>")
    for title, items in (("Failed to run", summary.failed), ("Skipped (--skip-unsupported)", summary.skipped)):
        if items:
            parts.append(f"<h2>{title}</h2><table><tr><th>prompt</th><th>line</th><th>reason</th></tr>")
            parts += [
                f'<tr><td class="l">{e(f["id"])}</td><td>{f["line"]}</td><td class="l">{e(f["reason"])}</td></tr>'
                for f in items
            ]
            parts.append("</table>")
    parts.append("<h2>Settings</h2><table>")
    parts += [
        f'<tr><th class="l">{e(k)}</th><td class="l">{e(_setting(v))}</td></tr>' for k, v in summary.settings.items()
    ]
    parts += ["</table>", "</body></html>"]
    return "\n".join(parts)


def _setting(v) -> str:
    """A setting as a reader writes it: none, yes / no, numbers and text as they are."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _atomic_text(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), prefix=".sweep-partial-")


def write_summary(summary: SweepSummary, out_dir) -> None:
    """DIR/summary.json and DIR/summary.html, each complete or absent."""
    out_dir = Path(out_dir)
    _atomic_text(out_dir / "summary.json", json.dumps(summary.to_json(), indent=1) + "\n")
    _atomic_text(out_dir / "summary.html", render_summary_html(summary))
