"""`trace replay REF --onnx PATH [--onnx-map MAP]`: the user's own ONNX graph run by onnxruntime, its
tensors named by a map (replayer/runtimes/onnx_user.py, onnx_file.py, onnx_map.py; extra [onnx]).
The graphs are the tool's own export (the artifact cache's, at test_onnx.py's max_seq) and mobius's
build of the embedded model; bad input is tests/trust/test_onnx_user_files.py's."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install -e '.[onnx]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke  # noqa: E402

pytestmark = pytest.mark.slow  # exports graphs and runs onnxruntime; make test-fast skips it

REF = golden_path("short")
HAVE_MOBIUS = all(importlib.util.find_spec(m) for m in ("mobius", "onnx_ir"))


def digest(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def same_tensors(a_path, b_path) -> int:
    """Every dataset of two traces bit for bit equal (the same sites in both); how many."""
    with TraceReader(a_path) as a, TraceReader(b_path) as b:
        sites = set(a.kinds_present())
        assert sites == set(b.kinds_present())
        for kind, layer in sites:
            x, y = a.read(kind, layer), b.read(kind, layer)
            assert x.dtype == y.dtype and np.array_equal(x, y), (kind, layer)
        return len(sites)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The tool's own step graphs, as `trace export-onnx` writes them (from the artifact cache)."""
    out = tmp_path_factory.mktemp("own") / "graphs"
    res = invoke("export-onnx", "--max-seq", "16", "-o", out)
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def mobius_file(tmp_path_factory):
    """mobius's model.onnx of the embedded model, as mobius builds it (no promoted outputs)."""
    if not HAVE_MOBIUS:
        pytest.skip("mobius-onnx is not installed (pip install -e '.[mobius]')")
    from gemma4_trace.hf.model import embedded_model_dir
    from gemma4_trace.replayer.runtimes.mobius import build

    folder = tmp_path_factory.mktemp("mobius")
    build(embedded_model_dir(), folder, kinds=())
    return folder / "model.onnx"


def test_the_own_export_passed_back_is_the_onnx_runtime_bit_for_bit(graphs, tmp_path):
    before = digest(graphs)
    own, mine = tmp_path / "own.h5", tmp_path / "mine.h5"
    assert invoke("replay", REF, "--runtime", "onnx", "-o", own).exit_code == 0
    res = invoke("replay", REF, "--onnx", graphs, "-o", mine)
    assert res.exit_code == 0, res.output
    assert "map built-in export: every kind" in res.output and "3/3 tokens agree" in res.output
    assert same_tensors(own, mine) == 51  # every kind of 8 layers, the token
    with TraceReader(own) as a, TraceReader(mine) as b:
        differ = sorted(k for k in a.provenance if a.provenance[k] != b.provenance[k])
        assert differ == ["runtime"], differ  # the provenance's runtime field alone: which file, which map
        assert b.provenance["runtime"].startswith("onnx-file graphs/ (onnxruntime 1.32.0, CPU; map built-in export")
        assert "prefill.onnx sha256:" in b.provenance["runtime"] and str(graphs) not in b.provenance["runtime"]
    assert digest(graphs) == before  # the user's files: never written


@pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed")
def test_mobius_file_with_the_built_in_map_is_the_mobius_runtime(mobius_file, tmp_path):
    before = digest(mobius_file.parent)
    ref_run, auto, named = tmp_path / "mobius.h5", tmp_path / "auto.h5", tmp_path / "named.h5"
    assert invoke("replay", REF, "--runtime", "mobius", "-o", ref_run).exit_code == 0
    res = invoke("replay", REF, "--onnx", mobius_file, "-o", auto)
    assert res.exit_code == 0, res.output
    assert "map built-in mobius: embeddings, per_layer_inputs, q, k, v, attn_out, layer_out, final_hidden" in res.output
    assert "not mapped: rope_cos_sliding, rope_sin_sliding, rope_cos_full, rope_sin_full, mask" in res.output
    assert invoke("replay", REF, "--onnx", mobius_file, "--onnx-map", "mobius", "-o", named).exit_code == 0
    assert same_tensors(ref_run, auto) == same_tensors(ref_run, named) == 39
    res = diff_traces(REF, auto)  # the mobius row's profile: the built-in defaults
    assert res.match, res.to_json()["first_divergence"]
    assert {t.kind for t in res.tensors} >= {"embeddings", "per_layer_inputs", "q", "k", "v", "attn_out", "layer_out"}
    assert digest(mobius_file.parent) == before


@pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed")
def test_a_weight_changed_in_the_users_file_is_found_at_its_layer(mobius_file, tmp_path):
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(mobius_file))  # its external weights too
    (w,) = [t for t in model.graph.initializer if t.name == "model.layers.3.self_attn.v_proj.weight_t"]
    planted = numpy_helper.to_array(w).copy()
    planted[:, :4] *= 1.5
    w.CopyFrom(numpy_helper.from_array(planted, w.name))
    bad = tmp_path / "planted.onnx"
    onnx.save(model, str(bad))  # one file: the tiny model's weights fit
    out = tmp_path / "bad.h5"
    res = invoke("replay", REF, "--onnx", bad, "-o", out)
    assert res.exit_code == 0, res.output
    first = diff_traces(REF, out).to_json()["first_divergence"]
    assert (first["step"], first["layer"], first["kind"]) == (0, 3, "v"), first


CUSTOM = """\
# mobius's graph with its token input renamed to "tokens": layer outputs only
format = 1
layout = "kv-cache"
[inputs]
input_ids = "tokens"
[kinds]
layer_out = { node = "model/layers.{layer}/*", pick = "last", output = 0 }
final_hidden = { value = "FINAL" }
"""


@pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed")
def test_a_custom_map_of_a_subset_on_renamed_inputs(mobius_file, tmp_path):
    import onnx

    folder = tmp_path / "renamed"
    folder.mkdir()
    shutil.copyfile(mobius_file.parent / "model.onnx.data", folder / "model.onnx.data")
    model = onnx.load(str(mobius_file), load_external_data=False)
    g = model.graph
    for v in g.input:
        v.name = "tokens" if v.name == "input_ids" else v.name
    for n in g.node:
        n.input[:] = ["tokens" if i == "input_ids" else i for i in n.input]
        if n.name.startswith("model/norm/"):
            n.output[0] = "FINAL"
    for n in g.node:  # the final norm's readers
        n.input[:] = ["FINAL" if i == "v_model.norm.RMSNormalization_476" else i for i in n.input]
    onnx.save(model, str(folder / "mine.onnx"))
    mapping = tmp_path / "map.toml"
    mapping.write_text(CUSTOM)
    out, full = tmp_path / "sub.h5", tmp_path / "full.h5"
    res = invoke("replay", REF, "--onnx", folder / "mine.onnx", "--onnx-map", mapping, "-o", out)
    assert res.exit_code == 0, res.output
    assert "map map.toml sha256:" in res.output and "layer_out, final_hidden; not mapped: embeddings" in res.output
    with TraceReader(out) as r:
        assert {k for k, _ in r.kinds_present()} == {"layer_out", "final_hidden", "logits", "token"}
    res = diff_traces(REF, out)
    assert res.match, res.to_json()["first_divergence"]
    assert invoke("replay", REF, "--onnx", mobius_file, "--kinds", "layer_out,final_hidden", "-o", full).exit_code == 0
    with TraceReader(out) as a, TraceReader(full) as b:
        for site in a.kinds_present():
            assert np.array_equal(a.read(*site), b.read(*site)), site
