"""`--runtime mistralrs`: mistral.rs 0.9.5's own Gemma 4 on the embedded model (PLE, KV sharing),
tokens only: its greedy tokens are HF's once the config's global head fields are written back in a
temporary copy of the checkpoint (never in REF's folder). Refusals: an image or audio REF and a
missing package before the model loads; a checkpoint mistral.rs rejects and a crash inside it are
one line with no trace."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.traces.errors import TraceToolError
from tests.support.cli import invoke, one_line_error, without_progress

HAVE = importlib.util.find_spec("mistralrs") is not None
needs_mistralrs = pytest.mark.skipif(not HAVE, reason="mistralrs is not installed (pip install -e '.[mistralrs]')")
RT = "gemma4_trace.replayer.runtimes.mistralrs"
FIX = "global_head_dim set to 32 (from per_layer_config)"  # the embedded model's full layers


def _no_model_load(*a, **k):
    raise AssertionError("the model was loaded before the refusal")


@pytest.fixture
def fresh(monkeypatch):
    """As in a process of its own: the fix is said."""
    monkeypatch.setattr(f"{RT}._SAID", set())


# ---------------------------------------------------------------- refusals and the config fix (fast)
def test_an_image_or_audio_ref_and_a_missing_package_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", _no_model_load)
    out = tmp_path / "run.h5"
    if HAVE:
        r = invoke("replay", golden_path("image"), "--runtime", "mistralrs", "-o", out)
        one_line_error(r, "--runtime mistralrs runs a text decoder, which takes token ids only", out=out)
        r = invoke("replay", golden_path("audio"), "--runtime", "mistralrs", "-o", out)
        one_line_error(r, "--runtime mistralrs runs no audio tower (it captures tokens only)", out=out)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mistralrs" else real(n, *a))
    r = invoke("replay", golden_path("short"), "--runtime", "mistralrs", "-o", out)
    one_line_error(r, "--runtime mistralrs needs mistralrs, which is not installed", "[mistralrs]", out=out)


def test_the_fixed_copy_holds_the_global_fields_and_leaves_refs_folder_alone():
    from gemma4_trace.hf.model import embedded_model_dir
    from gemma4_trace.replayer.runtimes import head_fixes
    from gemma4_trace.replayer.runtimes.mistralrs import fixed_copy

    model_dir = embedded_model_dir()
    before = (model_dir / "config.json").read_bytes()
    config = json.loads(before)
    fixes = head_fixes.config_fixes(config, "mistralrs")
    assert fixes == {"global_head_dim": 32} and head_fixes.fixes_words(fixes) == [FIX]
    folder = fixed_copy(model_dir, fixes)
    try:
        assert json.loads((folder / "config.json").read_text())["text_config"]["global_head_dim"] == 32
        linked = sorted(p.name for p in folder.iterdir() if p.is_symlink())
        assert linked == sorted(p.name for p in model_dir.iterdir() if p.name != "config.json")
        assert (folder / "model.safetensors").resolve() == (model_dir / "model.safetensors").resolve()
    finally:
        import shutil

        shutil.rmtree(folder)
    assert (model_dir / "config.json").read_bytes() == before
    per_layer = {"2": {"head_dim": 32}, "4": {"head_dim": 64}}
    with pytest.raises(TraceToolError, match="--runtime mistralrs: the full-attention layers have different head_dims"):
        head_fixes.config_fixes({**config["text_config"], "per_layer_config": per_layer}, "mistralrs")


# ---------------------------------------------------------------- real runs (slow)
@pytest.mark.slow
@needs_mistralrs
@pytest.mark.parametrize("mode", ["teacher-forced", "free-running"])
def test_the_embedded_model_gives_hfs_tokens_and_the_diff_compares_them_alone(mode, tmp_path, fresh):
    out = tmp_path / "run.h5"
    flag = ("--free-running",) if mode == "free-running" else ()
    copies = lambda: set(Path(tempfile.gettempdir()).glob("gemma4-trace-mistralrs-*"))  # noqa: E731
    before = copies()
    r = invoke("replay", golden_path("short"), "--runtime", "mistralrs", *flag, "-o", out)
    assert r.exit_code == 0, r.output
    assert copies() <= before  # the checkpoint's fixed copy is gone
    agree = "3/3 tokens agree with the reference" if mode == "teacher-forced" else "same tokens as the reference"
    assert (
        f"mistralrs (mistral.rs 0.9.5, CPU, float32, f32 KV cache, greedy; config fixed in a copy: {FIX};" in r.stdout
    )
    assert f"runtime, {mode}, 3 steps, max_seq 16, {agree}" in r.stdout, r.stdout
    said = without_progress(r.stderr.splitlines())
    assert said[0] == f"mistralrs: the config mistral.rs reads, fixed in a temporary copy: {FIX}", said
    logprobs = said[-1].split("step by step: ")[1].split(", ")
    assert said[-1].startswith("mistralrs: its chosen tokens' log-probabilities") and len(logprobs) == 3, said
    assert all(-0.01 < float(v) < 0 for v in logprobs), said  # HF's: -0.0025247, -0.0029854, -0.0027418
    d = invoke("diff", golden_path("short"), out)
    assert d.exit_code == 0, d.output
    lines = d.stdout.splitlines()
    assert lines[:2] == [
        "match: no divergence over 3 step(s), 0 tensors",
        "tokens: 3/3 generated tokens match (100.0%)",
    ]
    assert "note: tensors in only one trace (not compared): embeddings (only in REF)" in d.stdout
    report = json.loads(invoke("diff", golden_path("short"), out, "--json").stdout)
    assert report["match"] and report["tokens"]["accuracy"] == 1.0 and report["tensors"] == []


@pytest.mark.slow
@needs_mistralrs
def test_a_checkpoint_mistralrs_rejects_and_a_crash_are_one_line_and_leave_no_trace(tmp_path, monkeypatch):
    """Without the fix mistral.rs takes its default full-attention head dim and refuses the weights:
    the reason the copy is made (docs/runtime-mistralrs.md, "Upstream findings")."""
    monkeypatch.setattr(f"{RT}.head_fixes.config_fixes", lambda config, runtime: {})
    out = tmp_path / "run.h5"
    r = invoke("replay", golden_path("short"), "--runtime", "mistralrs", "-o", out)
    one_line_error(
        r,
        "error: mistralrs (mistral.rs 0.9.5) failed in loading: mistral.rs cannot load the checkpoint (shape "
        "mismatch for model.language_model.layers.2.self_attn.q_proj.weight, expected: [2048, 64], got: [128, 64])",
        out=out,
    )
    monkeypatch.undo()
    r = invoke(
        "replay", golden_path("short"), "--runtime", "mistralrs", "-o", out,
        env={"GEMMA4_TRACE_TEST_NATIVE_CRASH": "prefill"},
    )  # fmt: skip
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
    lines = without_progress(r.stderr.splitlines())
    assert lines[-1] == "error: mistralrs (mistral.rs 0.9.5) crashed in prefill: killed by SIGSEGV", lines
