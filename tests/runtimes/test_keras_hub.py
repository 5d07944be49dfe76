"""`--runtime keras-hub`: keras-hub's own converter and Gemma 4 layers (JAX, CPU) on the embedded
tiny model. The short golden replays teacher-forced with every kind it captures and free-running
with `--kinds`, both matching HF at the default tolerances (one conversion, shared through the
artifact cache); the image golden's vision tower matches HF and its first divergence is keras-hub's
cached mask (an upstream bug). Refusals: an audio REF and a missing package, before the model loads;
a checkpoint keras-hub's converter rejects (5.24's folder without the fix) and a crash in the child
are one line, exit 2, nothing written."""

from __future__ import annotations

import importlib.util
import json

import pytest

from gemma4_trace.recorder.golden import golden_path
from tests.support.cli import invoke, one_line_error, without_progress

HAVE = all(importlib.util.find_spec(m) is not None for m in ("keras_hub", "keras", "jax"))
needs_keras = pytest.mark.skipif(not HAVE, reason="keras-hub is not installed (pip install -e '.[keras]')")
SHORT = golden_path("short")
FIX = "global_head_dim set to 32 (from per_layer_config)"
REJECTED = "ValueError: cannot reshape array of size 8192 into shape (4,16,64)"
LABEL = "keras-hub (keras-hub 0.32.0, keras 3.15.1, jax 0.10.2)"


def _no_model_load(*a, **k):
    raise AssertionError("the model was loaded before the refusal")


def test_an_audio_ref_and_a_missing_package_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", _no_model_load)
    out = tmp_path / "run.h5"
    if HAVE:
        r = invoke("replay", golden_path("audio"), "--runtime", "keras-hub", "-o", out)
        one_line_error(r, "--runtime keras-hub runs no audio tower", out=out)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "keras_hub" else real(n, *a))
    r = invoke("replay", SHORT, "--runtime", "keras-hub", "-o", out)
    one_line_error(r, "--runtime keras-hub needs keras_hub, which is not installed", "[keras]", out=out)


# ---------------------------------------------------------------- real runs (slow)
@pytest.mark.slow
@needs_keras
def test_teacher_forced_and_free_running_replays_match_hf(tmp_path):
    out = tmp_path / "tf.h5"
    r = invoke("replay", SHORT, "--runtime", "keras-hub", "-o", out)
    assert r.exit_code == 0, r.output
    assert f"{LABEL[:-1]}, CPU, float32; converted by keras-hub's converter; config fixed in a copy: {FIX})" in r.stdout
    d = invoke("diff", SHORT, out, "--json")
    assert d.exit_code == 0, d.output
    report = json.loads(d.stdout)
    assert report["match"] and report["tokens"]["accuracy"] == 1.0
    kinds = {t["kind"] for t in report["tensors"]}
    assert kinds == {"embeddings", "per_layer_inputs", "mask", "q", "k", "v", "attn_out", "layer_out"} | {
        "final_hidden",
        "logits",
    }, kinds
    assert len(report["tensors"]) == 46  # K/V in the 5 layers that own them
    worst = max(t["max_rel_l2"] for t in report["tensors"] if t["kind"] == "layer_out")
    assert worst < 1e-5, worst  # float32 rounding: measured 6.9e-7

    out = tmp_path / "free.h5"
    r = invoke("replay", SHORT, "--runtime", "keras-hub", "--free-running", "--kinds", "q,mask", "-o", out)
    assert r.exit_code == 0, r.output
    assert "converting" not in r.stderr  # the conversion came from the artifact cache
    d = invoke("diff", SHORT, out, "--json")
    assert d.exit_code == 0, d.output
    assert {t["kind"] for t in json.loads(d.stdout)["tensors"]} == {"q", "mask", "logits"}


@pytest.mark.slow
@needs_keras
def test_a_rejected_checkpoint_and_a_crash_are_one_line_and_leave_no_trace(tmp_path, monkeypatch):
    """Without the fix, keras-hub's converter reads the full layers' q_proj with the sliding head_dim."""
    monkeypatch.setattr("gemma4_trace.replayer.runtimes.keras_hub._SAID", set())
    monkeypatch.setattr("gemma4_trace.replayer.runtimes.head_fixes.config_fixes", lambda config, runtime: {})
    out = tmp_path / "run.h5"
    r = invoke("replay", SHORT, "--runtime", "keras-hub", "--no-cache", "-o", out)
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
    lines = without_progress(r.stderr.splitlines())
    assert lines[0].startswith("converting tiny-gemma4 (embedded) with keras-hub's converter"), lines
    assert lines[1:] == [f"error: {LABEL} failed in converting: {REJECTED}"], lines
    monkeypatch.undo()
    r = invoke("replay", SHORT, "--runtime", "keras-hub", "-o", out, env={"GEMMA4_TRACE_TEST_NATIVE_CRASH": "prefill"})
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
    last = without_progress(r.stderr.splitlines())[-1]
    assert last == f"error: {LABEL} crashed in prefill before reporting anything: killed by SIGSEGV", last


