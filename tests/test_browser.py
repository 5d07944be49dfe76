"""Every HTML page the tool writes, opened in a real browser (headless Chromium) at 1400 px: nothing
wider than the window or hidden behind a horizontal scroll, no text of a picture cut off or on top of
other text, RUN's line drawn over BASE's (tests/support/browser.py measures the laid-out page).

The pages come from real runs on the embedded model: a divergent diff, the same against a --baseline,
an image prompt's (the vision tower's rows), a long trace's (many columns), a sweep with a baseline
runtime (its summary and each prompt's page) and a sensitivity ranking. Without a Chromium the tests
skip and the run's summary says so in one line (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from gemma4_trace.hf.model import embedded_model_dir
from gemma4_trace.recorder.golden import GOLDEN_DIR
from tests.support.browser import find_chromium, layout_problems
from tests.support.cli import invoke

pytestmark = [
    pytest.mark.slow,  # replays, a sweep and a sensitivity ranking, then a browser per page
    pytest.mark.skipif(find_chromium() is None, reason="no Chromium (apt-get install chromium, or set CHROMIUM)"),
]


def _ok(*args) -> None:
    r = invoke(*args)
    assert r.exit_code in (0, 1), (args, r.output)


def _pages(d) -> list:
    g = {name: GOLDEN_DIR / f"{name}.h5" for name in ("short", "image", "window")}
    _ok("replay", g["short"], "--runtime", "static-w8", "-o", d / "w8.h5")
    _ok("replay", g["short"], "--runtime", "static-w4g32", "-o", d / "w4.h5")
    _ok("replay", g["image"], "-o", d / "image.h5")
    _ok("replay", g["window"], "--runtime", "static-w8", "-o", d / "window.h5")
    _ok("diff", g["short"], d / "w8.h5", "--report", d / "quantized.html")
    _ok("diff", g["short"], d / "w4.h5", "--baseline", d / "w8.h5", "--report", d / "baseline.html")
    _ok("diff", g["image"], d / "image.h5", "--report", d / "image.html")
    _ok("diff", g["window"], d / "window.h5", "--report", d / "window.html")
    (d / "weak.toml").write_text('runtime = "static-w8"\n\n[units]\n"layer.3" = "static-w4g32"\n')
    _ok("sensitivity", g["short"], "--runtime", "static-w8", "--recipe", d / "weak.toml", "--report", d / "s.html")
    shipped = [json.loads(line) for line in (embedded_model_dir() / "sweep_prompts.jsonl").read_text().splitlines()]
    prompts = [p for p in shipped if p["id"] in ("short-00", "image-00")]
    for p in prompts:
        if "image" in p:
            shutil.copyfile(embedded_model_dir() / p["image"], d / p["image"])
    (d / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    _ok("sweep", d / "prompts.jsonl", "--runtime", "static-w4g32", "--baseline-runtime", "static-w8",
        "--max-new-tokens", "4", "-o", d / "sweep")  # fmt: skip
    pages = sorted(d.glob("*.html")) + [d / "sweep" / "summary.html", *sorted((d / "sweep" / "prompts").glob("*.html"))]
    assert len(pages) == 8, pages
    return pages


def test_every_page_fits_a_1400px_window_with_nothing_hidden_or_overlapping(tmp_path):
    chromium = find_chromium()
    problems = {p.relative_to(tmp_path).as_posix(): layout_problems(p, chromium) for p in _pages(tmp_path)}
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}


def test_the_measurement_sees_each_kind_of_problem(tmp_path):
    """The check can fail: a page with one of each problem gets one sentence for each."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!DOCTYPE html><html><body>"
        '<div style="width:1600px">wide</div>'
        '<div style="width:200px;overflow-x:auto"><div style="width:500px">scrolled</div></div>'
        '<svg width="200" height="60"><text x="10" y="20">1e-1</text><text x="14" y="22">1 = tolerance</text>'
        '<text x="190" y="50">cut off at the edge</text>'
        '<g data-series="run"><polyline points="0,0 10,10"/></g><g data-series="base"><polyline points="0,0 9,9"/></g>'
        "</svg></body></html>"
    )
    found = layout_problems(page, find_chromium())
    assert any(f.startswith("the page is ") and "wide in a 1400 px window" in f for f in found), found
    assert any("hides 300 of its 500 px (overflow-x: auto)" in f for f in found), found
    assert any('"1e-1" overlaps "1 = tolerance"' in f for f in found), found
    assert any('"cut off at the edge" is cut off' in f for f in found), found
    assert any("BASE's line is drawn over RUN's" in f for f in found), found
