"""A self-contained HTML report: inline CSS and SVG, no scripts fetched, no fonts, no links out."""

from __future__ import annotations

import html
import math
from pathlib import Path

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.atomic import atomic_output, check_output_path

from .align import PRE_KINDS
from .audio_svg import render as audio_map_html
from .fmt import fmt, sci
from .metrics import METRIC, PRIMARY, THRESHOLD_METRICS
from .patch_svg import render as patch_map_html
from .report import format_text, growth_summary, logits_text, token_summary
from .result import DiffResult, Divergence, Growth, IsolationRanking, LogitMetrics, TensorSummary, TokenInfo
from .svg import CSS, LogPlot, svg

MAX_COLS = 400  # heatmap steps are binned (max) beyond this
# the heatmap's colours: cool below the limit (1 = the tolerance, or BASE's envelope), warm above,
# each side log-linear over its decades of the scale
COOL = ("#2b4c9b", "#4f86c6", "#8fc1de", "#d7ecf0")  # far under .. just under the limit
WARM = ("#ffe680", "#fdae4b", "#f0582d", "#b2182b", "#5e0a3e", "#1a0014")  # at the limit .. far above
EXACT, NOT_COMPARED, NONFINITE = "#ffffff", "#c8c8c8", "#000000"
MIN_DECADES = 4
LABEL_PX = 30  # px a decade's tick label ("1e-10", 10 px type) needs on the colour bar


def _mix(stops: tuple[str, ...], t: float) -> str:
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    a, b = (tuple(int(c[k : k + 2], 16) for k in (1, 3, 5)) for c in (stops[i], stops[i + 1]))
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))


def _hatch(x, y, w, h) -> str:
    return f'<path d="M{x},{y + h} L{x + w},{y}" stroke="#8a8a8a" stroke-width="1" pointer-events="none"/>'


class _Scale:
    """A log colour scale over the decades the values span (at least MIN_DECADES, the limit 1
    inside): 0 is "exact", None "not compared", inf/NaN "non-finite", each its own colour."""

    def __init__(self, values):
        logs = [math.log10(v) for v in values if v is not None and math.isfinite(v) and v > 0]
        lo = math.floor(min(logs, default=0.0))
        hi = math.ceil(max(logs, default=0.0))
        lo, hi = min(lo, -1), max(hi, 1)  # the limit (1e0) strictly inside
        while hi - lo < MIN_DECADES:  # widen towards the side with less room
            if -lo <= hi:
                lo -= 1
            else:
                hi += 1
        self.lo, self.hi = lo, hi

    def color(self, v) -> str:
        if v is None:
            return NOT_COMPARED
        if not math.isfinite(v):
            return NONFINITE
        if v <= 0:
            return EXACT
        x = min(max(math.log10(v), self.lo), self.hi)
        return _mix(COOL, (x - self.lo) / -self.lo) if x < 0 else _mix(WARM, x / self.hi)

    def legend(self, x0: int, y0: int, width: int, limit: str) -> list[str]:
        """The colour bar with a tick per decade, the limit marked, and the special colours."""
        n = 80
        out = [f'<g class="log-scale" data-decades="{self.hi - self.lo}" data-lo="{self.lo}" data-hi="{self.hi}">']
        for i in range(n):
            x = self.lo + (self.hi - self.lo) * (i + 0.5) / n
            out.append(
                f'<rect x="{x0 + width * i / n:.1f}" y="{y0}" width="{width / n + 0.3:.1f}" height="10" '
                f'fill="{self.color(10.0**x)}"/>'
            )
        decade = width / (self.hi - self.lo)
        every = math.ceil(LABEL_PX / decade)  # a label on every decade that has room for one ("1e-10")
        for e in range(self.lo, self.hi + 1):
            x = x0 + decade * (e - self.lo)
            mark = e == 0
            out.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0 - (4 if mark else 0)}" y2="{y0 + 13}" '
                f'stroke="#000" stroke-width="{2 if mark else 1}"/>'
            )
            if e % every == 0:
                label = "1" if mark else f"1e{e}"
                out.append(f'<text x="{x:.1f}" y="{y0 + 24}" font-size="10" text-anchor="middle">{label}</text>')
        # the limit's name under its mark, on a line of its own (no decade's label beside it to run into)
        x = x0 + decade * -self.lo
        out.append(f'<text x="{x:.1f}" y="{y0 + 36}" font-size="10" text-anchor="middle">= {limit}</text>')
        x = x0 + width + 16
        for color, label in ((EXACT, "0 (exact)"), (NOT_COMPARED, "not compared"), (NONFINITE, "NaN/Inf")):
            out.append(
                f'<rect x="{x}" y="{y0}" width="12" height="10" fill="{color}" stroke="#888"/>'
                + (_hatch(x, y0, 12, 10) if color == NOT_COMPARED else "")
                + f'<text x="{x + 16}" y="{y0 + 9}" font-size="10">{label}</text>'
            )
            x += 22 + 6 * len(label)
        out.append("</g>")
        return out


