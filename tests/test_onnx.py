"""`--runtime onnx` (the static runtime's steps exported to ONNX, run by onnxruntime on CPU) and
`trace export-onnx` (extra gemma4-trace[onnx])."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'gemma4-trace[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install 'gemma4-trace[onnx]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support import invoke, one_line_error  # noqa: E402


def test_onnx_matches_reference_with_kernel_sized_differences(tmp_path):
    ref, run, static = golden_path("short"), tmp_path / "onnx.h5", tmp_path / "static.h5"
    assert "3/3 tokens agree" in replay_trace(ref, run, runtime="onnx")
    replay_trace(ref, static)
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    with TraceReader(static) as a, TraceReader(run) as b:
        assert b.provenance["runtime"].startswith("onnx (onnxruntime 1.32.0")
        assert b.kinds_present() == a.kinds_present()  # every kind of the static runtime, as graph outputs
        worst, differ = 0.0, 0
        for kind, layer in a.kinds_present():
            x, y = a.read(kind, layer), b.read(kind, layer)
            if x.dtype.kind != "f":
                assert np.array_equal(x, y), (kind, layer)  # masks and tokens exactly
                continue
            x, y = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1)
            rel = np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)
            worst, differ = max(worst, rel.max()), differ + bool(rel.max() > 0)
        # onnxruntime's kernels are not torch's: real, float32-sized differences
        assert differ >= 10 and 1e-8 < worst < 1e-5, (differ, worst)


def test_image_prompt_matches_reference(tmp_path):
    ref, run = golden_path("image"), tmp_path / "onnx.h5"
    assert "11/11 tokens agree" in replay_trace(ref, run, runtime="onnx")
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]


def test_export_onnx_writes_checked_graphs(tmp_path):
    import onnx

    out = tmp_path / "graphs"
    res = invoke("export-onnx", "--max-seq", "16", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "prefill.onnx" in res.output and "decode.onnx" in res.output
    for name, first in (("prefill", ["ids", "ple_ids", "mm_embeds", "mm_slots", "block_ids", "n_valid"]),
                        ("decode", ["token", "input_pos"])):
        m = onnx.load(str(out / f"{name}.onnx"))
        onnx.checker.check_model(m)
        inputs = [i.name for i in m.graph.input]
        outputs = [o.name for o in m.graph.output]
        assert inputs[: len(first)] == first and inputs[len(first)] == "L00.k_cache"
        assert outputs[0] == "logits" and "L00.k_cache_out" in outputs
        assert {"embeddings", "L00.mask", "L03.q", "L04.v", "L07.attn_out", "final_hidden"} <= set(outputs)
        assert "L05.k" not in outputs  # layer 5 reuses layer 3's K/V and writes none
    before = (out / "decode.onnx").stat().st_mtime_ns
    res = invoke("export-onnx", "--max-seq", "16", "-o", str(out))
    one_line_error(res, "already exists; pass --force")
    assert (out / "decode.onnx").stat().st_mtime_ns == before
