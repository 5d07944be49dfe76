"""docs/upstream/onnxruntime-genai-embed-scale.md and onnxruntime-genai-moe-routing.md: onnxruntime-genai
0.18.0's builder writes Gemma's embedding scale rounded to 2 decimals, and builds every
Gemma4ForConditionalGeneration with its MoE builder (whose graph onnxruntime 1.32's CPU kernel refuses);
their repro scripts' output, as the reports show it. Each test fails once the bug is fixed upstream
(then the report and this test are updated)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import same_figures

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HAVE = importlib.util.find_spec("onnxruntime_genai") is not None
needs_genai = pytest.mark.skipif(not HAVE, reason="onnxruntime-genai is not installed")


def _check(script: str, report: str) -> list[str]:
    """Run the script; its exit code 1 and its lines against the report's quoted block."""
    r = subprocess.run([sys.executable, str(ROOT / script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    shown = (ROOT / report).read_text().split(f"$ python {script}\n")[1].split("\n\n")[0]
    shown = [ln[4:] for ln in shown.splitlines()]
    got = r.stdout.strip().splitlines()
    assert len(got) == len(shown), (got, shown)
    for real, doc in zip(got, shown):
        assert same_figures(real, doc), (real, doc)
    return got


@needs_genai
def test_the_embed_scale_repro_script_still_shows_the_rounding():
    """The graph's scale is 5.66 for sqrt(32); the logits are off by ~5e-4 and match transformers to
    float32 rounding once the constant is exact (figures of float32 rounding may move with the CPU)."""
    got = _check(
        "docs/upstream/onnxruntime_genai_embed_scale_repro.py", "docs/upstream/onnxruntime-genai-embed-scale.md"
    )
    assert got[-1] == "BUG: the graph scales the embeddings by a rounded sqrt(hidden_size)"


@needs_genai
def test_the_moe_routing_repro_script_still_shows_the_bugs():
    """Both dense Gemma4ForConditionalGeneration checkpoints fail in make_moe; the MoE one builds and
    onnxruntime's CPU session refuses its geglu activation."""
    got = _check(
        "docs/upstream/onnxruntime_genai_moe_routing_repro.py", "docs/upstream/onnxruntime-genai-moe-routing.md"
    )
    assert got[-1] == (
        "BUG: 2 of 2 dense checkpoints routed to the MoE builder; the MoE graph refused by onnxruntime's CPU kernel"
    )


@needs_genai
def test_the_plugin_replay_diverges_by_the_rounded_scale_only(tmp_path, monkeypatch):
    """docs/examples/onnxruntime_genai_runtime.py on the tiny dense model (hidden 32), 10 prompt tokens
    and 3 new: the logits diverge by the rounded scale's ~5.4e-4 (the report's `trace diff` lines), and
    match at the default tolerances once the graph's constant is sqrt(32)."""
    from tests.support.cli import invoke, ours
    from tests.support.dense_model import PAST, dense_ref

    examples = str(ROOT / "docs/examples")
    monkeypatch.syspath_prepend(examples)
    monkeypatch.setenv("PYTHONPATH", examples)
    model, ref = dense_ref(tmp_path, PAST, new_tokens=3)
    report = (ROOT / "docs/upstream/onnxruntime-genai-embed-scale.md").read_text()
    shown = report.split("## What the tool reports")[1].split("```text\n")[1].split("```")[0].splitlines()
    for factory, expected in (
        ("make", shown),
        ("make_exact_scale", ["match: no divergence over 3 step(s), 1 tensors"]),
    ):
        run = tmp_path / f"{factory}.h5"
        res = invoke("replay", ref, "--model", model, "--runtime", f"onnxruntime_genai_runtime:{factory}", "-o", run)
        assert res.exit_code == 0, res.output
        res = invoke("diff", ref, run)
        got = ours(res.stdout).strip().splitlines()[: len(expected)]
        assert len(got) == len(expected), (got, expected)
        for real, doc in zip(got, expected):
            assert same_figures(real, doc), (real, doc)