@pytest.mark.slow
@needs_keras
def test_an_image_prompt_diverges_at_keras_hubs_cached_mask(tmp_path):
    """keras-hub's vision encoder matches HF's, and its cached prefill never ORs in Gemma 4's
    within-image bidirectional attention: the first image row's sliding mask blocks the image's
    later keys (docs/runtime-keras-hub.md, "Upstream findings"). The full layers' masks match."""
    ref, out = golden_path("image"), tmp_path / "image.h5"
    r = invoke("replay", ref, "--runtime", "keras-hub", "-o", out)
    assert r.exit_code == 0 and "11/11 tokens agree" in r.stdout, r.output
    d = invoke("diff", ref, out)
    assert d.exit_code == 1, d.output
    first = d.stdout.splitlines()[0]
    assert first.startswith("first divergence: prefill step 0, layer 0 (sliding_attention), kind mask, position 4: "), (
        first
    )
    assert "keys 4-67 = image 1 (the query's own)" in first, first
    assert "looks like: image attended causally (no bidirectional attention within an image)" in d.stdout, d.stdout
    d = invoke("diff", ref, out, "--full", "--json")
    tensors = {(t["kind"], t["layer"]): t for t in json.loads(d.stdout)["tensors"]}
    vision = [t for (kind, _), t in tensors.items() if kind.startswith("vision.")]
    assert len(vision) == 14 and max(t["max_rel_l2"] for t in vision) < 1e-5, vision  # measured 2.2e-7
    assert tensors["mask", 2]["mismatched_rows"] == 0 and tensors["mask", 0]["mismatched_rows"] == 63


@pytest.mark.slow
@needs_keras
def test_the_cached_vision_mask_repro_script_still_shows_the_bug():
    """docs/upstream/keras-hub-cached-vision-mask.md: its script's output, as the report shows it
    (figures of float32 rounding may move with the CPU; about 30 s, most of it importing keras-hub).
    Fails once keras-hub's cached prefill keeps the within-image bidirectional mask or its uncached
    sliding mask keeps the window over an image (then the report, docs/runtime-keras-hub.md and this
    test are updated)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.cli import same_figures

    root = Path(__file__).resolve().parents[2]
    script = root / "docs/upstream/keras_hub_cached_vision_mask_repro.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    report = (root / "docs/upstream/keras-hub-cached-vision-mask.md").read_text()
    shown = report.split("$ python docs/upstream/keras_hub_cached_vision_mask_repro.py\n")[1].split("\n\n")[0]
    shown = [ln[4:] for ln in shown.splitlines()]
    got = r.stdout.strip().splitlines()
    assert len(got) == len(shown), (got, shown)
    for real, doc in zip(got, shown):
        assert same_figures(real, doc), (real, doc)
    assert "   BUG: the cached path (the prefill) drops the within-image bidirectional mask" in got
    assert got[-1].startswith("   BUG: the uncached sliding mask is (causal AND window) OR image"), got[-1]


@pytest.mark.slow
@needs_keras
def test_the_vision_pooling_repro_script_still_shows_the_bug():
    """docs/upstream/keras-hub-vision-pooling-batch.md: its script's output, as the report shows it
    (figures of float32 rounding may move with the CPU; about 20 s, most of it importing keras-hub).
    Fails once keras-hub's Gemma4VisionAveragePooling takes each image's own grid width (then the
    report, docs/runtime-keras-hub.md and this test are updated)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.cli import same_figures

    root = Path(__file__).resolve().parents[2]
    script = root / "docs/upstream/keras_hub_vision_pooling_batch_repro.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    report = (root / "docs/upstream/keras-hub-vision-pooling-batch.md").read_text()
    shown = report.split("$ python docs/upstream/keras_hub_vision_pooling_batch_repro.py\n")[1].split("\n\n")[0]
    shown = [ln[4:] for ln in shown.splitlines()]
    got = r.stdout.strip().splitlines()
    assert len(got) == len(shown), (got, shown)
    for real, doc in zip(got, shown):
        assert same_figures(real, doc), (real, doc)
    assert got[-1] == "BUG: an image pools on the widest image's grid when batched", got[-1]
