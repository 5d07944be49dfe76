"""`--runtime litert` and its quantized variants (REF's checkpoint exported by litert-torch's Gemma 4
path, run by ai-edge-litert) and `trace export-litert` (extra gemma4-trace[litert]).

The export costs about 40 s for the embedded 8-layer model, once per content (the suite's artifact
cache keeps it), so every replay here uses one export: max_seq 16, prefill chunks of 3 rows (a
7-row prefill: chunks 0-2, 3-5 and 6 with two pad rows), the quantized models from it in seconds."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (pip install -e '.[litert]')")
if importlib.util.find_spec("litert_torch") is None:  # not imported here: its TensorFlow costs each worker 4 s
    pytest.skip("litert-torch is not installed (pip install -e '.[litert]')", allow_module_level=True)

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import export as E  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import graph as G  # noqa: E402
from gemma4_trace.replayer.runtimes.litert.spec import LITERT  # noqa: E402
from gemma4_trace.traces.errors import TraceToolError  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error, same_figures  # noqa: E402

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

PROMPT = "2,17,33,40,51,60,71,80"  # 8 tokens: 7 through the prefill signature, the last through decode
MAX_SEQ, CHUNK = 16, 3
MODES = ("litert", "litert-int8", "litert-int8-dq", "litert-wi8", "litert-wi8-dq", "litert-int4")


def _replay(ref, out, runtime, *more, env=None):
    return invoke(
        "replay", ref, "--runtime", runtime, "--max-seq", MAX_SEQ, "--prefill-chunk", CHUNK, "-o", out, *more, env=env
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("litert")
    ref = d / "ref.h5"
    r = invoke("record", "--input-ids", PROMPT, "--max-new-tokens", "4", "-o", ref)
    assert r.exit_code == 0, r.output
    out = {"ref": ref, "dir": d}
    for mode in MODES:
        out[mode] = d / f"{mode}.h5"
        r = _replay(ref, out[mode], mode)
        assert r.exit_code == 0, r.output
        out[mode + ":summary"] = r.stdout
    r = _replay(ref, d / "free.h5", "litert", "--free-running")
    assert r.exit_code == 0, r.output
    out["free"] = d / "free.h5"
    return out


def test_float_replay_captures_every_kind_and_finds_the_missing_soft_cap(runs):
    """litert-torch 0.10.0's decode signature returns lm_head(hidden) without Gemma 4's final
    logit soft-cap (docs/upstream/litert-torch-softcap.md): everything before the logits
    matches HF at float32's defaults, the logits do not, and the hint names the cap."""
    ref, run = runs["ref"], runs["litert"]
    res = diff_traces(ref, run)
    first = res.to_json()["first_divergence"]
    assert (first["step"], first["kind"], first["position"]) == (0, "logits", 7), first
    assert res.to_json()["hint"]["name"] == "final logit soft-cap missing", res.to_json()["hint"]
    with TraceReader(ref) as a, TraceReader(run) as b:
        runtime = b.provenance["runtime"]
        assert runtime.startswith("litert (litert-torch 0.10.0, ai-edge-litert 2.3.0") and "float32" in runtime
        assert f"prefill {CHUNK}, cache 18" in runtime and "from decode steps" in runtime
        cfg = a.model_config
        cap = float(cfg.get("text_config", cfg)["final_logit_softcapping"])
        got, want = b.read("logits"), a.read("logits")  # (steps, vocab)
        assert np.abs(got - want).max(axis=1).min() > 1e-2  # the raw lm_head at every step
        assert np.abs(cap * np.tanh(got / cap) - want).max() < 1e-4  # ... one tanh away from REF's
        assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))  # greedy text hides it
        # the prefill rows of the layers pruned from the prefill graph (from decode steps) are all there
        last = len(a.layers) - 1
        assert b.read("layer_out", last).shape == a.read("layer_out", last).shape
    assert "4/4 tokens agree" in runs["litert:summary"]
    # the E2B-width float profile (diff/profiles/litert-f32.toml) still flags the missing cap here
    first = diff_traces(ref, run, tolerances_path="litert-f32").to_json()["first_divergence"]
    assert (first["kind"], first["position"]) == ("logits", 7), first


def test_free_running_replay_generates_the_reference_tokens(runs):
    with TraceReader(runs["ref"]) as a, TraceReader(runs["free"]) as b:
        assert b.mode == "free-running"
        assert list(b.tokens()) == list(a.tokens())