def _heatmap_rows(growth: Growth) -> list[tuple[str, str, tuple, list, list]]:
    """(label, what it holds, key into growth.base, rel-L2 per step, tolerance per step) per row:
    the tensors before the layers, each layer's output, the tensors after the layers."""
    rows = []
    none = [None] * len(growth.steps)
    for tower, band in growth.towers.items():  # one band per encoder tower: its layers, in the prefill
        key = S.kind_key("layer_out", tower)
        rows += [
            (f"{tower[0]}L{l}", f"{tower} tower layer_out of layer {l} (prefill only)", (key, l), [v] + none[1:])
            + ([t] + none[1:],)
            for l, v, t in band
        ]
    e = growth.globals.get("embeddings", (none, none))
    rows.append(("inputs", "embeddings, per_layer_inputs, RoPE (colour: embeddings)", ("embeddings", None), *e))
    rows += [
        (f"L{l}", f"layer_out of layer {l}", ("layer_out", l), v, t)
        for l, v, t in zip(growth.layers, growth.table, growth.thresholds)
    ]
    f = growth.globals.get("final_hidden", (none, none))
    rows.append(("outputs", "final_hidden, logits, token (colour: final_hidden)", ("final_hidden", None), *f))
    return rows


def _band(key: tuple) -> str:
    """A heatmap row's band: an encoder tower's, or the text tower's inputs, layers or outputs."""
    spec = S.KIND_BY_NAME[key[0]]
    if spec.encoder:
        return spec.tower
    return "layers" if key[1] is not None else "inputs" if key[0] in PRE_KINDS else "outputs"


def _div_row(div: Divergence, rows: list) -> int:
    """The heatmap row of the first divergence: its layer's (its tower's), or the row before or after
    its band's layers."""
    keys = [r[2] for r in rows]
    spec = S.KIND_BY_NAME[div.kind]
    own = (S.kind_key("layer_out", spec.tower), div.layer)
    if div.layer is not None and own in keys:
        return keys.index(own)
    band = [i for i, k in enumerate(keys) if _band(k) == (spec.tower if spec.encoder else _band((div.kind, div.layer)))]
    if spec.encoder and band:  # the tower's first tensor: its first row; pooled, soft tokens: its last
        return band[0] if div.kind == S.TOWER_BY_NAME[spec.tower].kinds[0].key else band[-1]
    return band[0] if band else 0


def _own_ratio(div: Divergence, factor: float | None) -> float | None:
    """The first divergence's own row error over its limit (the tolerance, or BASE's envelope),
    for a float metric; None for masks, tokens and structural problems."""
    m = METRIC.get(div.metric)
    if m is None or not m.threshold:
        return None

    def excess(v):
        return 1.0 - v if m.fails_below else v

    limit = excess(div.threshold)
    if factor is not None and div.baseline is not None and math.isfinite(div.baseline.base_value):
        limit = max(limit, factor * excess(div.baseline.base_value))
    return excess(div.value) / limit if limit > 0 else math.inf


