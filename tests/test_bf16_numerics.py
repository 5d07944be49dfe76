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