def test_quantized_replays_diverge_from_hf_and_not_from_their_dequantized_baseline(runs):
    ref = runs["ref"]
    for mode in ("litert-int8", "litert-wi8", "litert-int4"):
        with TraceReader(runs[mode]) as b:
            assert E.RECIPES[mode] in b.provenance["runtime"]
        first = diff_traces(ref, runs[mode]).to_json()["first_divergence"]
        assert first is not None and first["kind"] != "logits", (mode, first)  # quantization error comes first
    # int8 against its baseline (the same graph, the quantized weights in float32): nothing beyond the noise
    res = diff_traces(ref, runs["litert-int8"], baseline_path=runs["litert-int8-dq"])
    assert res.match, res.to_json()["first_divergence"]
    # weight-only int8 runs float kernels on the same weights: its baseline is nearly the same numbers
    with TraceReader(runs["litert-wi8"]) as b, TraceReader(runs["litert-wi8-dq"]) as c:
        for layer in range(len(b.layers)):
            x, y = b.read("layer_out", layer), c.read("layer_out", layer)
            assert np.linalg.norm(x - y) <= 1e-4 * np.linalg.norm(y), layer
        assert "dequantized into it" in c.provenance["runtime"]


def test_dequantized_weights_are_the_quantized_ones(tmp_path):
    """dequantize_into writes scale * (q - zero_point) of every quantized weight into the float file."""
    from ai_edge_litert import schema_py_generated as fb

    from gemma4_trace.hf.model import load_model

    loaded = load_model(weights=False)
    base, q = E.exported(loaded, MAX_SEQ, CHUNK), E.quantized(loaded, MAX_SEQ, CHUNK, "litert-int4")
    n = E.dequantize_into(base.path / "model.tflite", q.path / "model.tflite", tmp_path / "dq.tflite")
    assert n > 0
    fbuf, qbuf = bytearray((tmp_path / "dq.tflite").read_bytes()), bytearray((q.path / "model.tflite").read_bytes())
    fm, qm = fb.Model.GetRootAsModel(fbuf, 0), fb.Model.GetRootAsModel(qbuf, 0)
    g, h = fm.Subgraphs(0), qm.Subgraphs(0)
    checked = 0
    for i in range(h.TensorsLength()):
        t = h.Tensors(i)
        if t.Type() != E.INT4:
            continue
        want = E._dequantized(t, E._buffer_bytes(qm, qbuf, t.Buffer()))
        got = np.frombuffer(E._buffer_bytes(fm, fbuf, g.Tensors(i).Buffer()), "<f4").reshape(want.shape)
        assert np.array_equal(got, want)
        assert len(np.unique(got[0])) <= 16  # int4: at most 16 levels per channel
        checked += 1
    assert checked > 0


def test_the_graph_rules_find_every_layer_in_decode_and_the_first_layers_in_prefill():
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.traces.layers import layer_infos_from_config

    loaded = load_model(weights=False)
    cfg = loaded.text_config
    infos = layer_infos_from_config(cfg)
    art = E.exported(loaded, MAX_SEQ, CHUNK)
    sigs = G.read(art.path / "model.tflite")
    ple = (len(infos), cfg.hidden_size_per_layer_input)
    decode = G.taps(sigs["decode"], infos, cfg.hidden_size, ple)
    prefill = G.taps(sigs[f"prefill_{CHUNK}"], infos, cfg.hidden_size, ple)
    assert G.layers_present(decode) == set(range(len(infos)))
    assert G.layers_present(prefill) < set(range(len(infos)))  # pruned: what feeds no cache output
    # the decode graph holds every kind of LiteRT's capture map but those the runtime reads elsewhere
    # (the embedder's output, the caches, the logits output), at every layer
    elsewhere = ("embeddings", "k", "v", "logits", "token")
    want = {(s.kind, s.layer) for s in LITERT.sites(len(infos)) if s.kind not in elsewhere}
    assert {(t.kind, t.layer) for t in decode} == want
    assert len(G.cache_layers(sigs["decode"], infos)) == sum(x.kv_role != "reuses" for x in infos)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda b: b"not a flatbuffer at all", "not a LiteRT model (no TFL3 identifier)"),
        (lambda b: b[: len(b) // 3], "not a LiteRT model"),
        (lambda b: b[:4] + b"TFL3" + b"\xff" * 64, "not a LiteRT model"),
    ],
    ids=["garbage", "truncated", "hostile"],
)
def test_a_file_that_is_no_litert_model_is_one_line(tmp_path, damage, words):
    from gemma4_trace.hf.model import load_model

    art = E.exported(load_model(weights=False), MAX_SEQ, CHUNK)
    bad = tmp_path / "model.tflite"
    bad.write_bytes(damage((art.path / "model.tflite").read_bytes()))
    with pytest.raises(TraceToolError) as e:
        G.read(bad)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_vector_budget_refuses_a_quadratic_file():
    budget = G._Budget(100)
    budget.take(50)
    with pytest.raises(ValueError, match="more than the file"):
        budget.take(10**6)


