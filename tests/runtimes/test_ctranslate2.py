"""`--runtime ctranslate2`: CTranslate2's converter and C++ engine on a tiny dense Gemma 4
(tests/support/dense_model.py: the 31B's shape, sliding window 4), logits only. A prompt whose every
step stays within the window matches HF at the default tolerances; a 10-token prompt diverges at the
prefill's logits (CTranslate2's prompt pass ignores the window: docs/upstream/ctranslate2-sliding-
window-prompt.md, whose repro script is pinned here). Refusals: a checkpoint with KV sharing, PLE or
MoE, an image or audio REF, a missing package, all before the model loads; an engine crash is one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.runtimes import registry as R
from gemma4_trace.traces.errors import TraceToolError
from tests.support.cli import invoke, one_line_error, same_figures, without_progress
from tests.support.dense_model import PAST, build_dense, dense_ref

ROOT = Path(__file__).resolve().parents[2]
HAVE = importlib.util.find_spec("ctranslate2") is not None
needs_ct2 = pytest.mark.skipif(not HAVE, reason="ctranslate2 is not installed (pip install -e '.[ctranslate2]')")
DENSE_WORDS = "--runtime ctranslate2 runs dense Gemma 4 text decoders only: this checkpoint has"


def _no_model_load(*a, **k):
    raise AssertionError("the model was loaded before the refusal")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense model, a REF within its window (3 prompt tokens, 2 new: no prefix past 4 tokens) and
    one past it (10 prompt tokens, 3 new)."""
    folder = tmp_path_factory.mktemp("ct2")
    model, within = dense_ref(folder, "2,17,33", new_tokens=2)
    _, past = dense_ref(folder, PAST, new_tokens=3, model=model)
    return model, within, past


# ---------------------------------------------------------------- refusals (before the model loads)
@needs_ct2
def test_a_checkpoint_with_kv_sharing_and_ple_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", _no_model_load)
    out = tmp_path / "run.h5"
    r = invoke("replay", golden_path("short"), "--runtime", "ctranslate2", "-o", out)
    one_line_error(
        r,
        DENSE_WORDS,
        "KV sharing (num_kv_shared_layers 3) and per-layer inputs (PLE: hidden_size_per_layer_input 8)",
        out=out,
    )


