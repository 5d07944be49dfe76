"""Trust of the graph files `trace diff --node-data OUT --graph FILE` reads to place the overlay:
a `.pt2` is read from its archive's JSON parts alone (nothing in it is unpickled or run), within
bounds; a `.tflite`'s tensors, operators and signatures are counted before any is built, and its
walks visit each tensor once; every damaged or hostile file is one line, exit 2, and no overlay
written.
docs/robustness.md, "Threat model"."""

from __future__ import annotations

import importlib.util
import json
import pickle
import zipfile
from pathlib import Path

import pytest

from tests.support.cli import invoke, one_line_error

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "traces" / "golden" / "short.h5"


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """The embedded model's decode step as `trace export-pt2` writes it, for GOLDEN's 15 positions."""
    out = tmp_path_factory.mktemp("pt2")
    r = invoke("export-pt2", "--max-seq", 16, "-o", out)
    assert r.exit_code == 0, r.output
    return out / "decode.pt2"


def rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of the archive src with change(name, bytes) -> bytes | None (None: left out) per entry."""
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
        for info in a.infolist():
            data = change(info.filename, a.read(info))
            if data is not None:
                b.writestr(info.filename, data)
    return dst


class Marker:
    """Unpickling this touches `path`: proof that code in the archive ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def diff(graph: Path, nd: Path):
    return invoke("diff", GOLDEN, GOLDEN, "--node-data", nd, "--graph", graph)


@pytest.mark.parametrize("where", ["sample inputs", "a constant"])
def test_a_program_whose_pickles_would_run_code_is_read_without_running_them(program, tmp_path, where):
    """The sample inputs (a legacy pickle here) and a constant marked `use_pickle` are what
    torch.export.load unpickles: the overlay is made from the graph's JSON and the marker file
    is never created."""
    marker = tmp_path / "ran"
    evil = pickle.dumps(Marker(marker))
    constant = ""

    def change(name, data):
        nonlocal constant
        if where == "sample inputs":
            return evil if name.endswith("sample_inputs/model.pt") else data
        if name.endswith("model_constants_config.json"):  # the first constant, marked as a pickle
            cfg = json.loads(data)
            entry = next(iter(cfg["config"].values()))
            entry["use_pickle"], constant = True, entry["path_name"]
            return json.dumps(cfg).encode()
        return data

    graph = rewrite(program, tmp_path / "decode.pt2", change)
    if where == "a constant":  # its data file, now a pickle (the config is written before it in the archive)
        graph = rewrite(graph, tmp_path / "evil.pt2", lambda n, b: evil if n.endswith(f"constants/{constant}") else b)
    nd = tmp_path / "nd.json"
    r = diff(graph, nd)
    assert not marker.exists(), "code in the .pt2 ran"
    assert r.exit_code == 0, r.output
    results = json.loads(nd.read_text())["graph"]["results"]
    assert len(results) == 50 and all(v["value"] == 0 for v in results.values())


def names(edit):
    """A change of the outputs' names entry: edit(list) -> a JSON value."""
    return lambda n, b: json.dumps(edit(json.loads(b))).encode() if "/extra/" in n else b


def graph(edit):
    """A change of the serialized graph entry: edit(bytes) -> bytes."""
    return lambda n, b: edit(b) if n.endswith("models/model.json") else b


