"""The llama.cpp bug zoo beyond tests/test_llamacpp.py: conversion faults llama.cpp refuses at
load (one line, llama.cpp's own reason), and faults under Q4_K_M judged against the
dequantized baseline on the 256-wide K-quant test model."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")

from gemma4_trace.hf.model import embedded_model_dir, load_model  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer import gguf_writer as GW  # noqa: E402
from tests.support import invoke, one_line_error  # noqa: E402

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
    monkeypatch.setenv(GW.CACHE_ENV, str(tmp_path / "cache"))
    path = GW.cache_path(embedded_model_dir(), "F32")
    path.parent.mkdir(parents=True)
    GW.write_f32(load_model(None), path, **how)
    run = tmp_path / "run.h5"
    res = invoke("replay", str(golden_path("short")), "--runtime", "llama.cpp", "-o", str(run))
    assert one_line_error(res, out=run) == (
        f"error: llama.cpp (F32) failed in loading {path}: llama.cpp could not load the GGUF file ({reason})"
    )
    assert not run.exists()