def test_the_decoders_facet_names_what_a_config_has():
    choice = R.parse_runtime("ctranslate2")
    R.check_inputs(choice, config={"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0})  # dense
    R.check_inputs(choice)  # no config known: nothing to refuse yet
    moe = {"text_config": {"enable_moe_block": True, "num_experts": 128, "hidden_size_per_layer_input": 0}}
    with pytest.raises(TraceToolError) as e:
        R.check_inputs(choice, config=moe)
    assert str(e.value) == f"{DENSE_WORDS} MoE blocks (enable_moe_block, 128 experts)"
    R.check_inputs(R.parse_runtime("static"), config=moe)  # a row without the facet runs every decoder


def test_an_image_or_audio_ref_and_a_missing_package_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", _no_model_load)
    out = tmp_path / "run.h5"
    if HAVE:
        r = invoke("replay", golden_path("image"), "--runtime", "ctranslate2", "-o", out)
        one_line_error(r, "--runtime ctranslate2 runs a text decoder, which takes token ids only", out=out)
        r = invoke("replay", golden_path("audio"), "--runtime", "ctranslate2", "-o", out)
        one_line_error(r, "--runtime ctranslate2 runs no audio tower (it captures logits only)", out=out)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ctranslate2" else real(n, *a))
    r = invoke("replay", golden_path("short"), "--runtime", "ctranslate2", "-o", out)
    one_line_error(r, "--runtime ctranslate2 needs ctranslate2, which is not installed", "[ctranslate2]", out=out)


def test_the_config_fixes_come_from_the_full_layers_per_layer_values():
    from gemma4_trace.replayer.runtimes.ctranslate2 import config_fixes

    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    per_layer = {"1": {"head_dim": 16, "num_key_value_heads": 1}, "3": {"head_dim": 16, "num_key_value_heads": 1}}
    cfg = {"layer_types": types, "per_layer_config": per_layer}
    assert config_fixes(cfg) == {"global_head_dim": 16, "num_global_key_value_heads": 1}
    assert config_fixes({"text_config": {**cfg, "per_layer_config": {"1": {"head_dim": 16}}}}) == {
        "global_head_dim": 16
    }
    with pytest.raises(TraceToolError, match="different head_dims"):
        config_fixes({**cfg, "per_layer_config": {"1": {"head_dim": 16}, "3": {"head_dim": 32}}})


# ---------------------------------------------------------------- real runs (slow)
@pytest.mark.slow
@needs_ct2
def test_a_prompt_within_the_window_matches_hf(dense, tmp_path):
    model, within, _ = dense
    out = tmp_path / "run.h5"
    r = invoke("replay", within, "--model", model, "--runtime", "ctranslate2", "-o", out)
    assert r.exit_code == 0, r.output
    assert "ctranslate2 (ctranslate2 4.8.5, CPU, float32;" in r.stdout and "2/2 tokens agree" in r.stdout
    assert "global_head_dim set to 16 (from per_layer_config)" in r.stdout, r.stdout
    d = invoke("diff", within, out, "--json")
    assert d.exit_code == 0, d.output
    report = json.loads(d.stdout)
    assert report["match"] and report["tokens"]["accuracy"] == 1.0
    (logits,) = report["tensors"]  # the one tensor both traces hold
    assert logits["kind"] == "logits" and logits["rows_compared"] == 2, logits
    assert logits["max_rel_l2"] < 1e-5, logits  # float32 rounding: measured 3.2e-7


@pytest.mark.slow
@needs_ct2
def test_a_prompt_past_the_window_diverges_at_the_prefills_logits(dense, tmp_path):
    model, _, past = dense
    for mode in ((), ("--free-running",)):
        out = tmp_path / f"run{len(mode)}.h5"
        r = invoke("replay", past, "--model", model, "--runtime", "ctranslate2", *mode, "-o", out)
        assert r.exit_code == 0, r.output
        d = invoke("diff", past, out)
        assert d.exit_code == 1, d.output
        first = d.stdout.splitlines()[0]
        assert first.startswith("first divergence: prefill step 0, kind logits, position 9, token id 1: rel-L2 "), first
        assert float(first.split("rel-L2 ")[1].split()[0]) > 0.1, first
        assert "origin: unknown (final_hidden not compared)" in d.stdout
        assert "tensors in only one trace (not compared): embeddings (only in REF)" in d.stdout
    assert "first mismatch at prefill step 0: REF 94 vs RUN 100" in d.stdout or "tokens differ" in r.stdout


@pytest.mark.slow
@needs_ct2
def test_a_crash_in_ctranslate2_is_one_line_and_leaves_no_trace(dense, tmp_path, monkeypatch):
    monkeypatch.setattr("gemma4_trace.replayer.runtimes.ctranslate2._SAID", set())  # as in a process of its own
    model, within, _ = dense
    out = tmp_path / "crash.h5"
    r = invoke(
        "replay", within, "--model", model, "--runtime", "ctranslate2", "-o", out,
        env={"GEMMA4_TRACE_TEST_NATIVE_CRASH": "prefill"},
    )  # fmt: skip
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
    lines = [ln for ln in without_progress(r.stderr.splitlines()) if not ln.startswith("converting ")]
    assert lines[0].startswith("ctranslate2: the config CTranslate2's converter reads, fixed: "), lines
    assert lines[-1] == "error: ctranslate2 (ctranslate2 4.8.5) crashed in prefill: killed by SIGSEGV", lines


@pytest.mark.slow
@needs_ct2
def test_the_converter_converts_ple_and_moe_checkpoints_without_them(tmp_path):
    """Why the row refuses them itself: CTranslate2 4.8.5's Gemma4Loader refuses KV sharing but
    converts a checkpoint with per-layer inputs or MoE blocks silently, and its logits are not HF's
    even within the window (docs/runtime-ctranslate2.md, "Upstream findings")."""
    import ctranslate2
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from gemma4_trace.replayer.runtimes.ctranslate2 import convert

    ids = [2, 17, 33]
    for name, extra in (
        ("ple", dict(hidden_size_per_layer_input=4)),
        ("moe", dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)),
    ):
        model = build_dense(tmp_path / name, **extra)
        convert(model, tmp_path / f"{name}-ct2", {"global_head_dim": 16})
        got = np.array(ctranslate2.Generator(str(tmp_path / f"{name}-ct2")).forward_batch([ids]))[0]
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(model).eval()(torch.tensor([ids])).logits[0].numpy()
        assert (np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)).min() > 0.1, name
    with pytest.raises(NotImplementedError, match="KV-shared layers"):
        convert(build_dense(tmp_path / "shared", num_kv_shared_layers=2), tmp_path / "shared-ct2", {})


@pytest.mark.slow
@needs_ct2
def test_the_sliding_window_repro_script_still_shows_the_bug():
    """docs/upstream/ctranslate2-sliding-window-prompt.md: its script's output, as the report shows it
    (figures of float32 rounding may move with the CPU). Fails once CTranslate2 keeps the window in
    its prompt pass (then the report, docs/runtime-ctranslate2.md and this test are updated)."""
    script = ROOT / "docs/upstream/ctranslate2_sliding_window_repro.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    report = (ROOT / "docs/upstream/ctranslate2-sliding-window-prompt.md").read_text()
    shown = report.split("$ python docs/upstream/ctranslate2_sliding_window_repro.py\n")[1].split("\n\n")[0]
    shown = [ln[4:] for ln in shown.splitlines()]
    got = r.stdout.strip().splitlines()
    assert len(got) == len(shown), (got, shown)
    for real, doc in zip(got, shown):
        assert same_figures(real, doc), (real, doc)
    assert got[-1] == "BUG: the prompt pass attends past the sliding window"