HOSTILE = {
    "not a zip": lambda p, d: d.write_bytes(b"PK\x03\x04" + b"\0" * 100),
    "truncated": lambda p, d: d.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "no graph": lambda p, d: rewrite(p, d, lambda n, b: None if n.endswith("model.json") else b),
    "no outputs' names": lambda p, d: rewrite(p, d, lambda n, b: None if "/extra/" in n else b),
    "names not a list": lambda p, d: rewrite(p, d, names(lambda v: {"a": 1})),
    "one name short": lambda p, d: rewrite(p, d, names(lambda v: v[:-1])),
    "names not strings": lambda p, d: rewrite(p, d, names(lambda v: [[1]] * len(v))),
    "an unknown output": lambda p, d: rewrite(p, d, names(lambda v: ["L99.nothing"] * len(v))),
    "graph not JSON": lambda p, d: rewrite(p, d, graph(lambda b: b"\xff{")),
    "graph nested deep": lambda p, d: rewrite(p, d, graph(lambda b: b"[" * 200_000 + b"]" * 200_000)),
    "specs without names": lambda p, d: rewrite(p, d, graph(lambda b: b.replace(b'{"name"', b'{"nam"'))),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_damaged_or_hostile_program_is_one_line(program, tmp_path, case):
    graph = tmp_path / "decode.pt2"
    HOSTILE[case](program, graph)
    nd = tmp_path / "nd.json"
    one_line_error(diff(graph, nd), "decode.pt2", out=nd)


def test_a_program_over_the_bounds_is_refused_before_it_is_read(program, tmp_path, monkeypatch):
    """Many entries, or a graph entry larger than the bound (as its header says, or as it inflates)."""
    from gemma4_trace.replayer import node_data

    nd = tmp_path / "nd.json"
    many = tmp_path / "many.pt2"
    with zipfile.ZipFile(many, "w") as z:
        for i in range(node_data.PT2_MAX_ENTRIES + 1):
            z.writestr(f"decode/data/x{i}", b"")
    one_line_error(diff(many, nd), "over 65536 files", out=nd)
    monkeypatch.setattr(node_data, "PT2_MAX_JSON", 1000)  # the real graph (about 1 MiB) is then over the bound
    one_line_error(diff(program, nd), "model.json", out=nd)
    lying = tmp_path / "lying.pt2"  # a header that says 10 bytes for an entry that inflates to 1 MiB
    with zipfile.ZipFile(program) as z:
        size = next(i for i in z.infolist() if i.filename.endswith("models/model.json")).file_size
    assert size > 1000
    raw = program.read_bytes().replace(size.to_bytes(4, "little"), (10).to_bytes(4, "little"))  # both headers
    lying.write_bytes(raw)
    one_line_error(diff(lying, nd), "lying.pt2", out=nd)


# ---------------------------------------------------------------- .tflite (LiteRT)
def tflite(path: Path, n_tensors: int, ops: list[tuple[int, list[int], list[int]]], signatures: int = 1) -> Path:
    """A .tflite flatbuffer (ai-edge-litert's schema) of one subgraph: n_tensors tensors named
    t0, t1, ... and ops (builtin code, inputs, outputs), under `signatures` signatures."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb

    model, sg = fb.ModelT(), fb.SubGraphT()
    model.version = 3
    codes = sorted({c for c, _, _ in ops}) or [fb.BuiltinOperator.ADD]
    model.operatorCodes = []
    for c in codes:
        oc = fb.OperatorCodeT()
        oc.builtinCode, oc.deprecatedBuiltinCode = c, min(c, 127)
        model.operatorCodes.append(oc)
    sg.tensors = []
    for i in range(n_tensors):
        t = fb.TensorT()
        t.name, t.shape = f"t{i}".encode(), [1]
        sg.tensors.append(t)
    sg.operators = []
    for c, ins, outs in ops:
        op = fb.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = codes.index(c), ins, outs
        sg.operators.append(op)
    model.subgraphs, model.buffers, model.signatureDefs = [sg], [fb.BufferT()], []
    for s in range(signatures):
        sd = fb.SignatureDefT()
        sd.signatureKey, sd.subgraphIndex, sd.inputs, sd.outputs = f"sig{s}".encode(), 0, [], []
        model.signatureDefs.append(sd)
    b = flatbuffers.Builder(1024)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    path.write_bytes(bytes(b.Output()))
    return path


needs_litert = pytest.mark.skipif(
    importlib.util.find_spec("ai_edge_litert") is None, reason="needs the [litert] extra (ai-edge-litert)"
)


@needs_litert
def test_a_graph_that_reaches_one_tensor_by_many_paths_is_walked_once_per_tensor():
    """A rotary table consumed by ops that list it, and output their result, many times over: the
    walk from it (which layers its values reach) visits each op once; it used to follow every
    path, (fan^2)^hops of them (a 692-byte file ran past 300 s)."""
    from gemma4_trace.recorder.golden import golden_path
    from gemma4_trace.replayer.runtimes.litert import graph as G
    from gemma4_trace.traces.reader import TraceReader

    fan, chain = 6, 6
    tensors = [G.Tensor(0, "model/rotary_emb", (1, 8)), G.Tensor(1, "model/rotary_emb/cos", (1, 8))]
    ops = [("COS", [0], [1])]
    for k in range(chain):  # op k+1: tensor k+1 in `fan` times, tensor k+2 out `fan` times
        tensors.append(G.Tensor(k + 2, f"model/x{k}", (1, 8)))
        ops.append(("MUL", [k + 1] * fan, [k + 2] * fan))

    class Counted(dict):
        asked = 0

        def get(self, key, default=None):
            Counted.asked += 1
            return super().get(key, default)

    sig = G.Signature("decode", 0, tensors, ops, producer={}, consumers=Counted())
    for k, (_, ins, outs) in enumerate(ops):
        for t in outs:
            sig.producer[t] = k
        for t in ins:
            sig.consumers.setdefault(t, []).append(k)
    with TraceReader(golden_path("short")) as ref:
        infos = list(ref.layers)
    assert G.taps(sig, infos, 64, None) == []  # no layer is reached: no rotary table is kept
    assert Counted.asked <= 4 * len(tensors)  # once a tensor and walk, not once a path (36^4 here)


@needs_litert
@pytest.mark.parametrize("case", ["tensors", "operators", "signatures"])
def test_a_graph_over_the_entry_bounds_is_one_line_before_its_entries_are_built(tmp_path, monkeypatch, case):
    from ai_edge_litert import schema_py_generated as fb

    from gemma4_trace.replayer.runtimes.litert import graph as G

    monkeypatch.setattr(G, "MAX_ENTRIES", 20)
    monkeypatch.setattr(G, "MAX_SIGNATURES", 3)
    add = fb.BuiltinOperator.ADD
    shapes = {
        "tensors": (21, [(add, [0], [1])], 1, "more than 20 tensors and operators (tensors)"),
        "operators": (2, [(add, [0], [1])] * 19, 1, "more than 20 tensors and operators (operators)"),
        "signatures": (2, [(add, [0], [1])], 4, "4 signatures, more than 3"),
    }
    n, ops, sigs, said = shapes[case]
    path = tflite(tmp_path / "model.tflite", n, ops, sigs)
    nd = tmp_path / "nd.json"
    one_line_error(invoke("diff", GOLDEN, GOLDEN, "--node-data", nd, "--graph", path), "model.tflite", said, out=nd)
    monkeypatch.setattr(G, "MAX_ENTRIES", 1 << 20)
    monkeypatch.setattr(G, "MAX_SIGNATURES", 64)  # within the bounds: read, and no node is a compared kind
    one_line_error(
        invoke("diff", GOLDEN, GOLDEN, "--node-data", nd, "--graph", path), "none of its nodes is a kind", out=nd
    )


def test_a_tflite_without_the_litert_extra_names_the_extra(tmp_path, monkeypatch):
    """Without ai-edge-litert (whose schema reads the file) the overlay says which extra to install."""
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "ai_edge_litert" else real(name, *a))
    graph = tmp_path / "model.tflite"
    graph.write_bytes(b"\0" * 64)
    nd = tmp_path / "nd.json"
    r = invoke("diff", GOLDEN, GOLDEN, "--node-data", nd, "--graph", graph)
    one_line_error(r, "reading a .tflite needs ai-edge-litert", "pip install -e '.[litert]'", out=nd)


@pytest.mark.slow  # a LiteRT export (cached)
def test_a_litert_export_with_renamed_caches_is_drawn_or_refused_in_one_line(tmp_path):
    """Found by scripts/fuzz_inputs.py --only tflite: a signature whose K cache has no V output among
    its outputs was a KeyError, and cache names numbered past the model's layers would index past
    them. Now the missing cache is not drawn, and a numbering that is not 0..n-1 is one line."""
    import struct

    pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (pip install -e '.[litert]')")
    out = tmp_path / "litert"
    r = invoke("export-litert", "--max-seq", 16, "--prefill-chunk", 3, "-o", out)  # the export test_litert.py caches
    assert r.exit_code == 0, r.output
    good = (out / "model.tflite").read_bytes()

    def renamed(old: bytes, new: bytes) -> Path:
        frame = lambda s: struct.pack("<I", len(s)) + s + b"\0"  # noqa: E731 - a flatbuffer string
        assert len(old) == len(new) and good.count(frame(old)) > 0
        path = tmp_path / f"{new.decode()}.tflite"
        path.write_bytes(good.replace(frame(old), frame(new)))
        return path

    nd = tmp_path / "nd.json"
    r = diff(renamed(b"kv_cache_v_1", b"kv_cache_x_1"), nd)
    assert r.exit_code == 0 and "internal error" not in r.output, r.output
    assert nd.is_file()
    nd2 = tmp_path / "nd2.json"
    one_line_error(diff(renamed(b"kv_cache_k_1", b"kv_cache_k_9"), nd2), "are not numbered 0 to", out=nd2)


def test_a_graph_too_short_for_the_traces_is_refused_and_the_overlay_says_the_graphs_size(program, tmp_path):
    """A graph exported for fewer positions than the traces hold is not the graph RUN ran: one line
    naming both sizes and the --max-seq to export; a graph that fits is named with its size."""
    nd = tmp_path / "nd.json"
    r = diff(program, nd)
    assert r.exit_code == 0 and "Model Explorer node data over decode.pt2, a graph of 16 positions" in r.output
    short = tmp_path / "short"
    assert invoke("export-pt2", "--max-seq", 8, "-o", short).exit_code == 0
    one_line_error(
        diff(short / "decode.pt2", tmp_path / "nd2.json"),
        "holds 8 positions",
        "--max-seq 15",
        out=tmp_path / "nd2.json",
    )


def test_a_graph_of_other_positions_than_runs_runtime_held_is_refused(program, tmp_path):
    """A replay's trace says the positions its runtime held (--max-seq): a graph exported for more
    positions than that is not the graph RUN ran either, though it holds the traces; one line naming
    both and the --max-seq to export. A trace that does not say (a recording) keeps the length check."""
    from gemma4_trace.traces.reader import TraceReader

    runs = {n: tmp_path / f"run{n}.h5" for n in (16, 24)}
    for n, run in runs.items():
        assert invoke("replay", GOLDEN, "--max-seq", n, "-o", run).exit_code == 0
        with TraceReader(run) as r:
            assert r.max_seq == n
    with TraceReader(GOLDEN) as g:
        assert g.max_seq is None
    nd = tmp_path / "nd.json"
    r = invoke("diff", GOLDEN, runs[16], "--node-data", nd, "--graph", program)
    assert r.exit_code == 0 and "a graph of 16 positions" in r.output, r.output
    nd2 = tmp_path / "nd2.json"
    r = invoke("diff", GOLDEN, runs[24], "--node-data", nd2, "--graph", program)
    one_line_error(r, "holds 16 positions", "RUN's runtime held 24", "--max-seq 24", out=nd2)


def test_the_overlay_names_each_node_after_its_site_inside_its_layers_group(program, tmp_path):
    """`trace export-pt2` names each output's node after its site (`L02_attn_out`, not torch.export's
    `select_5`) and puts every node in its layer's group (nn_module_stack: Model Explorer's namespace
    `layer_2`), so the overlay's keys say where they are; the program computes what the unnamed
    export computes, bit for bit."""
    import torch

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer import functional as F

    nd = tmp_path / "nd.json"
    assert diff(program, nd).exit_code == 0
    keys = set(json.loads(nd.read_text())["graph"]["results"])
    assert {"logits", "embeddings", "L00_q", "L02_attn_out", "L07_layer_out"} <= keys, sorted(keys)
    rt = F.FunctionalKV(load_model(None), 16)
    inputs = (*F.step_inputs(rt, "decode"), *(torch.randn(c.shape) for c in F.zero_caches(rt)))
    named, plain = torch.export.load(program).module()(*inputs), F.export_step(rt, "decode").module()(*inputs)
    assert len(named) == len(plain) and all(torch.equal(a, b) for a, b in zip(named, plain))
    if importlib.util.find_spec("model_explorer") is None:
        return
    from model_explorer.builtin_pytorch_exportedprogram_adapter import BuiltinPytorchExportedProgramAdapter

    (graph,) = BuiltinPytorchExportedProgramAdapter().convert(str(program), {"const_element_count_limit": 16})["graphs"]
    space = {n.id: n.namespace for n in graph.nodes}
    for key in keys - {"logits", "embeddings", "per_layer_inputs", "final_hidden"}:
        if key.startswith("L"):
            assert space[key] == f"layer_{int(key[1:3])}", (key, space[key])
    assert space["logits"] == "logits" and space["embeddings"] == "embeddings"
    assert len({s for s in space.values() if s.startswith("layer_")}) == rt.n_layers
