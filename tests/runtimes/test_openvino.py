"""`--runtime openvino` and its NNCF-compressed variants (the static runtime's steps converted to
OpenVINO IR, compiled for the CPU plugin) and `trace export-openvino` (extra gemma4-trace[openvino]).

The conversion costs about 30 s for the embedded model, once per content (the suite's artifact
cache keeps it); the compressed IRs and their folded baselines come from it in seconds."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino", reason="openvino is not installed (pip install -e '.[openvino]')")
pytest.importorskip("nncf", reason="nncf is not installed (pip install -e '.[openvino]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.runtimes import openvino as V  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import float_differences, invoke, one_line_error  # noqa: E402

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

MODES = ("openvino", "openvino-int8", "openvino-int8-dq", "openvino-int4", "openvino-int4-dq")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("openvino")
    out = {"ref": golden_path("short"), "dir": d}
    for mode in MODES:
        out[mode] = d / f"{mode}.h5"
        r = invoke("replay", out["ref"], "--runtime", mode, "-o", out[mode])
        assert r.exit_code == 0, r.output
        out[mode + ":summary"] = r.stdout
    return out


def _rel(x, y):
    x, y = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
    return np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)


def test_float_replay_matches_reference_with_kernel_sized_differences(runs, tmp_path):
    ref, run, static = runs["ref"], runs["openvino"], tmp_path / "static.h5"
    assert invoke("replay", ref, "-o", static).exit_code == 0
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    assert "3/3 tokens agree" in runs["openvino:summary"]
    with TraceReader(static) as a, TraceReader(run) as b:
        assert b.provenance["runtime"].startswith("openvino (OpenVINO 2026.4.1, CPU, f32 inference precision")
        worst, differ = float_differences(a, b)
        # the CPU plugin's float32 kernels are not torch's: real, float32-sized differences
        assert differ >= 10 and 1e-8 < worst < 1e-5, (differ, worst)


def test_image_prompt_matches_reference_through_the_vision_graph(tmp_path):
    # two images, one padded: the vision tower runs as vision.xml, every vision site an output
    run = tmp_path / "image.h5"
    r = invoke("replay", golden_path("two_images"), "--runtime", "openvino", "-o", run)
    assert r.exit_code == 0, r.output
    assert "8/8 tokens agree" in r.stdout
    res = diff_traces(golden_path("two_images"), run)
    assert res.match, res.to_json()["first_divergence"]
    vision = {k.key for k in S.TOWER_BY_NAME["vision"].kinds}
    assert vision <= {t.kind for t in res.tensors} and not [s for s in res.skipped if s.kind in vision]


def test_compressed_modes_run_the_vision_tower_compressed_as_the_steps_are(tmp_path):
    # openvino-int4 runs vision.xml compressed by the same NNCF scheme: every vision site is its
    # own, the first divergence from HF is inside the tower, and its -dq baseline (the same vision
    # weights folded into float32) accounts for it
    ref, runs = golden_path("image"), {}
    for mode in ("openvino-int4", "openvino-int4-dq"):
        runs[mode] = tmp_path / f"{mode}.h5"
        r = invoke("replay", ref, "--runtime", mode, "-o", runs[mode])
        assert r.exit_code == 0, r.output
    vision = {k.key for k in S.TOWER_BY_NAME["vision"].kinds}
    first = diff_traces(ref, runs["openvino-int4"]).to_json()["first_divergence"]
    assert first is not None and first["kind"] in vision, first
    res = diff_traces(ref, runs["openvino-int4"], baseline_path=runs["openvino-int4-dq"])
    assert res.match, res.to_json()["first_divergence"]
    assert vision <= {t.kind for t in res.tensors}
    import openvino as ov

    from gemma4_trace.hf.model import load_model

    with TraceReader(ref) as t:
        shape = t.extra_inputs()["pixel_values"].shape[:2]  # (images, patches): the IR's static shape
    art = V.vision_ir(load_model(None), shape, "openvino-int4")  # from the cache the replay filled
    try:
        ops = ov.Core().read_model(str(art.path / "vision.xml")).get_ops()
        assert "i4" in {o.get_element_type().get_type_name() for o in ops if o.get_type_name() == "Constant"}
    finally:
        art.close()


def test_compressed_replays_diverge_from_hf_and_stay_within_their_baseline(runs):
    ref = runs["ref"]
    for mode in ("openvino-int8", "openvino-int4"):
        with TraceReader(runs[mode]) as b, TraceReader(runs[mode + "-dq"]) as c:
            assert V.SCHEME[mode] in b.provenance["runtime"]
            assert "decompressed into float32 weights" in c.provenance["runtime"]
        first = diff_traces(ref, runs[mode]).to_json()["first_divergence"]
        assert first is not None and first["kind"] != "logits", (mode, first)  # the weights' rounding comes first
        res = diff_traces(ref, runs[mode], baseline_path=runs[mode + "-dq"])
        assert res.match, (mode, res.to_json()["first_divergence"])


def test_the_folded_baseline_holds_the_compressed_weights_in_float():
    """The -dq IR has no integer weights left, and its float matrices are the int4 ones: in each
    of them every group of 32 inputs takes at most 16 values (two of the float IR's constants happen to)."""
    import openvino as ov

    from gemma4_trace.hf.model import load_model

    loaded = load_model(None)
    core = ov.Core()

    def constants(mode):
        art = V.ir(loaded, 16, mode)
        try:
            m = core.read_model(str(art.path / "decode.xml"))
            return [o for o in m.get_ops() if o.get_type_name() == "Constant"]
        finally:
            art.close()

    def int4_like(ops):  # float matrices whose every row takes <= 16 values in each group of 32 inputs
        n = 0
        for o in ops:
            shape = list(o.get_output_shape(0))
            if o.get_element_type().get_type_name() != "f32" or len(shape) != 2 or shape[1] % 32 or shape[0] < 8:
                continue
            w = o.get_data().reshape(shape[0], -1, 32)
            n += max(len(np.unique(g)) for g in w.reshape(-1, 32)) <= 16 and len(np.unique(w)) > 16
        return n

    types = lambda ops: {o.get_element_type().get_type_name() for o in ops}  # noqa: E731
    q, dq, f = constants("openvino-int4"), constants("openvino-int4-dq"), constants("openvino")
    assert "i4" in types(q) and not {"i4", "u4", "i8", "u8"} & types(dq)
    assert int4_like(dq) - int4_like(f) >= 50, (int4_like(f), int4_like(dq))  # NNCF: 59 int4 matrices


def test_export_openvino_writes_the_ir_the_replay_ran(runs, tmp_path):
    import openvino as ov

    out = tmp_path / "ir"
    r = invoke("export-openvino", "--max-seq", "16", "-o", out)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["decode.bin", "decode.xml", "prefill.bin", "prefill.xml"]
    m = ov.Core().read_model(str(out / "decode.xml"))
    assert [i.get_any_name() for i in m.inputs][:3] == ["token", "input_pos", "L00.k_cache"]
    outputs = [o.get_any_name() for o in m.outputs]
    assert outputs[0] == "logits" and {"embeddings", "L00.mask", "L03.q", "L07.attn_out"} <= set(outputs)
    r = invoke("export-openvino", "--runtime", "openvino-int4", "--max-seq", "16", "-o", out)
    one_line_error(r, "exists; pass --force")
    r = invoke("export-openvino", "--runtime", "openvino-int4", "--max-seq", "16", "-o", out, "--force")
    assert r.exit_code == 0, r.output
    assert "INT4_SYM" in r.stdout


def test_a_crash_in_the_plugin_is_one_line_and_leaves_no_trace(runs, tmp_path):
    out = tmp_path / "crash.h5"
    crash = {"GEMMA4_TRACE_TEST_NATIVE_CRASH": "decode step 2"}
    r = invoke("replay", runs["ref"], "--runtime", "openvino", "-o", out, env=crash)
    one_line_error(r, "openvino (OpenVINO 2026.4.1) crashed in decode step 2: killed by SIGSEGV", out=out)


def test_an_ir_the_plugin_refuses_is_one_line(runs, tmp_path, monkeypatch):
    """A cached IR damaged after its hash check (here: the files the engine is given) is the
    plugin's refusal in one line, naming the file."""
    from gemma4_trace.replayer.artifacts import Artifact

    bad = tmp_path / "bad"
    bad.mkdir()
    for g in ("prefill", "decode"):
        (bad / f"{g}.xml").write_text("<net name='x' version='11'><layers><layer id='0'")
        (bad / f"{g}.bin").write_bytes(b"")
    monkeypatch.setattr(V, "ir", lambda *a: Artifact(bad, "cached"))
    out = tmp_path / "o.h5"
    r = invoke("replay", runs["ref"], "--runtime", "openvino", "-o", out)
    one_line_error(r, "OpenVINO cannot compile it", "prefill.xml", out=out)


def test_refusals_come_before_any_conversion(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("converted before refusing")

    monkeypatch.setattr(V, "ir", refuse)
    out = tmp_path / "o.h5"
    r = invoke("replay", golden_path("short"), "--runtime", "openvino-int4", "--isolate", "-o", out)
    one_line_error(r, "does not support --isolate", out=out)
    r = invoke("replay", golden_path("short"), "--runtime", "openvino", "--device", "cuda", "-o", out)
    one_line_error(r, "runs on the CPU", out=out)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nncf" else real(name, *a))
    r = invoke("replay", golden_path("short"), "--runtime", "openvino-int8", "-o", out)
    one_line_error(r, "needs nncf, which is not installed", "[openvino]", out=out)


def test_no_usage_telemetry_is_sent(runs, tmp_path):
    """OpenVINO's converter and NNCF send usage telemetry unless told not to: a replay that
    converts and compresses (a fresh cache) imports openvino_telemetry nowhere."""
    import subprocess
    import sys

    code = (
        "import sys; from gemma4_trace.entry import main; sys.argv = ['trace'] + sys.argv[1:]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('telemetry', sys.modules.get('openvino_telemetry'))"
    )
    out = tmp_path / "o.h5"
    args = ["replay", str(runs["ref"]), "--runtime", "openvino-int8", "--no-cache", "-o", str(out)]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert out.exists(), r.stderr
    assert r.stdout.strip().splitlines()[-1] == "telemetry None", r.stdout
