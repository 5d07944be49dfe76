"""The user's ONNX graph and its name map are untrusted input (`trace replay REF --onnx PATH
[--onnx-map MAP]`, replayer/runtimes/onnx_file.py, onnx_map.py, onnx_user.py): a file that is no
regular file is never read, a damaged, oversized or escaping file is refused before the model loads,
a map that names what the graph lacks, two sites on one tensor or a graph that does not fit the
layout or REF's config is refused before anything runs; each is one line, exit 2, nothing written,
the user's file unchanged. The graphs here are small ones written with onnx's helper in the
KV-cache layout of the embedded model (no engine runs)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx is not installed (pip install -e '.[onnx]')")
pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[onnx]')")

import onnx  # noqa: E402
from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

REF = golden_path("short")
OWNERS = ((1, 16), (1, 16), (1, 32), (1, 16), (1, 32))  # the embedded model's caches: (KV heads, head_dim)


def kv_graph(path, caches=OWNERS, extra_input=None, external=False, vocab=680, hidden=64):
    """A graph in the KV-cache layout: embeddings, logits, each present cache its past one."""
    ins = [h.make_tensor_value_info(n, T.INT64, ["b", "s"]) for n in ("input_ids", "attention_mask", "position_ids")]
    outs = [h.make_tensor_value_info("logits", T.FLOAT, ["b", "s", vocab])]
    nodes = [
        h.make_node("Gather", ["embed", "input_ids"], ["emb"], name="model/embed_tokens/Gather_node_0"),
        h.make_node("Mul", ["emb", "scale"], ["embeds"], name="model/embed_tokens/Mul_node_1"),
        h.make_node("MatMul", ["embeds", "lm_head"], ["logits"], name="model/lm_head/MatMul_node_2"),
    ]
    for i, (kv, hd) in enumerate(caches):
        for part in ("key", "value"):
            past, present = f"past_key_values.{i}.{part}", f"present.{i}.{part}"
            ins.append(h.make_tensor_value_info(past, T.FLOAT, ["b", kv, "p", hd]))
            outs.append(h.make_tensor_value_info(present, T.FLOAT, ["b", kv, "t", hd]))
            nodes.append(h.make_node("Identity", [past], [present], name=f"model/layers.{i}/self_attn/Id_{part}"))
    if extra_input:
        ins.append(h.make_tensor_value_info(extra_input, T.FLOAT, [1]))
    rng = np.random.default_rng(0)
    inits = [
        nh.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "embed"),
        nh.from_array(np.array(8.0, np.float32), "scale"),
        nh.from_array(rng.standard_normal((hidden, vocab)).astype(np.float32), "lm_head"),
    ]
    model = h.make_model(h.make_graph(nodes, "g", ins, outs, inits), opset_imports=[h.make_opsetid("", 18)])
    kw = dict(save_as_external_data=True, location=path.name + ".data", size_threshold=0) if external else {}
    onnx.save(model, str(path), **kw)
    return path


def hashes(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def refused(tmp_path, *args, words=(), user=None):
    """`trace replay REF ARGS -o OUT`: one line holding `words`, nothing at OUT, the user's files unchanged."""
    before = hashes(user) if user is not None else None
    out = tmp_path / "o.h5"
    line = one_line_error(invoke("replay", REF, *args, "-o", out), *words, out=out)
    if user is not None:
        assert hashes(user) == before
    return line


def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the file was checked")

    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", refuse)


# ---------------------------------------------------------------- before the model loads
@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "link-to-device", "folder"])
def test_a_path_that_is_no_graph_file_is_one_line_without_reading(tmp_path, monkeypatch, special):
    no_model_load(monkeypatch)
    path = {"fifo": tmp_path / "fifo", "/dev/zero": "/dev/zero", "link-to-device": tmp_path / "l.onnx"}.get(special)
    words = ["not a regular file (a device, FIFO or socket)"]
    if special == "fifo":
        os.mkfifo(path)  # a plain open would wait for a writer forever
    elif special == "link-to-device":
        os.symlink("/dev/zero", path)
    elif special == "folder":
        path, words = tmp_path / "empty", ["must hold the tool's own export (prefill.onnx and decode.onnx"]
        path.mkdir()
    refused(tmp_path, "--onnx", path, words=words)