def _heatmap(growth: Growth, div: Divergence | None, factor: float | None = None) -> str:
    """Layer x step map of the residual stream's error on a log colour scale: against the
    tolerance, or (factor given: --baseline) against BASE's envelope max(factor x BASE's
    rel-L2, tolerance)."""
    if not growth.steps or not (growth.table or growth.towers):
        return "<p>no layer outputs compared</p>"
    rows = _heatmap_rows(growth)
    n_steps = len(growth.steps)
    cells, bin_, cols = _heatmap_cells(rows, growth, factor)
    scale = _Scale([cell[2] for cell in cells])
    cw = max(3, min(28, 1000 // cols))
    ch = max(8, min(22, 600 // len(rows)))
    left, top, right = 64, 22, 340
    gaps = [0]  # a gap between bands (an encoder tower's, the inputs, the layers, the outputs)
    for ri in range(1, len(rows)):
        gaps.append(gaps[-1] + (4 if _band(rows[ri][2]) != _band(rows[ri - 1][2]) else 0))
    ys = [top + ri * ch + gaps[ri] for ri in range(len(rows))]
    w, h = max(left + cols * cw + right, 640), top + len(rows) * ch + 76 + gaps[-1]
    limit = "tolerance" if factor is None else "envelope"
    out = []
    for ri, (label, what, *_rest) in enumerate(rows):
        y = ys[ri]
        out.append(
            f'<text x="{left - 6}" y="{y + ch * 0.75:.1f}" font-size="11" text-anchor="end">{label}'
            f"<title>{html.escape(what)}</title></text>"
        )
    for ri, c, worst, v, steps in cells:
        what = rows[ri][1]
        if worst is None:
            fill, tip, cls = NOT_COMPARED, f"{what}, {steps}: not compared", ' class="nc"'
        else:
            of = f"x{sci(worst)} of the {limit}" if math.isfinite(worst) else f"beyond the {limit} (non-finite)"
            tip, fill, cls = f"{what}, {steps}: rel-L2 {sci(v)} ({of})", scale.color(worst), ""
            if fill == EXACT:  # white on white: outlined
                cls = ' stroke="#d0d0d0"'
        out.append(
            f'<rect{cls} x="{left + c * cw}" y="{ys[ri]}" width="{cw}" height="{ch}" fill="{fill}">'
            f"<title>{html.escape(tip)}</title></rect>"
        )
        if worst is None:  # hatched: a diagonal across the neutral grey
            out.append(_hatch(left + c * cw, ys[ri], cw, ch))
    if div is not None and div.step < n_steps:
        ri = _div_row(div, rows)
        x, text_x = left + (div.step // bin_) * cw, left + cols * cw + 8
        out += _first_divergence_mark(div, rows[ri], (x, ys[ri], cw, ch), text_x, factor, scale)
    for c in range(0, cols, max(1, cols // 10)):
        out.append(
            f'<text x="{left + c * cw + cw / 2:.1f}" y="{top - 6}" font-size="10" text-anchor="middle">'
            f"{c * bin_}</text>"
        )
    y0 = ys[-1] + ch + 14
    binned = f", max over {bin_} steps" if bin_ > 1 else ""
    what = "rel-L2 / tolerance" if factor is None else f"RUN's rel-L2 / max({factor:g} x BASE's rel-L2, tolerance)"
    out.append(
        f'<text x="{left}" y="{y0}" font-size="11">step (columns{binned}) / tensor (rows); colour = {what}, '
        f"log scale</text>"
    )
    out += scale.legend(left, y0 + 10, min(420, max(240, cols * cw)), limit)
    return svg(w, h, out)


def _heatmap_cells(rows, growth: Growth, factor: float | None) -> tuple[list, int, int]:
    """The heatmap's cells [(row, column, worst ratio to the limit, worst rel-L2, steps text)], the
    steps binned into one column (beyond MAX_COLS steps) and the number of columns."""
    n_steps = len(growth.steps)
    base = growth.base or {}

    def ratio(key, v, t, s):
        if v is None or not t:
            return None
        limit = t if factor is None else max(t, factor * ((base.get(key) or [0.0] * n_steps)[s] or 0.0))
        return v / limit if limit > 0 else math.inf

    bin_ = max(1, math.ceil(n_steps / MAX_COLS))
    cols = math.ceil(n_steps / bin_)
    cells = []
    for ri, (_, _, key, vals, tols) in enumerate(rows):
        for c in range(cols):
            s0, s1 = c * bin_, min(n_steps, (c + 1) * bin_)
            rs = [r for r in (ratio(key, vals[s], tols[s], s) for s in range(s0, s1)) if r is not None]
            vs = [vals[s] for s in range(s0, s1) if vals[s] is not None]
            worst = None if not rs else (math.inf if any(not math.isfinite(r) for r in rs) else max(rs))
            cells.append(
                (ri, c, worst, max(vs) if vs else None, f"step {s0}" if s1 - s0 == 1 else f"steps {s0}-{s1 - 1}")
            )
    return cells, bin_, cols


def _first_divergence_mark(div: Divergence, row, cell: tuple, text_x, factor, scale) -> list[str]:
    """The first divergence's cell (x, y, width, height), outlined, and its label at text_x (in its
    own tensor's colour when the row is coloured by another)."""
    x, y, cw, ch = cell
    limit = "tolerance" if factor is None else "envelope"
    out = []
    own = _own_ratio(div, factor)
    if own is not None and row[2][0] != div.kind:  # a row coloured by another tensor: the divergent row's
        out.append(
            f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" fill="{scale.color(own)}"><title>'
            f"{html.escape(div.kind)}, step {div.step} (the first divergence's row): "
            f"x{sci(own)} of the {limit}</title></rect>"
        )
    where = div.kind + (f" of layer {div.layer}" if div.layer is not None else "")
    out.append(
        f'<g class="first-div" data-row="{html.escape(row[0])}" data-step="{div.step}">'
        f'<rect x="{x - 1}" y="{y - 1}" width="{cw + 2}" height="{ch + 2}" fill="none" stroke="#000" '
        f'stroke-width="3"/><rect x="{x + 1}" y="{y + 1}" width="{cw - 2}" height="{ch - 2}" fill="none" '
        f'stroke="#fff" stroke-width="1"/>'
        f'<text x="{text_x}" y="{y + ch * 0.75:.1f}" font-size="11" font-weight="bold">'
        f"&#9664; first divergence: {html.escape(where)}, step {div.step}</text>"
        f"<title>first divergence: {html.escape(where)}, step {div.step}</title></g>"
    )
    return out


def _curves(growth: Growth, div: Divergence | None) -> str:
    table, layers = growth.table, growth.layers
    if not table or not table[0] or not layers:
        return ""
    n_steps = len(table[0])
    series = [("worst step", growth.max_over_steps, "#c0392b")]
    series.append(("step 0 (prefill)", [row[0] for row in table], "#2c7fb8"))
    if n_steps > 1:
        series.append((f"step {n_steps - 1} (last)", [row[-1] for row in table], "#7b3294"))
    if div is not None and 0 < div.step < n_steps - 1:
        series.append((f"step {div.step} (divergence)", [row[div.step] for row in table], "#e66101"))
    vals = [v for _, s, _ in series for v in s if v is not None and v > 0 and math.isfinite(v)]
    thr = [t for row in growth.thresholds for t in row if t]
    vals += thr[:1]
    if not vals:
        return "<p>all layer outputs identical (rel-L2 = 0)</p>"
    p = LogPlot(vals, len(layers), width=700, height=260, left=60, top=14, bottom=36, right=150)
    W, H, L, T, B = p.width, p.height, p.left, p.top, p.bottom
    out = p.grid("#e3e3e8")
    if thr:
        t = thr[0]
        out.append(p.hline(t, "#555", ' stroke-dasharray="4 3">') + f"<title>tolerance {sci(t)}</title></line>")
    for i, l in enumerate(layers):
        if len(layers) <= 40 or i % max(1, len(layers) // 20) == 0:
            out.append(f'<text x="{p.x(i):.1f}" y="{H - B + 14}" font-size="10" text-anchor="middle">{l}</text>')
    out.append(f'<text x="{(L + W - 150) / 2:.0f}" y="{H - 6}" font-size="11" text-anchor="middle">layer</text>')
    for k, (name, s, color) in enumerate(series):
        pts = [(p.x(i), p.y(v)) for i, v in enumerate(s) if v is not None and v > 0 and math.isfinite(v)]
        if pts:
            out.append(p.polyline(pts, color, "2"))
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in pts]
        out.append(
            f'<rect x="{W - 140}" y="{T + k * 18}" width="12" height="4" fill="{color}"/>'
            f'<text x="{W - 122}" y="{T + k * 18 + 6}" font-size="11">{html.escape(name)}</text>'
        )
    return svg(W, H, out)


def _ranking(r: IsolationRanking) -> str:
    top = r.ranking[0].rel_l2 if r.ranking else 0.0
    rows = []
    for rank, e in enumerate(r.ranking, 1):
        width = int(300 * e.rel_l2 / top) if top > 0 else 0
        bar = svg(width + 2, 10, f'<rect width="{width}" height="10" fill="#c0392b"/>', role=False)
        rows.append(
            f"<tr><td>{rank}</td><td>L{e.layer}</td><td>{html.escape(sci(e.rel_l2))}</td>"
            f"<td>{e.step}</td><td>{html.escape(sci(e.threshold))}</td><td class=l>{bar}</td></tr>"
        )
    return (
        "<p class=legend>Every layer was fed REF's input (trace replay --isolate): each error is the layer's own.</p>"
        "<table><tr><th>rank</th><th>layer</th><th>layer_out rel-L2 of the step (its rows together)</th><th>worst "
        "step</th><th>tolerance</th>"
        "<th class=l></th></tr>" + "".join(rows) + "</table>"
    )


def _logits_plot(m: LogitMetrics) -> str:
    """KL(REF||RUN) per step on a log scale, top-1 disagreements marked."""
    kl = [v if v is not None and math.isfinite(v) else None for v in m.kl]
    pos = [v for v in kl if v is not None and v > 0]
    if not pos:
        return "<p>KL is 0 at every step</p>"
    n = len(kl)
    p = LogPlot(pos, n, width=900, height=220, left=60, top=10, bottom=30, right=10)
    out = p.grid("#eee", label_first=True)
    out.append(p.polyline([(p.x(i), p.y(v)) for i, v in enumerate(kl) if v is not None], "#2c6fbb", "1.5"))
    for i, (v, t1) in enumerate(zip(kl, m.top1)):
        if v is not None:
            color = "#c0392b" if t1 == 0 else "#2c6fbb"
            out.append(
                f'<circle cx="{p.x(i):.1f}" cy="{p.y(v):.1f}" r="2.5" fill="{color}">'
                f"<title>step {i}: KL {sci(v)}, top-5 overlap {m.top5[i]:.2f}, drop {sci(m.drop[i])}</title></circle>"
            )
    out.append(f'<text x="{p.left}" y="{p.height - 8}" font-size="11">step 0 .. {n - 1} (red: top-1 differs)</text>')
    return svg(p.width, p.height, out)


def _token_table(tokens: TokenInfo, base: list[int] | None = None, limit: int = 300) -> str:
    """REF's and RUN's token per step; `base`: BASE's (--baseline), a flip BASE makes too said so."""
    ref, run = tokens.reference, tokens.candidate
    n = max(len(ref), len(run))
    if not n:
        return "<p>no tokens</p>"
    mism = set(tokens.mismatch_steps or [])
    rows = [s for s in range(n) if s < limit or s in mism]
    out = ["<table><tr><th>step</th><th>REF token</th><th>RUN token</th><th>match</th></tr>"]
    for s in rows:
        a = ref[s] if s < len(ref) else None
        b = run[s] if s < len(run) else None
        ok = a is not None and a == b
        note = "" if ok else ("-" if a is None or b is None else "no")
        if s == tokens.first_mismatch_step:
            note = f"no - {tokens.flip.label}"
        if not ok and base is not None and s < len(base) and b is not None and base[s] == b:
            note += " (BASE chose it too: inside the envelope)"
        out.append(
            f'<tr class="{"" if ok else "x"}"><td>{s}</td><td>{"" if a is None else a}</td>'
            f'<td>{"" if b is None else b}</td><td class="l">{"yes" if ok else html.escape(note)}</td></tr>'
        )
    if len(rows) < n:
        out.append(f'<tr><td colspan="4" class="l">... {n - len(rows)} matching steps not shown</td></tr>')
    out.append("</table>")
    return "".join(out)


def _tensor_table(tensors: list[TensorSummary], baseline: bool = False) -> str:
    # the tolerance column is the primary metric's, next to it
    heads = "".join(
        f"<th>{m.summary_label} (worst row)</th>" + ("<th>tolerance</th>" if m.name == PRIMARY else "")
        for m in THRESHOLD_METRICS
    )
    out = [f"<table><tr><th>kind</th><th>layer</th><th>rows</th>{heads}<th>status</th></tr>"]
    for t in tensors:
        worst = t.worst or {}
        none = t.rows_compared == 0 and t.worst is not None  # no row read: no value to show
        cells = "".join(
            ('<td class="nc">not compared</td>' if none else f"<td>{fmt(m, worst.get(m.name))}</td>")
            + (f"<td>{sci(t.threshold)}</td>" if m.name == PRIMARY else "")
            for m in THRESHOLD_METRICS
        )
        status = t.status + (f": {html.escape(t.reason)}" if t.reason else "")
        if baseline and t.status == "ok" and not none and _beyond(worst.get(PRIMARY), t.threshold):
            status = "ok: beyond the tolerance, inside BASE's envelope"
        cls = "x" if t.status in ("diverged", "shape", "rows") else "nc" if t.reason else ""
        out.append(
            f'<tr class="{cls}"><td class="l">{t.kind}</td>'
            f"<td>{'' if t.layer is None else t.layer}</td><td>{t.rows_compared}/{t.rows}</td>{cells}"
            f'<td class="l">{status}</td></tr>'
        )
    out.append("</table>")
    return "".join(out)


def _beyond(value, threshold) -> bool:
    return value is not None and threshold is not None and math.isfinite(value) and value > threshold


def _base_tokens(result: DiffResult) -> list[int] | None:
    b = result.baseline
    return b.against_ref.tokens if b is not None and b.against_ref is not None else None


def _heatmaps(result: DiffResult, d: Divergence | None) -> list[str]:
    """The layer x step maps, the one the verdict uses first: with --baseline, RUN's error over
    BASE's envelope, then the plain tolerance map (which the baseline's verdict overrides)."""
    plain = [
        "<h2>Error growth: layer x step</h2>"
        if result.baseline is None
        else "<h2>Against the tolerance alone (not the verdict: --baseline judges by the envelope above)</h2>",
        _heatmap(result.growth, d),
        "<p class=\"legend\">Each cell: the step's rel-L2 of the residual stream (a layer's output; the first row the "
        "embeddings, the last final_hidden) over its tolerance, on a log scale: blue under the tolerance, yellow at "
        "it, red to black far above; white exact, hatched grey not compared. Hover a cell for its value. The "
        "black-and-white frame marks the first divergence (a divergence before or after the layers sits in the "
        "first or last row).</p>",
    ]
    if result.growth.towers:  # bands above the text tower's rows: a sentence of their own (text-only pages unchanged)
        plain[-1] = plain[-1].replace(
            "</p>",
            " The bands above the inputs are the encoder towers' layers (vL0: the vision tower's layer 0; aL0: "
            "audio's), their rows taken together in the prefill column; they have no decode steps.</p>",
        )
    if result.baseline is None:
        return plain
    factor = result.baseline.factor
    return [
        "<h2>Error growth against the baseline: RUN's error over BASE's envelope (the verdict's map)</h2>",
        _heatmap(result.growth, d, factor),
        f"<p class=\"legend\">Each cell: RUN's rel-L2 over max({factor:g} x BASE's rel-L2 against REF, tolerance) "
        "at that step, on a log scale: blue inside the envelope, warm where RUN leaves what BASE (the trusted run) "
        "does; white exact, hatched grey not compared. The verdict is per row (docs/quantized.md); this map is per "
        "step.</p>",
        *plain,
    ]


def render_html(result: DiffResult, about: list[tuple[str, str]] | None = None) -> str:
    """The report page; `about`: (label, text) rows shown under the title (a sweep's prompt)."""
    d = result.first_divergence
    e = html.escape
    ref, run = result.reference, result.candidate
    isolated = run.mode == "isolated"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trace diff: {'match' if result.match else 'divergence'}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>trace diff: {e(Path(ref.path).name)} (REF) vs {e(Path(run.path).name)} (RUN)</h1>",
        *(
            ["<table>" + "".join(f'<tr><th class="l">{e(k)}</th><td class="l">{e(v)}</td></tr>' for k, v in about)]
            + ["</table>"]
            if about
            else []
        ),
        f'<div class="verdict {"good" if result.match else "bad"}">{e(format_text(result))}</div>',
        *([patch_map_html(result.patch_map, _Scale)] if result.patch_map is not None else []),
        *([audio_map_html(result.audio_map, _Scale)] if result.audio_map is not None else []),
        *(
            ["<h2>Layers by local error (isolated replay)</h2>", _ranking(result.isolation)]
            if result.isolation is not None
            else []
        ),
        *_heatmaps(result, d),
        "<h2>Error vs layer</h2>",
        _curves(result.growth, d),
        f'<p class="legend">{e(growth_summary(result.growth, isolated=isolated))}</p>',
        "<h2>Tokens</h2>",
        f"<p>{e(token_summary(result.tokens, isolated)).replace(chr(10), '<br>')}</p>",
        _token_table(result.tokens, _base_tokens(result)),
        *(
            [
                "<h2>Logit distribution: KL(REF||RUN) per step</h2>",
                _logits_plot(result.logits),
                f'<p class="legend">{e(logits_text(result.logits, isolated))}</p>',
            ]
            if result.logits is not None
            else []
        ),
        "<h2>Tensors compared</h2>",
        _tensor_table(result.tensors, baseline=result.baseline is not None),
        "<h2>Provenance</h2>",
        "<table>"
        + "".join(
            f'<tr><th class="l">{e(k)}</th><td class="l">{e(str(getattr(ref, k)))}</td><td '
            f'class="l">{e(str(getattr(run, k)))}</td></tr>'
            for k in ("path", "mode", "dtype", "runtime", "device", "steps", "positions")
        )
        + "</table>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write_html(result: DiffResult, path, force: bool = False) -> Path:
    """Write the report with the traces' atomic writer: complete or absent, a normal file's mode,
    never over a file that appeared meanwhile (without force) nor over either trace."""
    check_output_path(path, force, inputs=(result.reference.path, result.candidate.path))
    with atomic_output(path, force) as tmp:
        tmp.write_text(render_html(result), encoding="utf-8")
    return Path(path)
