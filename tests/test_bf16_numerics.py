"""The static runtime in bf16 follows HF's bf16 where HF computes in float32 (attention scores,
softmax and the PV product): against HF float32, it is inside HF bf16's own error envelope."""

from __future__ import annotations

import numpy as np

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.recorder.record import record_trace
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.reader import TraceReader


def test_static_bf16_within_hf_bf16_envelope(tmp_path):
    ref, base, run = tmp_path / "ref.h5", tmp_path / "base.h5", tmp_path / "run.h5"
    record_trace(output=ref, max_new_tokens=6, dtype="float32")
    record_trace(output=base, max_new_tokens=6, dtype="bfloat16")
    replay_trace(base, run)  # the static runtime, bf16 (BASE's dtype), on BASE's tokens
    res = diff_traces(ref, run, baseline_path=base)
    assert res.match, format_text(res)
    with TraceReader(ref) as a, TraceReader(base) as b, TraceReader(run) as c:
        T = a.prompt_len
        ratios = []  # static bf16's layer_out error over HF bf16's, both against HF float32, prefill rows
        for layer in range(len(a.layers)):
            x = a.read("layer_out", layer, slice(0, T)).astype(np.float64)
            eb = np.linalg.norm(b.read("layer_out", layer, slice(0, T)) - x) / np.linalg.norm(x)
            ec = np.linalg.norm(c.read("layer_out", layer, slice(0, T)) - x) / np.linalg.norm(x)
            ratios.append(ec / eb)
    # measured: 0.95-1.08 (mean 1.02); with scores rounded to bf16 before the softmax (the runtime
    # before) 1.03-1.21 (mean 1.11, last layer 1.21)
    assert np.mean(ratios) <= 1.06 and ratios[-1] <= 1.12, [round(r, 3) for r in ratios]


def _attention_error(r: TraceReader, layer: int, o_proj: np.ndarray, window: int) -> float:
    """rel-L2 of a run's prefill attn_out against float64 attention over the run's OWN q/k/v
    (the bf16 values it recorded), through o_proj: the error of its attention alone."""
    T, info = r.prompt_len, r.layers[layer]
    q = r.read("q", layer, slice(0, T)).astype(np.float64)  # (T, H, D)
    k, v = (r.read(kind, info.kv_source, slice(0, T)).astype(np.float64) for kind in ("k", "v"))  # (T, KV, D)
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    pos = np.arange(T)
    allowed = pos[None, :] <= pos[:, None]
    if info.layer_type == "sliding_attention":
        allowed &= pos[None, :] > pos[:, None] - window
    s = np.where(allowed[None], np.einsum("thd,shd->hts", q, k), -np.inf)  # scaling 1.0
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    truth = np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ o_proj.T
    got = r.read("attn_out", layer, slice(0, T)).astype(np.float64)
    return float(np.linalg.norm(got - truth) / np.linalg.norm(truth))


def test_static_bf16_attention_no_less_precise_than_hf(tmp_path):
    """Layer by layer the static runtime's bf16 differs from HF's bf16 only in the attention core
    (norms, RoPE, MLP, PLE, residuals are the same ops in the same dtypes: layer 0's q/k/v are
    bitwise equal); and there, with scores, probabilities and PV in float32, it is at least as
    close to float64 as HF's SDPA. So a three-way diff row outside 4x BASE at E2B scale is
    propagated bf16 noise, not a numerics gap (HF eager vs HF SDPA fails it the same way on the
    10-layer E2B-shaped model)."""
    from gemma4_trace.hf.model import load_model

    base, run = tmp_path / "base.h5", tmp_path / "run.h5"
    record_trace(output=base, max_new_tokens=2, dtype="bfloat16")
    replay_trace(base, run)
    lm = load_model(None, dtype="bfloat16")
    text = lm.model.model.language_model if hasattr(lm.model.model, "language_model") else lm.model.model
    window = int(lm.text_config.sliding_window)
    with TraceReader(base) as b, TraceReader(run) as c:
        T = b.prompt_len
        for kind in ("q", "k", "v"):
            assert np.array_equal(b.read(kind, 0, slice(0, T)), c.read(kind, 0, slice(0, T))), kind
        ratios = []  # static bf16's attention error over HF bf16's, each on its own q/k/v
        for layer in range(len(b.layers)):
            o_proj = text.layers[layer].self_attn.o_proj.weight.detach().double().numpy()
            ratios.append(_attention_error(c, layer, o_proj, window) / _attention_error(b, layer, o_proj, window))
    # measured: 0.96-1.035 (mean 0.98); probabilities rounded to bf16 before PV (HF's eager path)
    # 1.01-1.22 (mean 1.11); scores rounded to bf16 (the runtime before) 1.13-1.36 (mean 1.25)
    assert np.mean(ratios) <= 1.03 and max(ratios) <= 1.1, [round(r, 3) for r in ratios]
