"""`trace replay REF --ir PATH [--ir-map MAP]`: the user's own OpenVINO IR compiled for the CPU plugin,
its tensors named by a map (replayer/runtimes/openvino_user.py, openvino_file.py; the map's format is
onnx_map.py's; extra [openvino]). The IR is the tool's own (`trace export-openvino` at
test_openvino.py's max_seq, from the artifact cache its replays fill) and mobius's ONNX graph of the
embedded model converted by `openvino.convert_model`; bad input is tests/trust/test_openvino_user_files.py's."""

from __future__ import annotations

import hashlib
import importlib.util

import numpy as np
import pytest

pytest.importorskip("openvino", reason="openvino is not installed (pip install -e '.[openvino]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke  # noqa: E402

pytestmark = pytest.mark.slow  # converts IR and runs OpenVINO; make test-fast skips it

REF = golden_path("short")
HAVE_MOBIUS = all(importlib.util.find_spec(m) for m in ("mobius", "onnx_ir", "onnxruntime"))
MAPPED = ("embeddings", "per_layer_inputs", "q", "k", "v", "attn_out", "layer_out", "final_hidden")


def digest(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def tensors(a_path, b_path, equal: bool) -> int:
    """The same sites in both traces (every dataset bit for bit equal when `equal`); how many."""
    with TraceReader(a_path) as a, TraceReader(b_path) as b:
        sites = set(a.kinds_present())
        assert sites == set(b.kinds_present())
        if equal:
            for kind, layer in sites:
                x, y = a.read(kind, layer), b.read(kind, layer)
                assert x.dtype == y.dtype and np.array_equal(x, y), (kind, layer)
        return len(sites)


@pytest.fixture(scope="module")
def own_ir(tmp_path_factory):
    """The tool's own IR, as `trace export-openvino` writes it (from the artifact cache)."""
    out = tmp_path_factory.mktemp("own") / "ir"
    res = invoke("export-openvino", "--max-seq", "16", "-o", out)
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def mobius_ir(tmp_path_factory):
    """mobius's model.onnx of the embedded model (no promoted outputs) converted to IR by openvino."""
    if not HAVE_MOBIUS:
        pytest.skip("mobius-onnx is not installed (pip install -e '.[mobius]')")
    from gemma4_trace.hf.model import embedded_model_dir
    from gemma4_trace.replayer.runtimes.mobius import build
    from gemma4_trace.replayer.runtimes.openvino import no_telemetry

    no_telemetry()
    import openvino as ov

    onnx_folder, folder = tmp_path_factory.mktemp("mobius"), tmp_path_factory.mktemp("mobius_ir")
    build(embedded_model_dir(), onnx_folder, kinds=())
    ov.save_model(ov.convert_model(str(onnx_folder / "model.onnx")), str(folder / "model.xml"), compress_to_fp16=False)
    return folder / "model.xml"


def test_the_own_ir_passed_back_is_the_openvino_runtime_bit_for_bit(own_ir, tmp_path):
    before = digest(own_ir)
    own, mine = tmp_path / "own.h5", tmp_path / "mine.h5"
    assert invoke("replay", REF, "--runtime", "openvino", "-o", own).exit_code == 0
    res = invoke("replay", REF, "--ir", own_ir, "-o", mine)
    assert res.exit_code == 0, res.output
    assert "map built-in export: every kind" in res.output and "3/3 tokens agree" in res.output
    assert tensors(own, mine, equal=True) == 51  # every kind of 8 layers, the token
    with TraceReader(own) as a, TraceReader(mine) as b:
        differ = sorted(k for k in a.provenance if a.provenance[k] != b.provenance[k])
        assert differ == ["runtime"], differ  # the provenance's runtime field alone: which files, which map
        assert b.provenance["runtime"].startswith("ir-file ir/ (OpenVINO 2026.4.1, CPU; map built-in export")
        assert "prefill.xml sha256:" in b.provenance["runtime"] and "decode.bin sha256:" in b.provenance["runtime"]
        assert str(own_ir) not in b.provenance["runtime"]
    assert digest(own_ir) == before  # the user's files: never written


def test_a_subset_map_on_the_own_ir_keeps_only_its_kinds(own_ir, tmp_path):
    m, out = tmp_path / "some.toml", tmp_path / "some.h5"
    m.write_text('format = 1\nlayout = "step-graphs"\n[kinds]\nlayer_out = { value = "L{layer:02}.layer_out" }\n')
    res = invoke("replay", REF, "--ir", own_ir, "--ir-map", m, "-o", out)
    assert res.exit_code == 0, res.output
    assert "map some.toml sha256:" in res.output and "layer_out; not mapped: embeddings" in res.output
    with TraceReader(out) as r:
        assert {k for k, _ in r.kinds_present()} == {"layer_out", "logits", "token"}
    assert diff_traces(REF, out).match


@pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed")
def test_mobius_converted_by_openvino_replays_every_mapped_kind(mobius_ir, tmp_path):
    before = digest(mobius_ir.parent)
    ort, auto, named = tmp_path / "mobius.h5", tmp_path / "auto.h5", tmp_path / "named.h5"
    assert invoke("replay", REF, "--runtime", "mobius", "-o", ort).exit_code == 0
    res = invoke("replay", REF, "--ir", mobius_ir, "-o", auto)
    assert res.exit_code == 0, res.output
    assert f"map built-in mobius: {', '.join(MAPPED)}; not mapped: rope_cos_sliding" in res.output
    assert invoke("replay", REF, "--ir", mobius_ir, "--ir-map", "mobius", "-o", named).exit_code == 0
    assert tensors(auto, named, equal=True) == 39
    assert tensors(ort, auto, equal=False) == 39  # the sites onnxruntime's replay of mobius's graph has
    res = diff_traces(REF, auto)  # every mapped kind compared, within the built-in defaults
    assert res.match, res.to_json()["first_divergence"]
    assert {t.kind for t in res.tensors} >= set(MAPPED)
    assert digest(mobius_ir.parent) == before


@pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed")
def test_a_weight_changed_in_a_copy_of_the_ir_is_found_at_its_layer(mobius_ir, tmp_path):
    import openvino as ov
    from openvino import opset13 as op

    model = ov.Core().read_model(str(mobius_ir))
    (mm,) = [o for o in model.get_ops() if o.get_friendly_name().startswith("model/layers.3/self_attn/v_proj/")]
    w = mm.input_value(1).get_node()
    assert w.get_type_name() == "Constant"
    planted = w.get_data().copy()
    planted[:, :4] *= 1.5
    mm.input(1).replace_source_output(op.constant(planted).output(0))
    bad = tmp_path / "planted.xml"
    ov.save_model(model, str(bad), compress_to_fp16=False)
    out = tmp_path / "bad.h5"
    res = invoke("replay", REF, "--ir", bad, "-o", out)
    assert res.exit_code == 0, res.output
    first = diff_traces(REF, out).to_json()["first_divergence"]
    assert (first["step"], first["layer"], first["kind"]) == (0, 3, "v"), first


@pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed")
def test_mobius_ir_of_a_checkpoint_with_unit_norm_weights_still_maps_every_kind(tmp_path):
    """A checkpoint whose norm weights are all ones (a freshly initialised one's: the E2B-shaped
    benchmark model's) converts to an IR without the norms' weight Multiply, and the final norm's
    name went with it: the built-in mobius map reads final_hidden at the LM head's input instead."""
    import shutil

    import openvino as ov
    import torch
    from safetensors.torch import load_file, save_file

    from gemma4_trace.hf.model import embedded_model_dir
    from gemma4_trace.replayer.runtimes.mobius import build

    model = tmp_path / "unit_norms"
    shutil.copytree(embedded_model_dir(), model)
    weights = load_file(model / "model.safetensors")
    ones = [k for k in weights if k.endswith("norm.weight")]
    assert len(ones) > 10, ones
    save_file({k: torch.ones_like(v) if k in ones else v for k, v in weights.items()}, model / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    ref, run = tmp_path / "ref.h5", tmp_path / "run.h5"
    res = invoke("record", "--model", model, "--prompt", "hello world", "--max-new-tokens", "2", "-o", ref)
    assert res.exit_code == 0, res.output
    build(model, tmp_path / "onnx", kinds=())
    ir = tmp_path / "model.xml"
    ov.save_model(ov.convert_model(str(tmp_path / "onnx" / "model.onnx")), str(ir), compress_to_fp16=False)
    names = {o.get_friendly_name() for o in ov.Core().read_model(str(ir)).get_ops()}
    assert not any(n.startswith("model/norm/") for n in names)  # the final norm's named op is gone
    res = invoke("replay", ref, "--model", model, "--ir", ir, "-o", run)
    assert res.exit_code == 0, res.output
    assert f"map built-in mobius: {', '.join(MAPPED)}; not mapped" in res.output
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    assert {t.kind for t in res.tensors} >= set(MAPPED)