def test_the_interpreter_refusing_a_file_is_one_line(tmp_path):
    from gemma4_trace.replayer.child import Child
    from gemma4_trace.replayer.runtimes.litert.runtime import ENGINE

    bad = tmp_path / "model.tflite"
    bad.write_bytes(b"TFL3" * 64)
    child = Child("litert (test)", ENGINE)
    try:
        with pytest.raises(TraceToolError) as e:
            child.call("load", {"model": str(bad)}, ["model"], phase="loading")
    finally:
        child.close()
    line = str(e.value)
    assert line.startswith("litert (test) failed in loading: ") and "LiteRT cannot load it" in line, line


def test_a_crash_in_the_interpreter_is_one_line_and_leaves_no_trace(runs, tmp_path):
    out = tmp_path / "crash.h5"
    r = _replay(runs["ref"], out, "litert", env={"GEMMA4_TRACE_TEST_NATIVE_CRASH": "decode step 2"})
    one_line_error(r, "litert (ai-edge-litert 2.3.0) crashed in decode step 2: killed by SIGSEGV", out=out)


def test_export_litert_writes_the_files_the_replay_ran(runs, tmp_path):
    out = tmp_path / "files"
    r = invoke("export-litert", "--max-seq", MAX_SEQ, "--prefill-chunk", CHUNK, "-o", out)
    assert r.exit_code == 0, r.output
    assert "model.litertlm" in r.stdout and "from the artifact cache" not in r.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted([*E.FILES, E.BUNDLE])
    assert set(G.read(out / "model.tflite")) == {f"prefill_{CHUNK}", "decode"}
    r = invoke("export-litert", "--runtime", "litert-int8", "--max-seq", MAX_SEQ, "--prefill-chunk", CHUNK, "-o", out)
    one_line_error(r, "exist")  # the float files are there: --force replaces them
    r = invoke(
        "export-litert",
        "--runtime",
        "litert-int8",
        "--max-seq",
        MAX_SEQ,
        "--prefill-chunk",
        CHUNK,
        "-o",
        out,
        "--force",
    )
    assert r.exit_code == 0, r.output
    assert G.read(out / "model.tflite")  # the quantized graph, still a LiteRT model


def test_checkpoints_the_export_cannot_take_are_refused_before_it_runs(tmp_path):
    from tests.support import tiny_models

    model = tiny_models.build(
        tmp_path / "causal",
        num_hidden_layers=2,
        layer_types=[tiny_models.S, tiny_models.F],
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
    )
    r = invoke("export-litert", "--model", model, "--max-seq", 8, "-o", tmp_path / "o")
    one_line_error(r, "has no tokenizer.json or tokenizer.model")
    (model / "tokenizer.json").write_text("{}")  # damaged: transformers fails with a KeyError
    r = invoke("export-litert", "--model", model, "--max-seq", 8, "-o", tmp_path / "o")
    one_line_error(r, "cannot load the tokenizer/processor in", "KeyError")
    from gemma4_trace.hf.model import resolve_model_dir

    embedded = resolve_model_dir(None)[0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((embedded / name).read_bytes())
    r = invoke("export-litert", "--model", model, "--max-seq", 8, "-o", tmp_path / "o")
    one_line_error(r, "is a Gemma4ForCausalLM checkpoint", "takes Gemma4ForConditionalGeneration")


class _Marker:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):  # unpickling this creates the marker file: code from the checkpoint ran
        return (open, (self.path, "w"))


def test_the_export_reads_the_safetensors_never_a_pickled_checkpoint(tmp_path):
    """A folder whose safetensors are a decoy beside a pytorch_model.bin: litert-torch's export
    reads the folder itself, and it is given only the files the artifact key covers, so the
    pickle is never loaded (the export fails on the decoy, in one line) and never keys a cache hit."""
    import pickle
    import shutil

    import torch
    from safetensors.torch import save_file

    from gemma4_trace.hf.model import resolve_model_dir
    from gemma4_trace.replayer.artifacts import model_hash

    embedded, model = resolve_model_dir(None)[0], tmp_path / "decoy"
    shutil.copytree(embedded, model, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({"x": torch.zeros(1)}, model / "decoy.safetensors")
    marker = tmp_path / "ran"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(marker)))
    r = invoke("export-litert", "--model", model, "--max-seq", 8, "-o", tmp_path / "o")
    assert not marker.exists(), "the export unpickled pytorch_model.bin"
    assert r.exit_code == 2 and "no file named model.safetensors" in r.output, r.output
    assert not any((tmp_path / "o").glob("*"))  # nothing written
    before = model_hash(model)
    (model / "pytorch_model.bin").write_bytes(b"another checkpoint")  # never read: not in the key either
    assert model_hash(model) == before
    (model / "tokenizer.model").write_bytes(b"a sentencepiece model")  # read by a tokenizer: in the key
    assert model_hash(model) != before


