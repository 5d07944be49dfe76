"""`--runtime tico` / `tico-quant` (TICO's StaticGemma4Runtime, extra gemma4-trace[tico]) on the goldens."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "tico.quantization.recipes.debug.static_gemma4_runtime",
    reason="TICO is not installed (pip install -e '.[tico]')",
)

from gemma4_trace.diff import diff_traces, hints  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error, site_of  # noqa: E402

pytestmark = pytest.mark.slow  # TICO's own runtime on every golden; make test-fast skips it


def test_text_prompt_matches_reference_over_every_kind(tmp_path):
    ref, run = golden_path("short"), tmp_path / "tico.h5"
    summary = replay_trace(ref, run, runtime="tico")
    assert "3/3 tokens agree" in summary
    with TraceReader(run) as b:  # its kinds: its capture map's (tests/runtimes/test_conformance.py)
        assert b.provenance["runtime"] == "tico 0.3.0"
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]


def test_image_prompt_mask_difference_is_located(tmp_path):
    # TICO's text masks are causal; the embedded model asks for bidirectional attention
    # within an image (use_bidirectional_attention="vision"), whose tokens start at position 4
    ref, run = golden_path("image"), tmp_path / "tico.h5"
    replay_trace(ref, run, runtime="tico")
    result = diff_traces(ref, run)
    fd = result.to_json()["first_divergence"]
    assert site_of(fd, "step", "phase", "layer", "kind", "position") == (0, "prefill", 0, "mask", 4)
    assert result.hint is not None and result.hint.name == hints.IMAGE_BLOCK_CAUSAL, result.hint  # the zoo's signature
    with TraceReader(ref) as r:
        assert int(r.prompt_ids[4]) == r.model_config["image_token_id"] != int(r.prompt_ids[3])
    # before that, TICO's own vision step (its wrappers, not HF's tower) at every vision site: the
    # 256 real patches of the 280 its static profile runs (24 padding patches), then 64 soft tokens
    res = diff_traces(ref, run, full=True).to_json()
    vision = {(t["kind"], t["layer"]): t for t in res["tensors"] if t["kind"].startswith("vision.")}
    with TraceReader(ref) as r:
        assert set(vision) == {(s.key, s.layer) for s in r.sites() if s.tower == "vision"}
    assert {t["rows"] for k, t in vision.items() if k[0] not in ("vision.pooled", "vision.soft_tokens")} == {256}
    assert vision[("vision.soft_tokens", None)]["rows"] == 64
    assert all(t["status"] == "ok" and t["max_rel_l2"] < 1e-5 for t in vision.values()), vision


def test_quantized_runs_end_to_end_and_calibrates(tmp_path):
    ref, run = golden_path("short"), tmp_path / "q.h5"
    res = invoke("replay", str(ref), "--runtime", "tico-quant", "-o", str(run))
    assert res.exit_code == 0, res.output
    assert "tico-quant 0.3.0 runtime" in res.output and "3/3 tokens agree" in res.output
    fd = diff_traces(ref, run).to_json()["first_divergence"]
    assert fd is not None and fd["metric"] and 0 < fd["value"] < 1e-1  # int16 fake quant: small, real errors
    # the quantization workflow: tolerances calibrated from this known-good run accept it
    tol = tmp_path / "tol.toml"
    res = invoke("calibrate", str(ref), str(run), "-o", str(tol))
    assert res.exit_code == 0, res.output
    res = invoke("diff", str(ref), str(run), "--tolerances", str(tol))
    assert res.exit_code == 0, res.output
    # and as the trusted BASE of a three-way diff: the float TICO run is inside its envelope
    flt = tmp_path / "float.h5"
    replay_trace(ref, flt, runtime="tico")
    assert invoke("diff", str(ref), str(run)).exit_code == 1
    res = invoke("diff", str(ref), str(flt), "--baseline", str(run))
    assert res.exit_code == 0, res.output


def test_missing_or_unsupported_is_one_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tico", None)  # as if TICO were not installed
    res = invoke("replay", str(golden_path("short")), "--runtime", "tico", "-o", str(tmp_path / "x.h5"))
    one_line_error(res, "pip install -e '.[tico]'")
    assert not (tmp_path / "x.h5").exists()


def test_per_layer_kv_heads_config(tmp_path):
    # attention_k_eq_v: full layers have their own KV head count (per_layer_config); TICO 0.3.0
    # sizes every cache from the sliding layers' count unless the adapter sizes them per layer
    from gemma4_trace.recorder.record import record_trace
    from tests.support import tiny_models

    model = tiny_models.build(tmp_path / "model", "k_eq_v", multimodal=True)
    ref, run, static = tmp_path / "ref.h5", tmp_path / "tico.h5", tmp_path / "static.h5"
    record_trace(model, ref, input_ids=[2, 5, 9, 17, 33, 4, 8, 60, 61, 62, 11], max_new_tokens=6)
    assert "6/6 tokens agree" in replay_trace(ref, run, model_dir=model, runtime="tico")
    replay_trace(ref, static, model_dir=model)
    with TraceReader(run) as r:
        assert {li.num_kv_heads for li in r.layers} == {1, 2} and r.has("k", 2)
    res = diff_traces(static, run)  # TICO against our static runtime: float32 rounding only
    assert res.match, res.to_json()["first_divergence"]


def test_quantized_image_prompt_calibrates_the_vision_step_too(tmp_path):
    # TICO builds its vision step only outside calibration mode: the adapter builds it first, so the
    # int16 fake quant is calibrated on the image as well and shows in the tower as small, real errors
    ref, run = golden_path("image"), tmp_path / "q.h5"
    replay_trace(ref, run, runtime="tico-quant")
    vision = [t for t in diff_traces(ref, run, full=True).to_json()["tensors"] if t["kind"].startswith("vision.")]
    assert len(vision) == 15
    assert all(0 < t["max_rel_l2"] < 1e-2 for t in vision), vision
