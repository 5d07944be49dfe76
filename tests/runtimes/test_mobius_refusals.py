"""`--runtime mobius` takes token ids only: a REF with an image is refused before the model loads
or mobius builds its graph (a runtime factory is given the model, never REF's inputs, so the
replay asks the registry's check_inputs first, replayer/runtimes/registry.py)."""

import importlib.util

import pytest

from gemma4_trace.recorder.golden import golden_path
from tests.support.cli import invoke, one_line_error

HAVE_MOBIUS = all(importlib.util.find_spec(m) for m in ("mobius", "onnxruntime", "onnx_ir"))


@pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed (pip install -e '.[mobius]')")
def test_an_image_prompt_is_refused_before_the_model_loads_or_a_graph_is_built(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("slow work started before the refusal")

    monkeypatch.setattr("gemma4_trace.hf.model.load_model", refuse)
    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", refuse)
    monkeypatch.setattr("gemma4_trace.replayer.runtimes.mobius.build", refuse)
    cache, out = tmp_path / "cache", tmp_path / "run.h5"
    res = invoke("replay", golden_path("image"), "--runtime", "mobius", "--cache-dir", cache, "-o", out)
    one_line_error(res, "--runtime mobius runs a text decoder, which takes token ids only", "has an image", out=out)
    assert not cache.exists() or not any(cache.iterdir())  # no graph built, no cache entry


def test_a_text_prompt_passes_the_check_and_other_runtimes_take_images():
    from gemma4_trace.replayer.runtimes.registry import check_inputs, parse_runtime
    from gemma4_trace.traces.errors import TraceToolError

    check_inputs(parse_runtime("mobius"), extra={})  # a text prompt
    check_inputs(parse_runtime("onnx"), extra={"pixel_values": object()})
    check_inputs(parse_runtime("static"), extra={"pixel_values": object()})
    with pytest.raises(TraceToolError, match="takes token ids only"):
        check_inputs(parse_runtime("mobius"), extra={"pixel_values": object()})
