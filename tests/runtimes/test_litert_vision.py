"""`--runtime litert` on image prompts: the vision tower litert-torch 0.10.0 exports for Gemma 4
(vision_encoder.tflite at the processor's patch budget, vision_adapter.tflite for embed_vision), run
by ai-edge-litert, every vision site read from the interpreter's preserved tensors.

The image golden (one image, 24 padding patches of its 280-patch budget) is replayed at its max_seq
(96, the text export every test here shares through the suite's artifact cache); the REF of an image
that fills its budget is recorded here and replayed at the same max_seq. Two upstream bugs are pinned:
the encoder attends to the padding patches (docs/upstream/litert-torch-gemma4-vision-padding.md), and
the adapter's export is sized by the patch width (docs/upstream/litert-torch-gemma4-vision-adapter.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (pip install -e '.[litert]')")
if importlib.util.find_spec("litert_torch") is None:  # not imported here: its TensorFlow costs each worker 4 s
    pytest.skip("litert-torch is not installed (pip install -e '.[litert]')", allow_module_level=True)

from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import export as E  # noqa: E402
from gemma4_trace.replayer.runtimes.litert.spec import LITERT  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error, same_figures  # noqa: E402

pytestmark = pytest.mark.slow  # exports and converts programs; make test-fast skips it

ROOT = Path(__file__).resolve().parents[2]
IMAGE = golden_path("image")  # max_seq 96: the text export shared by every replay here
MAX_SEQ = "96"
WIDE = ROOT / "hf" / "tiny_model" / "example_wide.png"  # 80x56: all 280 patches real


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _vision_sites(path) -> dict:
    """{(kind key, layer): rows} of every vision site a trace holds (prefill step 0)."""
    with TraceReader(path) as t:
        return {(k, layer): t.read(k, layer) for k, layer in t.kinds_present() if k.startswith("vision.")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("litert-vision")
    out = {"golden": d / "golden.h5", "wide_ref": d / "wide_ref.h5", "wide": d / "wide.h5"}
    r = invoke("replay", IMAGE, "--runtime", "litert", "-o", out["golden"])
    assert r.exit_code == 0, r.output
    out["golden:stderr"] = r.stderr
    r = invoke(
        "record", "--prompt", "Describe the image.", "--image", WIDE, "--max-new-tokens", "2", "-o", out["wide_ref"]
    )
    assert r.exit_code == 0, r.output
    r = invoke("replay", out["wide_ref"], "--runtime", "litert", "--max-seq", MAX_SEQ, "-o", out["wide"])
    assert r.exit_code == 0, r.output
    return out


def test_the_image_golden_replays_with_every_vision_site_and_the_diff_finds_the_padding_bug(runs):
    """Every vision site of the capture map is in the trace, on the real patches only; the tower
    matches HF up to the first attention (patch embeddings, layer 0's q, k, v at float rounding), and
    the first divergence is the padding bug: layer 0's attn_out, in the vision tower, at a patch of
    the image that has padding."""
    declared = {(s.key, s.layer) for s in LITERT.sites(8, {"vision": 2}) if s.tower == "vision"}
    ref, run = _vision_sites(IMAGE), _vision_sites(runs["golden"])
    assert set(run) == declared == set(ref)
    for key, rows in ref.items():
        assert run[key].shape == rows.shape, key  # 256 real patches (24 padding dropped), 64 pooled tokens
    for key in (("vision.patch_embeddings", None), ("vision.q", 0), ("vision.k", 0), ("vision.v", 0)):
        assert _rel(ref[key], run[key]) < 1e-6, key
    assert _rel(ref[("vision.pooled", None)], run[("vision.pooled", None)]) > 1e-3  # the padding patches attended
    r = invoke("diff", IMAGE, runs["golden"], "--json")
    assert r.exit_code == 1, r.output
    first = json.loads(r.stdout)["first_divergence"]
    assert (first["tower"], first["kind"], first["layer"], first["step"]) == ("vision", "vision.attn_out", 0, 0)
    assert "vision tower, layer 0, kind attn_out, patch" in first["sentence"]
    # the soft tokens took the image tokens' embeddings: the generated text is REF's
    with TraceReader(IMAGE) as a, TraceReader(runs["golden"]) as b:
        assert list(a.tokens()) == list(b.tokens())
    # the adapter's export sized by the tower (litert-torch's own fails on this model), said on stderr
    assert "vision_adapter.tflite (embed_vision) exported with the tower's hidden size 32" in runs["golden:stderr"]


def test_an_image_without_padding_matches_hf_at_every_vision_site(runs):
    """An image that fills the patch budget (no padding patch): every vision site within float32's
    defaults (the padding bug is the only difference of the padded image)."""
    ref, run = _vision_sites(runs["wide_ref"]), _vision_sites(runs["wide"])
    assert set(ref) == set(run) and len(ref) == 15
    worst = max(_rel(ref[k], run[k]) for k in ref)
    assert worst < 1e-5, worst


def test_the_padding_repro_script_still_shows_the_bug():
    """Pinned: docs/upstream/litert_torch_vision_padding_repro.py (litert-torch's exported module in
    PyTorch against transformers' tower) prints the write-up's lines and exits 1. When it exits 0,
    the bug is fixed upstream: update docs/upstream/litert-torch-gemma4-vision-padding.md, the LiteRT
    docs and the tests above."""
    script = ROOT / "docs" / "upstream" / "litert_torch_vision_padding_repro.py"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 1, p.stderr[-2000:]
    doc = (ROOT / "docs" / "upstream" / "litert-torch-gemma4-vision-padding.md").read_text().splitlines()
    start = doc.index("    $ python docs/upstream/litert_torch_vision_padding_repro.py") + 1
    # the script's own lines end its stdout (litert-torch's import prints its own before them); a float32
    # rounding figure (under 1e-6) differs from one CPU to another: it is checked as that
    for real, shown in zip(p.stdout.splitlines()[-3:], [ln.strip() for ln in doc[start : start + 3]], strict=True):
        assert same_figures(real, shown), (real, shown)


def test_the_adapter_repro_script_still_shows_the_patch_width():
    """Pinned: docs/upstream/litert_torch_vision_adapter_repro.py (the adapter module run on the
    sample its own get_sample_inputs gives) exits 1 with the write-up's lines. When it exits 0, the
    export sizes the adapter right: export.py can stop passing the size itself (and stop saying so)."""
    script = ROOT / "docs" / "upstream" / "litert_torch_vision_adapter_repro.py"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 1, p.stderr[-2000:]
    doc = (ROOT / "docs" / "upstream" / "litert-torch-gemma4-vision-adapter.md").read_text().splitlines()
    start = doc.index("    $ python docs/upstream/litert_torch_vision_adapter_repro.py") + 1
    assert p.stdout.splitlines()[-2:] == [ln.strip() for ln in doc[start : start + 2]], p.stdout


def test_a_vision_export_failure_is_one_line_and_writes_nothing(runs, tmp_path, monkeypatch):
    """The vision export fails (here: its child cannot import its module): one line, exit 2, no
    trace (the text export is the cache's)."""
    key = E.vision_key
    monkeypatch.setattr(E, "vision_key", lambda loaded, soft: {**key(loaded, soft), "test": str(tmp_path)})
    monkeypatch.setattr(E, "__name__", "gemma4_trace.no_such_module")
    out = tmp_path / "run.h5"
    r = invoke("replay", IMAGE, "--runtime", "litert", "-o", out)
    # one_line_error's contract, the cache's announcement of the build ("exporting ...") aside
    r.stderr_bytes = b"".join(
        ln for ln in r.stderr_bytes.splitlines(keepends=True) if not ln.startswith(b"exporting tiny-gemma4")
    )
    one_line_error(r, "litert-torch's Gemma 4 vision encoder export failed", "No module named", out=out)
