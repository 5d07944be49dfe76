"""docs/upstream/gemma4-global-head-dim.md: three Gemma 4 loaders outside transformers (keras-hub,
mistral.rs, CTranslate2) read the full-attention layers' `global_head_dim`, which transformers 5.24
no longer saves; its repro script's output, as the report shows it. The fix the runtimes apply
(replayer/runtimes/head_fixes.py) is tested with each runtime."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import same_figures

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "docs/upstream/gemma4_global_head_dim_repro.py"
REPORT = "docs/upstream/gemma4-global-head-dim.md"
# the projects the script loads: module -> the label its lines start with
PROJECTS = {"keras_hub": "keras-hub", "mistralrs": "mistral.rs", "ctranslate2": "CTranslate2"}
HAVE = {m: importlib.util.find_spec(m) is not None for m in PROJECTS}


def expected_lines() -> list[str]:
    """The report's quoted output, each project not installed here as its one 'not installed' line."""
    shown = (ROOT / REPORT).read_text().split(f"$ python {SCRIPT}\n")[1].split("\n\n")[0]
    lines, said = [], set()
    for ln in (s[4:] for s in shown.splitlines()):
        missing = [m for m, label in PROJECTS.items() if not HAVE[m] and ln.startswith(label + " ")]
        if not missing:
            lines.append(ln)
        elif missing[0] not in said:
            said.add(missing[0])
            lines.append(f"{PROJECTS[missing[0]]}: not installed")
    return lines


@pytest.mark.slow
@pytest.mark.skipif(not any(HAVE.values()), reason="none of keras-hub, mistralrs, ctranslate2 is installed")
def test_the_global_head_dim_repro_script_still_shows_the_loaders_fail():
    """Fails once an installed project loads the folder transformers 5.24 saves (then the report, the
    runtime's docs page and this test are updated). Figures of float32 rounding may move with the CPU."""
    r = subprocess.run([sys.executable, str(ROOT / SCRIPT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    got, shown = r.stdout.strip().splitlines(), expected_lines()
    assert len(got) == len(shown), (got, shown)
    for real, doc in zip(got[:-1], shown[:-1]):
        assert same_figures(real, doc), (real, doc)
    if all(HAVE.values()):
        assert got[-1] == shown[-1], (got[-1], shown[-1])
    assert got[-1].startswith("BUG: ") and got[-1].endswith(" cannot load the folder as saved"), got[-1]
