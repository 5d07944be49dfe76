"""Models larger than one device: `trace record --device-map auto` (accelerate) with layers
offloaded to disk records the same trace as a plain recording; `trace replay --device cuda`
where a GPU exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.recorder import golden
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error

pytest.importorskip("accelerate")


def test_offloaded_recording_equals_plain(tmp_path):
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.recorder.record import record_trace

    lm = load_model(None, device_map="auto", max_memory={"cpu": "1MB"}, offload_folder=tmp_path / "offload")
    placed = set(lm.model.hf_device_map.values())
    assert "disk" in placed and lm.device == "cpu", lm.model.hf_device_map  # 1 MB of CPU: most layers live on disk
    del lm

    plain, offloaded = tmp_path / "plain.h5", tmp_path / "offloaded.h5"
    record_trace(output=plain, max_new_tokens=4)
    res = invoke(
        "record",
        "--max-new-tokens",
        "4",
        "--device-map",
        "auto",
        "--max-memory",
        "cpu=1MB",
        "--offload-folder",
        str(tmp_path / "offload2"),
        "-o",
        str(offloaded),
    )
    assert res.exit_code == 0, res.output
    res = diff_traces(plain, offloaded)
    assert res.match, format_text(res)
    with TraceReader(plain) as a, TraceReader(offloaded) as b:
        assert set(a.kinds_present()) == set(b.kinds_present())
        for kind, layer in (("layer_out", 7), ("k", 0), ("logits", None)):  # computed alike on the CPU
            np.testing.assert_allclose(a.read(kind, layer), b.read(kind, layer), rtol=1e-5, atol=1e-6)


def test_bad_max_memory_is_one_line(tmp_path):
    res = invoke("record", "--device-map", "auto", "--max-memory", "cpu", "-o", str(tmp_path / "r.h5"))
    one_line_error(res, "DEVICE=SIZE")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replay_on_cuda_matches(tmp_path):
    out = tmp_path / "run.h5"
    for name in ("window", "image"):
        res = invoke("replay", str(golden.golden_path(name)), "--device", "cuda", "-o", str(out), "--force")
        assert res.exit_code == 0, res.output
        with TraceReader(out) as r:
            assert r.provenance["device"] == "cuda"
        res = diff_traces(golden.golden_path(name), out)
        assert res.match, format_text(res)


@pytest.mark.parametrize("max_memory", [None, "cpu=20KB"], ids=["one-device", "disk"])
def test_text_only_checkpoint_records_with_device_map(tmp_path, max_memory):
    """Gemma4ForCausalLM: a model that fits on one device is not dispatched (no hf_device_map)."""
    from tests.support import tiny_models

    model = tiny_models.build(tmp_path / "m", "base")
    args = ["record", "--model", str(model), "--input-ids", "2,10,11,12", "--max-new-tokens", "3"]
    plain, mapped = tmp_path / "plain.h5", tmp_path / "mapped.h5"
    assert invoke(*args, "-o", plain).exit_code == 0
    extra = ["--max-memory", max_memory, "--offload-folder", str(tmp_path / "off")] if max_memory else []
    res = invoke(*args, "--device-map", "auto", *extra, "-o", mapped)
    assert res.exit_code == 0, res.output
    res = diff_traces(plain, mapped)
    assert res.match, format_text(res)
    with TraceReader(plain) as a, TraceReader(mapped) as b:
        assert b.provenance["device"] == "cpu"
        np.testing.assert_allclose(a.read("logits"), b.read("logits"), rtol=1e-5, atol=1e-6)