def test_text_only_and_float32_only_refusals_come_before_any_export(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("exported before refusing")

    monkeypatch.setattr(E, "exported", refuse)
    # litert runs images (tests/runtimes/test_litert_vision.py); litert-convert takes token ids only
    r = invoke("replay", golden_path("image"), "--runtime", "litert-convert", "-o", tmp_path / "o.h5")
    one_line_error(r, "--runtime litert-convert runs a text decoder", out=tmp_path / "o.h5")
    r = invoke("replay", golden_path("short"), "--runtime", "litert-int8", "--isolate", "-o", tmp_path / "o.h5")
    one_line_error(r, "does not support --isolate", out=tmp_path / "o.h5")


def test_litert_convert_of_hf_forward_finds_the_gqa_lowering_bug(runs, tmp_path):
    """litert_torch.convert of transformers' own forward (docs/upstream/litert-torch-gqa-transpose.md):
    q, K, V and the mask of layer 0 match HF; its attention output does not, from the first
    position with two keys (position 0 attends to one key: softmax makes any score 1)."""
    out = tmp_path / "conv.h5"
    r = invoke("replay", runs["ref"], "--runtime", "litert-convert", "--max-seq", MAX_SEQ, "-o", out)
    assert r.exit_code == 0, r.output
    res = diff_traces(runs["ref"], out).to_json()
    first = res["first_divergence"]
    assert (first["step"], first["layer"], first["kind"], first["position"]) == (0, 0, "attn_out", 1), first
    assert first["value"] > 0.1
    # the signature is named: scores wrong from the first query with two keys, at a GQA broadcast
    assert res["hint"]["name"] == "attention scores wrong", res.get("hint")
    assert "broadcasts 1 KV head(s) to 4 query heads" in res["hint"]["evidence"], res["hint"]
    with TraceReader(runs["ref"]) as a, TraceReader(out) as b:
        assert "litert_torch.convert" in b.provenance["runtime"]
        for kind in ("q", "k", "v"):
            x, y = a.read(kind, 0), b.read(kind, 0)
            assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(x), kind
        x, y = a.read("mask", 0), b.read("mask", 0)  # REF's rows end at its last position, RUN's at max_seq
        assert np.array_equal(x, y[:, : x.shape[1]]) and not y[:, x.shape[1] :].any()


def test_litert_convert_with_kinds_converts_only_those_outputs(runs, tmp_path):
    """`--kinds layer_out`: the converted graph's outputs are the logits and each layer's output
    (the rest pruned), the trace holds only those, and they are what the full conversion gives."""
    full, narrow = tmp_path / "full.h5", tmp_path / "narrow.h5"
    for out, more in ((full, ()), (narrow, ("--kinds", "layer_out"))):
        r = invoke("replay", runs["ref"], "--runtime", "litert-convert", "--max-seq", MAX_SEQ, *more, "-o", out)
        assert r.exit_code == 0, r.output
    with TraceReader(full) as a, TraceReader(narrow) as b:
        kept = [(k, layer) for k, layer in a.kinds_present() if k in ("layer_out", "logits")]
        assert len(kept) > 2 and len(a.kinds_present()) > len(kept) + 5
        assert [p for p in b.kinds_present() if p[0] != "token"] == kept
        for kind, layer in kept:
            x, y = a.read(kind, layer), b.read(kind, layer)
            assert x.shape == y.shape and np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(x), (kind, layer)
        assert np.array_equal(a.tokens(), b.tokens())


def test_the_converted_wrapper_returns_only_the_asked_kinds():
    """HFSteps (what litert-convert converts) in eager PyTorch: every kind, one kind, or the logits alone."""
    import torch

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.runtimes.litert.convert import HFSteps

    lm = load_model()
    ids = torch.tensor([[2, 10, 11, 12]])
    with torch.no_grad():
        every = HFSteps(lm)
        outs = every(ids)
        kinds = {k for k, _ in every.names}
        # (q, K, V and the mask come from the attention function _convert installs: not here)
        assert {"embeddings", "attn_out", "layer_out", "final_hidden"} <= kinds
        assert len(outs) == 1 + len(every.names)
        one = HFSteps(lm, frozenset({"layer_out"}))
        only = one(ids)
        assert {k for k, _ in one.names} == {"layer_out"} and len(only) == 1 + len(one.names)
        assert torch.equal(only[0], outs[0])
        for name, value in zip(one.names, only[1:]):
            assert torch.equal(value, outs[1 + every.names.index(name)]), name
        none = HFSteps(lm, frozenset())
        assert len(none(ids)) == 1 and none.names == []


def test_the_minimal_repro_of_the_gqa_lowering_bug_still_fails():
    """Pinned: litert-torch 0.10.0 converts `q @ k.expand(...).transpose(2, 3)` (one KV head
    broadcast to the query heads, then its last two axes swapped) without error and computes
    q @ k, the transpose lost. When this fails, the bug is fixed upstream: update
    docs/upstream/litert-torch-gqa-transpose.md and the LiteRT docs."""
    import subprocess
    import sys

    code = """
import contextlib, io, numpy as np, torch, litert_torch
from ai_edge_litert.interpreter import Interpreter
class Scores(torch.nn.Module):
    def forward(self, q, k):
        return q @ k.expand(1, 2, 8, 8).transpose(2, 3)
torch.manual_seed(0)
q, k = torch.randn(1, 2, 8, 8), torch.randn(1, 1, 8, 8)
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    litert_torch.convert(Scores().eval(), (q, k)).export("scores.tflite")
run = Interpreter(model_path="scores.tflite").get_signature_runner()
got = list(run(args_0=q.numpy(), args_1=k.numpy()).values())[0]
print(float(np.abs(got - (q @ k.expand(1, 2, 8, 8).transpose(2, 3)).numpy()).max()),
      float(np.abs(got - (q @ k.expand(1, 2, 8, 8)).numpy()).max()))
"""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    wrong, untransposed = (float(x) for x in r.stdout.split()[-2:])
    assert wrong > 1.0 and untransposed < 1e-5, r.stdout  # the transpose dropped; the rest float rounding


def _graph_names(graph) -> set[str]:
    """Every node id and output tensor name of a Model Explorer graph (its adapters' dataclasses or dicts)."""
    nodes = graph["nodes"] if isinstance(graph, dict) else graph.nodes
    names = set()
    for n in nodes:
        n = n if isinstance(n, dict) else vars(n)
        names.add(n["id"])
        for md in n["outputsMetadata"]:
            for a in md["attrs"] if isinstance(md, dict) else md.attrs:
                a = a if isinstance(a, dict) else vars(a)
                if a["key"] == "tensor_name":
                    names.add(a["value"])
    return names


def _load_node_data(path):
    """The overlay read with Model Explorer's own dataclasses (dacite, as its runner reads its JSON)."""
    import json

    import dacite
    from model_explorer.node_data_builder import GraphNodeData, ModelNodeData

    data = json.loads(path.read_text())
    return ModelNodeData(graphsData={k: dacite.from_dict(GraphNodeData, v) for k, v in data.items()})


def test_node_data_overlays_the_litert_graph_and_the_static_runtimes(runs, tmp_path):
    from model_explorer.builtin_pytorch_exportedprogram_adapter import BuiltinPytorchExportedProgramAdapter
    from model_explorer.builtin_tflite_flatbuffer_adapter import BuiltinTfliteFlatbufferAdapter

    files = tmp_path / "files"
    r = invoke("export-litert", "--max-seq", MAX_SEQ, "--prefill-chunk", CHUNK, "-o", files)
    assert r.exit_code == 0, r.output
    nd = tmp_path / "litert.json"
    r = invoke("diff", runs["ref"], runs["litert"], "--node-data", nd, "--graph", files / "model.tflite")
    assert r.exit_code == 1, r.output
    data = _load_node_data(nd)
    assert set(data.graphsData) == {f"prefill_{CHUNK}", "decode"}
    graphs = {
        g.id if hasattr(g, "id") else g["id"]: g
        for g in BuiltinTfliteFlatbufferAdapter().convert(str(files / "model.tflite"), {})["graphCollections"][0].graphs
    }
    for gid, g in data.graphsData.items():
        assert set(g.results) <= _graph_names(graphs[gid]), gid  # every key names a node of Model Explorer's graph
    red = [k for k, v in data.graphsData["decode"].results.items() if v.bgColor]
    assert len(red) == 1 and data.graphsData["decode"].results[red[0]].value > 1  # the logits: the first divergence
    assert all(v.value <= 1 for k, v in data.graphsData["decode"].results.items() if k not in red)

    # the static runtime's step graph, as torch.export saved it
    pt2 = tmp_path / "pt2"
    r = invoke("export-pt2", "--max-seq", MAX_SEQ, "-o", pt2)
    assert r.exit_code == 0, r.output
    static = tmp_path / "static.h5"
    assert invoke("replay", runs["ref"], "--max-seq", MAX_SEQ, "-o", static).exit_code == 0
    nd2 = tmp_path / "static.json"
    r = invoke("diff", runs["ref"], static, "--node-data", nd2, "--graph", pt2 / "decode.pt2")
    assert r.exit_code == 0, r.output
    (graph,) = BuiltinPytorchExportedProgramAdapter().convert(
        str(pt2 / "decode.pt2"), {"const_element_count_limit": 16}
    )["graphs"]
    data = _load_node_data(nd2)
    with TraceReader(static) as b:
        kinds = [k for k, _ in b.kinds_present() if k != "token"]  # every kind, logits included (the token has no node)
        assert len(data.graphsData["graph"].results) == len(kinds)
    assert set(data.graphsData["graph"].results) <= _graph_names(graph)


def test_node_data_bad_input_is_one_line(runs, tmp_path):
    nd = tmp_path / "o.json"
    r = invoke("diff", runs["ref"], runs["litert"], "--node-data", nd)
    one_line_error(r, "--node-data FILE.json and --graph MODEL go together", out=nd)
    for name, data in (("model.onnx", b"x"), ("model.tflite", b"garbage"), ("decode.pt2", b"PK\x03\x04junk")):
        bad = tmp_path / name
        bad.write_bytes(data)
        r = invoke("diff", runs["ref"], runs["litert"], "--node-data", nd, "--graph", bad)
        one_line_error(r, str(bad), out=nd)


def test_litert_lm_replays_tokens_only_and_the_diff_compares_them(runs, tmp_path):
    """LiteRT-LM takes text and gives text: the trace holds its tokens alone, the diff compares
    them and lists everything else as not compared (a RUN with tensors but no logits still diverges)."""
    ref = tmp_path / "text.h5"  # a text prompt: LiteRT-LM reads text (REF's ids must be what its tokenizer makes)
    r = invoke("record", "--prompt", "Once upon a time", "--no-chat", "--max-new-tokens", 4, "-o", ref)
    assert r.exit_code == 0, r.output
    for mode in ("--teacher-forcing", "--free-running"):
        out = tmp_path / f"lm{mode}.h5"
        r = _replay(ref, out, "litert-lm", mode)  # the litert replays' export: LiteRT-LM runs its .litertlm
        assert r.exit_code == 0, r.output
        with TraceReader(ref) as a, TraceReader(out) as b:  # the token alone: its capture map's (test_conformance.py)
            assert list(b.tokens()) == list(a.tokens())
            assert "tokens only" in b.provenance["runtime"]
        res = diff_traces(ref, out).to_json()
        assert res["match"] and res["first_divergence"] is None
        assert {"kind": "logits", "layer": None, "reason": "only in REF"} in [
            {k: s[k] for k in ("kind", "layer", "reason")} for s in res["skipped"]
        ]


def test_litert_lm_replays_the_shipped_goldens(tmp_path):
    """short.h5's prompt and new tokens fill its max_seq (16): the last step prefills 15 tokens and
    decodes one, and LiteRT-LM needs room past that in its cache (a bundle with a cache of max_seq
    failed: `litert_lm_session_run_prefill failed` in decode step 2; lm.ROOM). In window.h5, decode
    step 19's token is ".", which begins one of the bundle's stop sequences: LiteRT-LM withholds its
    text (it decoded '' and the replay died); two tokens show it, and the replay says so."""
    for name, steps in (("short", 3), ("window", 24)):
        out = tmp_path / f"{name}.h5"
        r = invoke("replay", golden_path(name), "--runtime", "litert-lm", "-o", out)
        assert r.exit_code == 0, r.output
        assert f"{steps}/{steps} tokens agree" in r.stdout
        assert diff_traces(golden_path(name), out).match
    assert "note: decode step 19: LiteRT-LM's token 291: its text withheld by a stop sequence" in r.stderr


def test_litert_lm_replays_the_image_golden_through_its_conversation_api(tmp_path):
    """LiteRT-LM takes an image only as a file, through its Conversation API (docs/runtime-litert.md,
    "LiteRT-LM and images"): the image a PNG rebuilt from REF's pixel_values, the bundle litert-torch's
    export with its vision encoder, its adapter and its vision metadata fixed, each fix said on stderr
    and in the runtime's name. 10 of 11 tokens are REF's; the 11th, REF's <turn|>, shows no text (a stop
    token), recorded as the bundle's first one-token stop, <eos> (1). A bundle without vision sections
    (yours, `--litertlm`) is one line; so is REF's image where the processor would not give its
    pixel_values back from the PNG."""
    import shutil

    import h5py

    from gemma4_trace.hf.model import load_model

    golden, out, yours = golden_path("image"), tmp_path / "image.h5", tmp_path / "yours.h5"
    r = invoke("replay", golden, "--runtime", "litert-lm", "-o", out)
    assert r.exit_code == 0, r.output
    assert "10/11 tokens agree" in r.stdout
    for said in (
        "note: litert: vision_adapter.tflite (embed_vision) exported with the tower's hidden size 32",
        "note: litert-lm: model.litertlm's Gemma 4 vision metadata rebuilt with the model's pooling_kernel_size 2 "
        "and max_num_patches 280; litert-torch 0.10.0 writes 3 x 3 pooling (max_num_patches 630)",
        "note: decode step 10: LiteRT-LM's token 1: no text: a stop token",
    ):
        assert said in r.stderr, r.stderr
    with TraceReader(golden) as a, TraceReader(out) as b:
        ref, got = list(a.tokens()), list(b.tokens())
        name = b.provenance["runtime"]
    assert got[:10] == ref[:10] and (ref[10], got[10]) == (6, 1), (ref, got)
    fixes = ("its adapter's input sized by the tower's hidden size", "vision metadata rebuilt for 2 x 2 pooling")
    for part in (
        "tokens only",
        "images: PNG files rebuilt from REF's pixel_values, through its Conversation API",
        *fixes,
    ):
        assert part in name, name
    first = diff_traces(golden, out).to_json()["first_divergence"]
    assert (first["step"], first["kind"]) == (10, "token"), first
    art = E.exported(load_model(weights=False), MAX_SEQ, CHUNK)  # a text-only bundle (the one the tests share)
    try:
        r = invoke("replay", golden, "--runtime", "litert-lm", "--litertlm", art.path / E.BUNDLE, "-o", yours)
    finally:
        art.close()
    one_line_error(r, "the bundle has no vision sections (LiteRT-LM reads it as text only)", out=yours)
    resized = tmp_path / "resized.h5"
    shutil.copy(golden, resized)
    with h5py.File(resized, "r+") as f:
        f["inputs/extra/pixel_values"][0, 0, 0] += 0.5 / 255  # no 8-bit image's pixel
    r = invoke("replay", resized, "--runtime", "litert-lm", "-o", tmp_path / "o.h5")
    one_line_error(
        r, "--runtime litert-lm takes an image as a file, and REF's image 1 is no file's", out=tmp_path / "o.h5"
    )


def test_litert_lm_says_its_vision_fixes_only_where_they_apply():
    """Real checkpoints pool 3 x 3 (the bundle's metadata as litert-torch writes it) and their tower's
    hidden size is the patch width (E2B: 768): neither fix applies, nothing is said."""
    from types import SimpleNamespace

    assert E.metadata_note(SimpleNamespace(pooling_kernel_size=3), 280) is None
    assert E.adapter_note(SimpleNamespace(hidden_size=768, patch_size=16)) is None
    assert "pooling_kernel_size 2 and max_num_patches 280" in E.metadata_note(
        SimpleNamespace(pooling_kernel_size=2), 70
    )


def test_the_litertlm_vision_metadata_repro_script_still_shows_3x3_pooling():
    """Pinned: docs/upstream/litert_torch_litertlm_vision_metadata_repro.py (litert-torch's Gemma 4
    metadata builder asked as its package step asks it) exits 1 with the write-up's line. When it exits
    0, a litert-torch bundle's vision metadata fits the embedded model: export.py's metadata_note can go."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "docs" / "upstream" / "litert_torch_litertlm_vision_metadata_repro.py"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=root)
    assert p.returncode == 1, p.stderr[-2000:]
    doc = (root / "docs" / "upstream" / "litert-torch-litertlm-vision-metadata.md").read_text().splitlines()
    start = doc.index("    $ python docs/upstream/litert_torch_litertlm_vision_metadata_repro.py") + 1
    assert p.stdout.splitlines()[-1] == doc[start].strip(), p.stdout


def test_litert_lm_bad_files_are_one_line(runs, tmp_path):
    from gemma4_trace.hf.model import load_model

    art = E.exported(load_model(weights=False), MAX_SEQ, CHUNK)
    good = (art.path / E.BUNDLE).read_bytes()
    out = tmp_path / "o.h5"
    r = invoke("replay", runs["ref"], "--runtime", "litert", "--litertlm", art.path / E.BUNDLE, "-o", out)
    one_line_error(r, "--litertlm FILE is run by --runtime litert-lm; it takes no --runtime litert", out=out)
    r = invoke("replay", runs["ref"], "--runtime", "litert-lm", "--litertlm", tmp_path / "none.litertlm", "-o", out)
    one_line_error(r, "none.litertlm", out=out)
    # REF's prompt is token ids that are no text LiteRT-LM's tokenizer makes: refused, not guessed
    r = _replay(runs["ref"], out, "litert-lm")
    one_line_error(r, "LiteRT-LM's tokenizer reads the context back as", out=out)
    for name, data in (("garbage.litertlm", b"not a bundle" * 100), ("truncated.litertlm", good[: len(good) // 2])):
        (tmp_path / name).write_bytes(data)
        r = invoke("replay", runs["ref"], "--runtime", "litert-lm", "--litertlm", tmp_path / name, "-o", out)
        one_line_error(r, "litert-lm (LiteRT-LM 0.18.1)", out=out)


def test_the_docs_quote_the_lines_these_replays_print(runs, tmp_path):
    """docs/runtime-litert.md, docs/bug-zoo.md and docs/upstream/ quote the first lines of
    `trace diff` for the two litert-torch bugs: these replays (the docs' REF and settings) print them."""
    from pathlib import Path

    from gemma4_trace.diff import format_text

    root = Path(__file__).resolve().parents[2]
    docs = {p: p.read_text() for p in (root / "docs/runtime-litert.md", root / "docs/bug-zoo.md")}
    upstream = {p: p.read_text() for p in (root / "docs/upstream").glob("litert-*.md")}
    conv = tmp_path / "conv.h5"
    assert invoke("replay", runs["ref"], "--runtime", "litert-convert", "--max-seq", MAX_SEQ, "-o", conv).exit_code == 0
    for run, keep in ((runs["litert"], ("first divergence", "looks like")), (conv, ("first divergence",))):
        lines = [
            ln.strip() for ln in format_text(diff_traces(runs["ref"], run)).splitlines() if ln.strip().startswith(keep)
        ]
        assert lines
        for line in map(_rounding_masked, lines):
            for path, text in docs.items():
                assert line in _rounding_masked(text), (path.name, line)
            assert any(line in _rounding_masked(text) for text in upstream.values()), line
    int8 = format_text(diff_traces(runs["ref"], runs["litert-int8"])).splitlines()[0]
    assert int8 in docs[root / "docs/runtime-litert.md"]


def _rounding_masked(text: str) -> str:
    """Figures of float32 rounding size (below 1e-5: they move with the CPU XNNPACK runs on) as "~0"."""
    import re

    return re.sub(r"\b\d(\.\d+)?e-(0?[6-9]|[1-9]\d)\b", "~0", text)


def test_the_softcap_repro_script_still_shows_the_missing_cap(tmp_path):
    """Pinned: docs/upstream/litert_torch_softcap_repro.py, run on the suite's cached export (its
    --exported option: the same export_hf command it runs itself), prints what the write-up shows
    and exits 1. It imports nothing of this repository. When it exits 0, the bug is fixed upstream:
    update docs/upstream/litert-torch-softcap.md and the LiteRT docs."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "docs" / "upstream" / "litert_torch_softcap_repro.py"
    imported = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(ast.parse(script.read_text()))
        if isinstance(n, ast.Import) or (isinstance(n, ast.ImportFrom) and n.level == 0)
        for a in n.names
    }
    assert imported <= {"__future__", "argparse", "json", "subprocess", "sys", "tempfile", "pathlib", "numpy",
                        "torch", "ai_edge_litert", "transformers"}, imported  # fmt: skip
    files = tmp_path / "files"
    r = invoke("export-litert", "--max-seq", MAX_SEQ, "--prefill-chunk", CHUNK, "-o", files)
    assert r.exit_code == 0, r.output
    p = subprocess.run(
        [sys.executable, str(script), "--exported", str(files)], capture_output=True, text=True, timeout=600, cwd=root
    )
    assert p.returncode == 1, p.stderr[-2000:]
    doc = (root / "docs" / "upstream" / "litert-torch-softcap.md").read_text().splitlines()
    start = doc.index("    $ python docs/upstream/litert_torch_softcap_repro.py") + 1
    shown = [ln.strip() for ln in doc[start : start + 3]]
    # the capped logits' distance is float32 rounding (2.4e-06 on the doc's CPU, 3.3e-06 on another)
    real = p.stdout.splitlines()
    assert len(real) == 3 and all(same_figures(a, b, rounding=1e-4) for a, b in zip(real, shown)), (real, shown)


def test_a_quantized_export_says_the_time_of_each_of_its_two_builds(tmp_path):
    """export-litert --runtime litert-int8 builds the float export, then quantizes it: the summary
    gives each its own time (it used to give the quantization's alone after a long export)."""
    import re

    r = invoke("export-litert", "--runtime", "litert-int8", "--max-seq", MAX_SEQ, "--prefill-chunk", CHUNK,
               "-o", tmp_path / "q")  # fmt: skip
    assert r.exit_code == 0, r.output
    how = r"(cached|built in [0-9.]+ s)"
    assert re.search(rf"\(the float export {how}, the litert-int8 model {how}\)$", r.stdout.strip()), r.stdout
