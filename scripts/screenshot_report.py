"""Screenshots of `trace diff --report` in a real browser (headless Chromium), to look at.

    python scripts/screenshot_report.py OUT_DIR [--chromium chromium]

On the embedded tiny model (CPU, a few minutes): records ref.h5, replays an int8 BASE
(`static-w8`), an int8 RUN with a planted bug (tests/support/quant_bugs.py: the per-layer inputs of the
first decode step reused by every later step) and a float RUN with a planted bug
(tests/support/bug_zoo.py: decode attends to one key too few), writes three reports and their PNGs:

    quant.html / quant.png                  the int8 RUN against the float tolerances
    quant-baseline.html / quant-baseline.png  the same with --baseline base.h5 (the second map)
    float-bug.html / float-bug.png          the float bug

Traces already in OUT_DIR are reused. Needs torchao (the quantized runtimes) and a Chromium
(Debian: `apt-get install chromium`; tests/support/browser.py finds it, takes the pictures and
prints what the browser test would refuse). Run from the repository root (the bug runtimes are
imported from tests/).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.browser import WIDTH, find_chromium, layout_problems, screenshot  # noqa: E402

QUANT_BUG = "tests.support.quant_bugs:make_stale_ple_in_decode__static_w8"
FLOAT_BUG = "tests.support.bug_zoo:make_decode_slice_short"


def trace(*args: str) -> int:
    """Run `trace ARGS` in this checkout; the exit code (diff: 1 = divergence)."""
    r = subprocess.run([sys.executable, "-m", "gemma4_trace", *args], cwd=ROOT)
    if r.returncode not in (0, 1):
        sys.exit(f"trace {' '.join(args)} failed with exit {r.returncode}")
    return r.returncode


def once(path: Path, *args: str) -> Path:
    if not path.exists():
        trace(*args, "-o", str(path))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--chromium", default=find_chromium())
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("no Chromium found: apt-get install chromium, or pass --chromium PATH")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ref = once(out / "ref.h5", "record")
    base = once(out / "base.h5", "replay", str(ref), "--runtime", "static-w8")
    run_q = once(out / "run-quant-bug.h5", "replay", str(ref), "--runtime", QUANT_BUG)
    run_f = once(out / "run-float-bug.h5", "replay", str(ref), "--runtime", FLOAT_BUG)
    for name, run, extra in (
        ("quant", run_q, []),
        ("quant-baseline", run_q, ["--baseline", str(base)]),
        ("float-bug", run_f, []),
    ):
        page = out / f"{name}.html"
        trace("diff", str(ref), str(run), *extra, "--report", str(page), "--force")
        screenshot(page, out / f"{name}.png", args.chromium)
        print(f"wrote {out / name}.png")
        for problem in layout_problems(page, args.chromium):  # what tests/test_browser.py refuses
            print(f"  {name}.html at {WIDTH} px: {problem}")


if __name__ == "__main__":
    main()
