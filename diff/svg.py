"""What every HTML page of the tool shares: the style sheet, the inline SVG element and the frame
of a log-scale plot (the diff report, diff/html.py; the sweep and sensitivity pages, analysis/)."""

from __future__ import annotations

import math

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#1d2330;max-width:1200px}
h1{font-size:20px;margin:0 0 12px}h2{font-size:16px;margin:24px 0 8px;border-bottom:1px solid #dde}
.verdict{padding:10px 14px;border-radius:6px;font-family:ui-monospace,monospace;font-size:13px;white-space:pre-wrap}
.bad{background:#fdecea;border:1px solid #f5a39b}.good{background:#e8f6ec;border:1px solid #8fd19e}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #dde;padding:2px 6px;text-align:right}
th{background:#f3f4f8}td.l{text-align:left}tr.x td{background:#fdecea}tr.nc td,td.nc{color:#777;background:#f1f1f1}
pre{background:#f6f7f9;padding:10px;font-size:12px;overflow-x:auto}
.legend{font-size:12px;color:#555}svg text{font-family:system-ui,sans-serif}
"""


def svg(width, height, body: list[str] | str = "", role: bool = True) -> str:
    """An inline SVG element (every plot of the report is one)."""
    return (
        f'<svg width="{width}" height="{height}"'
        + (' role="img">' if role else ">")
        + (body if isinstance(body, str) else "".join(body))
        + "</svg>"
    )


class LogPlot:
    """The frame of a plot with a log-scale y axis over points 0..n-1 (error vs layer, KL vs
    step): decades spanning the values, coordinates, grid lines, polylines."""

    def __init__(
        self, values: list[float], n: int, width: int, height: int, left: int, top: int, bottom: int, right: int
    ):
        lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
        self.lo, self.hi = lo, max(hi, lo + 1)
        self.n, self.width, self.height = n, width, height
        self.left, self.top, self.bottom, self.right = left, top, bottom, right

    def x(self, i: float) -> float:
        return self.left + (self.width - self.left - self.right) * (i / max(1, self.n - 1))

    def y(self, v: float) -> float:  # values below the lowest decade sit on it
        span = self.height - self.top - self.bottom
        return self.top + span * (self.hi - math.log10(max(v, 10.0**self.lo))) / (self.hi - self.lo)

    def hline(self, v: float, stroke: str, extra: str = "") -> str:
        y = f"{self.y(v):.1f}"
        return f'<line x1="{self.left}" x2="{self.width - self.right}" y1="{y}" y2="{y}" stroke="{stroke}"{extra}'

    def grid(self, stroke: str, label_first: bool = False) -> list[str]:
        """A line and a label "1eN" at each decade."""
        out = []
        every = max(1, math.ceil((self.hi - self.lo) / 10))  # at most ~10 labels: they must not overlap
        for e in range(self.lo, self.hi + 1):
            line = self.hline(10.0**e, stroke) + "/>"
            label = (
                f'<text x="{self.left - 6}" y="{self.y(10.0**e) + 4:.1f}" font-size="10" text-anchor="end">1e{e}</text>'
                if (e - self.lo) % every == 0
                else ""
            )
            out.append(label + line if label_first else line + label)
        return out

    @staticmethod
    def polyline(points: list[tuple[float, float]], color: str, width: str) -> str:
        return (
            f'<polyline fill="none" stroke="{color}" stroke-width="{width}" points="'
            + " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            + '"/>'
        )