@pytest.mark.parametrize("damage", ["truncated", "flip-0", "flip-5", "flip-10", "empty"])
def test_a_damaged_graph_is_refused_before_the_model_loads(tmp_path, monkeypatch, damage):
    no_model_load(monkeypatch)
    g = kv_graph(tmp_path / "m.onnx")
    raw = bytearray(g.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "empty":
        raw = b""
    else:
        raw[int(damage[5:])] ^= 0x80
    g.write_bytes(bytes(raw))
    words = {"truncated": "is not an ONNX model (DecodeError", "empty": "0 bytes (an .onnx file: 8 to"}
    refused(tmp_path, "--onnx", g, words=[words.get(damage, "--onnx")], user=tmp_path)


def test_a_graph_over_the_size_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from gemma4_trace.replayer.runtimes import onnx_file

    no_model_load(monkeypatch)
    g = kv_graph(tmp_path / "m.onnx")
    monkeypatch.setattr(onnx_file, "MAX_FILE", 1000)
    refused(tmp_path, "--onnx", g, words=[f"{g.stat().st_size} bytes (an .onnx file: 8 to 1000)"], user=tmp_path)


@pytest.mark.parametrize("case", ["escape", "link", "truncated", "missing"])
def test_external_data_stays_inside_the_models_folder(tmp_path, monkeypatch, case):
    no_model_load(monkeypatch)
    folder = tmp_path / "m"
    folder.mkdir()
    g = kv_graph(folder / "m.onnx", external=True)
    data = folder / "m.onnx.data"
    if case == "escape":  # every tensor read from ../secret
        (tmp_path / "secret").write_bytes(data.read_bytes())
        model = onnx.load(str(g), load_external_data=False)
        for t in model.graph.initializer:
            for e in t.external_data:
                e.value = "../secret" if e.key == "location" else e.value
        onnx.save(model, str(g))
        words = ["reads '../secret': external data must be a file beside the model"]
    elif case == "link":
        os.rename(data, tmp_path / "real.data")
        os.symlink(tmp_path / "real.data", data)
        words = ["m.onnx.data is a link"]
    elif case == "truncated":
        data.write_bytes(data.read_bytes()[:1000])
        words = ["which holds 1000 (truncated?)"]
    else:
        data.unlink()
        words = ["m.onnx.data does not exist beside it"]
    refused(tmp_path, "--onnx", g, words=words, user=folder)


MAPS = {
    "wrong-type": ('format = 1\nlayout = "kv-cache"\n[kinds]\nembeddings = { node = "x", output = "zero" }\n',
                   "output must be an index"),
    "unknown-kind": ('format = 1\nlayout = "kv-cache"\n[kinds]\nlogitz = { value = "x" }\n', "'logitz' is no kind"),
    "no-layer": ('format = 1\nlayout = "kv-cache"\n[kinds]\nq = { value = "q" }\n', "must hold {layer}"),
    "placeholder": ('format = 1\nlayout = "kv-cache"\n[kinds]\nq = { value = "{layer.__class__}" }\n',
                    "placeholder {layer.__class__}"),
    "layout": ('format = 1\nlayout = "mine"\n[kinds]\nembeddings = { value = "x" }\n', "layout 'mine'"),
    "not-toml": ("format = = 1\n", "not valid TOML"),
    "deep": ("a" + ".a" * 100 + " = 1\n", "nested more than"),
    "empty": ('format = 1\nlayout = "kv-cache"\n', "[kinds] is missing or empty"),
    "cache": ('format = 1\nlayout = "kv-cache"\n[inputs]\npast_key = "past.key"\n[kinds]\n'
              'embeddings = { value = "x" }\n', "must hold {cache}"),
    "huge": ("# " + "x" * (65 << 10) + "\n", "bytes, more than the 65536 allowed"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MAPS))
def test_a_hostile_map_is_one_line_before_the_model_loads(tmp_path, monkeypatch, case):
    no_model_load(monkeypatch)
    g = kv_graph(tmp_path / "m.onnx")
    text, words = MAPS[case]
    m = tmp_path / "map.toml"
    m.write_text(text)
    refused(tmp_path, "--onnx", g, "--onnx-map", m, words=["--onnx-map", words], user=tmp_path)


def test_a_map_that_is_no_file_is_one_line(tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    g = kv_graph(tmp_path / "m.onnx")
    refused(tmp_path, "--onnx", g, "--onnx-map", "/dev/zero", words=["not a regular file"])
    refused(tmp_path, "--onnx", g, "--onnx-map", "mobious", words=["mobious: no such file"])


# ---------------------------------------------------------------- once the model loads, before anything runs
def custom(tmp_path, kinds: str, layout: str = "kv-cache"):
    m = tmp_path / "map.toml"
    m.write_text(f'format = 1\nlayout = "{layout}"\n[kinds]\n{kinds}')
    return m


def test_names_the_graph_lacks_and_two_sites_on_one_tensor_are_refused(tmp_path):
    g = kv_graph(tmp_path / "m.onnx")
    m = custom(tmp_path, 'embeddings = { value = "embeds" }\nlayer_out = { value = "model.layers.{layer}.out" }\n')
    refused(tmp_path, "--onnx", g, "--onnx-map", m, words=["layer_out layer 0: no value 'model.layers.0.out'"])
    m = custom(tmp_path, 'embeddings = { value = "embeds" }\nfinal_hidden = { node = "model/embed_tokens/*", '
               'op = "Mul", output = 0 }\n')  # fmt: skip
    refused(tmp_path, "--onnx", g, "--onnx-map", m, words=["maps embeddings and final_hidden to one tensor 'embeds'"])
    m = custom(tmp_path, 'embeddings = { node = "model/*", output = 0 }\n')
    refused(tmp_path, "--onnx", g, "--onnx-map", m, words=["nodes match 'model/*'", "narrow it or set pick"])
    # the built-in mobius map, chosen by the node names: its per-layer inputs' node is not there
    words = ["built-in mobius: [kinds] per_layer_inputs: no output 0 of node"]
    refused(tmp_path, "--onnx", g, words=words, user=tmp_path)


@pytest.mark.parametrize(
    "case, words",
    [
        ("caches", "does not match REF's model config: caches (layers that write K/V) 4 (REF 5)"),
        ("heads", "does not match REF's model config: KV heads of layer 0 2 (REF 1)"),
        ("vocab", "does not match REF's model config: vocabulary 500 (REF 680)"),
        ("input", "takes input 'foo', which the kv-cache layout does not feed"),
        ("layout", "is one graph; the map"),
        ("unmapped", "no built-in map fits this graph"),
    ],
)
def test_a_graph_that_does_not_fit_the_layout_or_refs_config_is_refused(tmp_path, case, words):
    kw = {"caches": dict(caches=OWNERS[:4]), "heads": dict(caches=((2, 16), *OWNERS[1:])), "vocab": dict(vocab=500)}
    g = kv_graph(tmp_path / "m.onnx", **kw.get(case, {}), extra_input="foo" if case == "input" else None)
    args = ["--onnx-map", custom(tmp_path, 'embeddings = { value = "embeds" }\n')]
    if case == "layout":
        args = ["--onnx-map", "export"]
    elif case == "unmapped":
        model = onnx.load(str(g))
        for n in model.graph.node:
            n.name = n.name.replace("model/", "decoder/")
        onnx.save(model, str(g))
        args = []
    refused(tmp_path, "--onnx", g, *args, words=[words], user=tmp_path)


def test_a_map_without_its_graph_is_refused(tmp_path):
    refused(tmp_path, "--runtime", "onnx", "--onnx-map", "mobius", words=["--onnx-map", "goes with --onnx PATH"])
    refused(tmp_path, "--runtime", "static", "--onnx-map", "mobius", words=["goes with --runtime onnx"])
