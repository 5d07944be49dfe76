"""A real browser (headless Chromium) for the HTML pages the tool writes: what a person sees.

`layout_problems(page)` opens a copy of the page at 1400 px with a script added that measures the
laid-out page and returns each problem as one sentence: the page wider than the window, a box
hiding part of its content behind a horizontal scroll (or cutting it off), a picture's text outside
the picture or overlapping other text, a line drawn under the grey baseline it should be drawn over
(`data-series="run"` after `data-series="base"`). `screenshot(page, png)` takes the picture
(scripts/screenshot_report.py). Chromium is found on PATH (Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

WIDTH = 1400
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]
NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")

# the measurement, run after the page laid out; its result lands in <body data-layout="...">
MEASURE = r"""
<script>
(() => {
  const out = [], W = window.innerWidth;
  const name = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
    (el.className && typeof el.className === 'string' ? '.' + el.className.trim().split(/\s+/).join('.') : '');
  const said = t => JSON.stringify(t.textContent.trim().slice(0, 40));
  const doc = document.documentElement;
  if (doc.scrollWidth > W + 1) out.push(`the page is ${doc.scrollWidth} px wide in a ${W} px window`);
  for (const el of document.body.querySelectorAll('*')) {
    const ox = getComputedStyle(el).overflowX;
    if (ox !== 'visible' && el.scrollWidth > el.clientWidth + 1)
      out.push(`${name(el)} hides ${el.scrollWidth - el.clientWidth} of its ${el.scrollWidth} px (overflow-x: ${ox})`);
  }
  const overlap = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1 &&
                            Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
  document.querySelectorAll('svg').forEach((svg, k) => {
    const box = svg.getBoundingClientRect();
    const texts = [...svg.querySelectorAll('text')].map(t => [t, t.getBoundingClientRect()])
      .filter(([t, r]) => r.width > 0 && t.textContent.trim());
    for (const [t, r] of texts)
      if (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1 || r.bottom > box.bottom + 1)
        out.push(`picture ${k + 1}: text ${said(t)} is cut off at the picture's edge`);
    for (let i = 0; i < texts.length; i++)
      for (let j = i + 1; j < texts.length; j++)
        if (overlap(texts[i][1], texts[j][1]))
          out.push(`picture ${k + 1}: text ${said(texts[i][0])} overlaps ${said(texts[j][0])}`);
    const series = [...svg.querySelectorAll('[data-series]')].map(e => e.dataset.series);
    if (series.includes('run') && series.lastIndexOf('base') > series.lastIndexOf('run'))
      out.push(`picture ${k + 1}: BASE's line is drawn over RUN's`);
  });
  document.body.dataset.layout = JSON.stringify(out);
})();
</script>
"""


def find_chromium() -> str | None:
    """The headless browser's path: $CHROMIUM, else the first of NAMES on PATH."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((p for p in map(shutil.which, NAMES) if p), None)


def _run(chromium: str, args: list[str], timeout: float = 120) -> str:
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run(
            [chromium, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return r.stdout


def layout_problems(page: Path, chromium: str, width: int = WIDTH) -> list[str]:
    """What is wrong with page as a person sees it in a window width px wide (empty: nothing)."""
    text = Path(page).read_text()
    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "page.html"
        probe.write_text(text.replace("</body>", MEASURE + "</body>") if "</body>" in text else text + MEASURE)
        dom = _run(chromium, [f"--window-size={width},900", "--dump-dom", probe.as_uri()])
    found = re.search(r'data-layout="([^"]*)"', dom)
    assert found, f"the measurement did not run in {chromium} on {page}"
    return json.loads(html.unescape(found.group(1)))


def screenshot(page: Path, png: Path, chromium: str, size: str = f"{WIDTH},1800") -> None:
    """page as a PNG at size (width,height) px."""
    _run(chromium, [f"--window-size={size}", f"--screenshot={Path(png).resolve()}", Path(page).resolve().as_uri()])
