"""The HTML report's "Vision" section: a PatchMap (diff/patch_map.py) drawn over each image."""

from __future__ import annotations

import html
import math

from .patch_map import PatchMap

CELL = 10  # pixels a grid cell is drawn at, at most
WIDTH = 360  # pixels an image's map is drawn at, at most


def render(pm: PatchMap, scale_of) -> str:
    """The HTML section: per image, the patches in their colours, each overlaid by its error's colour
    on the report's scale (`scale_of(values)`: html._Scale over error / tolerance), the first
    divergence framed."""
    ratios = [c[2] / pm.threshold if pm.threshold > 0 else c[2] for im in pm.images for c in im.cells]
    scale = scale_of(ratios)
    where = pm.kind + ("" if pm.layer is None else f" of layer {pm.layer}")
    out = [f"<h2>Vision: error of {html.escape(where)} over each image</h2>", "<div>"]
    for i, im in enumerate(pm.images):
        size = max(2, min(CELL, WIDTH // max(im.cols, 1)))
        body = []
        for r, c, e, colour in im.cells:
            ratio = e / pm.threshold if pm.threshold > 0 else e
            x, y = c * size, r * size
            tint = 0.0 if e == 0 else 0.85 if ratio > 1 else 0.35  # an exact cell shows the image alone
            body.append(
                f'<rect x="{x}" y="{y}" width="{size}" height="{size}" fill="{colour}"/>'
                f'<rect x="{x}" y="{y}" width="{size}" height="{size}" fill="{scale.color(ratio)}" '
                f'fill-opacity="{tint}"><title>row {r}, col {c}: rel-L2 {e:.3g}</title></rect>'
            )
        if pm.first is not None and pm.first[0] == i and pm.first[1] < len(im.cells):
            r, c = im.cells[pm.first[1]][:2]
            body.append(
                f'<rect x="{c * size}" y="{r * size}" width="{size}" height="{size}" fill="none" '
                'stroke="#000" stroke-width="2"/>'
            )
        h, w = im.rows * size, im.cols * size
        worst = max((cell[2] for cell in im.cells), default=0.0)
        over = sum(cell[2] > pm.threshold for cell in im.cells)
        out.append(
            f'<figure style="display:inline-block;margin:0 16px 8px 0"><svg width="{w}" height="{h}" role="img">'
            + "".join(body)
            + f'</svg><figcaption class="legend">image {i + 1}: {im.rows} x {im.cols} cells, {over} over the '
            f"tolerance, worst rel-L2 {_sci(worst)}</figcaption></figure>"
        )
    out.append("</div>")
    out.append(f'<svg width="760" height="34">{"".join(scale.legend(10, 6, 400, "tolerance"))}</svg>')
    out.append(
        '<p class="legend">Each cell is one real patch of the image (or, for pooled rows, one k x k cell of '
        "patches) in its own colour, tinted by its rel-L2 over the tolerance on the heatmap's scale: strong where "
        "it diverges. The black frame is the first divergence. Hover a cell for its value.</p>"
    )
    return "\n".join(out)


def _sci(v: float) -> str:
    return "0" if v == 0 else f"{v:.1e}" if math.isfinite(v) else str(v)
