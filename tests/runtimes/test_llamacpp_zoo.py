"""The llama.cpp bug zoo beyond tests/runtimes/test_llamacpp.py: conversion faults llama.cpp refuses at
load (one line, llama.cpp's own reason), and faults under Q4_K_M judged against the
dequantized baseline on the 256-wide K-quant test model."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")

from gemma4_trace.diff.tolerances import resolve_tolerances  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.artifacts import CACHE_ENV  # noqa: E402
from tests.support.cli import invoke, one_line_error, plant_gguf  # noqa: E402

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

PROFILE = str(resolve_tolerances("llamacpp-f32"))

# faults whose file llama.cpp's loader refuses: the replay is one line with llama.cpp's reason.
# The tiny model: 8 layers [S,S,F,S,F,S,S,F], the last 3 share K/V (layers 0-4 own it).
REFUSED = {
    # 2 sharing layers instead of 3: llama.cpp expects layer 5 to own K/V, and the writer (which
    # follows the model: layer 5 has no k_proj) wrote none for it
    "KV-sharing count 2 instead of 3": (
        dict(metadata={"gemma4.attention.shared_kv_layers": 2}),
        "check_tensor_dims: tensor 'blk.5.attn_k.weight' not found",
    ),
    # the whole per-layer embedding table transposed: (ple width x layers, vocab) is not llama.cpp's shape
    "per-layer embedding table transposed": (
        dict(mutate=lambda n, a: a.T.copy() if n == "per_layer_token_embd.weight" else a),
        "check_tensor_dims: tensor 'per_layer_token_embd.weight' has wrong shape; expected 64, 680, got 680, 64, 1, 1",
    ),
}


@pytest.mark.parametrize("fault", REFUSED)
def test_conversion_fault_llamacpp_refuses_is_one_line(tmp_path, monkeypatch, fault):
    how, reason = REFUSED[fault]
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    plant_gguf(**how)
    run = tmp_path / "run.h5"
    res = invoke("replay", str(golden_path("short")), "--runtime", "llama.cpp", "-o", str(run))
    assert one_line_error(res, out=run) == (
        f"error: llama.cpp (F32) failed in loading the GGUF file: llama.cpp could not load the GGUF file ({reason})"
    )
    assert not run.exists()


# ---------------------------------------------------------------- faults under Q4_K_M, judged against its weights
# The 256-wide K-quant test model (tests/runtimes/test_llamacpp.py's kquant_model): 7 layers
# [S,S,F,S,F,S,F], sliding window 4, sliding RoPE base 1e4, per-layer inputs 4 wide, norm weights
# all 1 (random init). A faulty F32 conversion is quantized to Q4_K_M by llama.cpp (the runtime's
# own path: the faulty file stands in the cache) and diffed against REF with BASE, the static
# runtime on the CORRECT Q4_K_M's weights dequantized: the error 4-bit weights explain is BASE's,
# what is left is the fault. The expected sites follow from the structure; Q4_K_M's rounding
# hides the rows where a fault is still small, so for position-growing faults the structure
# gives the layer, the kind and the first position the fault can act at.
from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from tests.runtimes.test_llamacpp import kquant_model as _kquant_model  # noqa: E402,F401  (a module-scoped fixture)

Q4_ZOO = {
    # RoPE does nothing at position 0: layer 0 (sliding) q, from position 1 on
    "sliding RoPE base 1e6 instead of 1e4": (
        dict(metadata={"gemma4.rope.freq_base_swa": 1e6}),
        (0, 0, "q", range(1, 10)),
    ),
    # window 5 instead of 4: position 4 is the first query that sees a key too many (position 0);
    # the mask says so exactly, whatever the weights' rounding
    "sliding window off by one (5)": (
        dict(metadata={"gemma4.attention.sliding_window": 5}),
        (0, 0, "mask", range(4, 5)),
    ),
    # norms stay F32 in Q4_K_M; the per-layer projection norm is the first norm weight applied
    "RMSNorm weights written as 1 + w": (
        dict(mutate=lambda n, a: a + 1 if n.endswith("norm.weight") else a),
        (0, None, "per_layer_inputs", range(0, 1)),
    ),
    # 7 layers x 4 channels per token written channel-major: per_layer_inputs, row 0
    "per-layer embeddings transposed (layer x channel)": (
        dict(
            mutate=lambda n, a: (
                a.reshape(a.shape[0], 7, -1).transpose(0, 2, 1).reshape(a.shape).copy()
                if n == "per_layer_token_embd.weight"
                else a
            )
        ),
        (0, None, "per_layer_inputs", range(0, 1)),
    ),
    # a softcap of 15 changes only the logits, by less than the 4-bit weights already do (REF's
    # logits are up to 22: the cap bends them a few percent; BASE's logits are 0.29..0.69 rel-L2
    # off): hidden, the diff is a match. Stated, not claimed as found.
    "final logit softcap 15 instead of 30 (hidden)": (dict(metadata={"gemma4.final_logit_softcapping": 15.0}), None),
}


@pytest.fixture(scope="module")
def kq(request):
    """tests/runtimes/test_llamacpp.py's K-quant model and its REF: (model folder, ref.h5)."""
    return request.getfixturevalue("_kquant_model")


@pytest.fixture(scope="module")
def q4_baseline(kq, tmp_path_factory):
    """BASE: REF replayed by the static runtime on the correct Q4_K_M's weights, dequantized."""
    model, ref = kq
    d = tmp_path_factory.mktemp("q4base")
    q4, base = d / "q4km.gguf", d / "base.h5"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(d / "cache"))
        assert invoke("export-gguf", "--model", model, "--type", "Q4_K_M", "-o", q4).exit_code == 0
    replay_trace(ref, base, model_dir=model, weights_from=q4)
    return base


def _q4_run(tmp_path, monkeypatch, model, ref, how):
    """REF replayed by llama.cpp on the Q4_K_M of the writer's conversion with `how`'s mistake."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    plant_gguf(model, **how)
    run = tmp_path / "run.h5"
    replay_trace(ref, run, model_dir=model, runtime="llama.cpp:Q4_K_M")
    return run


def test_correct_q4_k_m_against_the_dequantized_baseline_is_a_match(tmp_path, monkeypatch, kq, q4_baseline):
    model, ref = kq
    run = _q4_run(tmp_path, monkeypatch, model, ref, {})
    res = diff_traces(ref, run, PROFILE, baseline_path=q4_baseline)
    assert res.match, res.to_json()["first_divergence"]


@pytest.mark.parametrize("fault", Q4_ZOO)
def test_conversion_fault_under_q4_k_m_is_localised_against_the_baseline(
    tmp_path,
    monkeypatch,
    kq,
    q4_baseline,
    fault,
):
    model, ref = kq
    how, expected = Q4_ZOO[fault]
    run = _q4_run(tmp_path, monkeypatch, model, ref, how)
    res = diff_traces(ref, run, PROFILE, baseline_path=q4_baseline)
    if expected is None:
        assert res.match, res.to_json()["first_divergence"]
        return
    first = res.to_json()["first_divergence"]
    step, layer, kind, positions = expected
    assert (first["step"], first["layer"], first["kind"]) == (step, layer, kind), first
    assert first["position"] in positions, first
