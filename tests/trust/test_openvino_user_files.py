"""The user's OpenVINO IR and its name map are untrusted input (`trace replay REF --ir PATH [--ir-map
MAP]`, replayer/runtimes/openvino_file.py, openvino_user.py): a file that is no regular file is never
read, hostile XML (a document type, entities, huge or deep) is refused before OpenVINO parses it, a
truncated .xml or .bin, a .bin too short for the constants the .xml declares or a .bin that is a link
is refused before the model loads, a map that names what the IR lacks, two sites on one tensor or an
IR that does not fit the layout or REF's config is refused before anything runs; each is one line,
exit 2, nothing written, the user's files unchanged. The IR here is a small one built with openvino's
own opset in the KV-cache layout of the embedded model (no engine runs)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

pytest.importorskip("openvino", reason="openvino is not installed (pip install -e '.[openvino]')")

from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes.openvino import no_telemetry  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

no_telemetry()
import openvino as ov  # noqa: E402
from openvino import opset13 as op  # noqa: E402

REF = golden_path("short")
OWNERS = ((1, 16), (1, 16), (1, 32), (1, 16), (1, 32))  # the embedded model's caches: (KV heads, head_dim)


def kv_ir(path, caches=OWNERS, extra_input=None, vocab=680, hidden=64):
    """An IR in the KV-cache layout: embeddings, logits, each present cache its past one (path: the .xml)."""
    rng = np.random.default_rng(0)

    def param(name, shape, t=np.int64):
        p = op.parameter(ov.PartialShape(shape), ov.Type.i64 if t is np.int64 else ov.Type.f32, name=name)
        p.output(0).get_tensor().set_names({name})
        return p

    ids = param("input_ids", [-1, -1])
    params = [ids, param("attention_mask", [-1, -1]), param("position_ids", [-1, -1])]
    table = op.constant(rng.standard_normal((vocab, hidden)).astype(np.float32))
    emb = op.gather(table, ids, op.constant(np.int64(0)), name="model/embed_tokens/Gather_node_0")
    scaled = op.multiply(emb, op.constant(np.float32(8.0)), name="model/embed_tokens/Mul_node_1")
    scaled.output(0).get_tensor().set_names({"embeds"})
    head = op.constant(rng.standard_normal((hidden, vocab)).astype(np.float32))
    logits = op.matmul(scaled, head, False, False, name="model/lm_head/MatMul_node_2")
    logits.output(0).get_tensor().set_names({"logits"})
    results = [op.result(logits)]
    for i, (kv, hd) in enumerate(caches):
        for part in ("key", "value"):
            past = param(f"past_key_values.{i}.{part}", [-1, kv, -1, hd], np.float32)
            params.append(past)
            same = op.convert(past, ov.Type.f32, name=f"model/layers.{i}/self_attn/Id_{part}")
            same.output(0).get_tensor().set_names({f"present.{i}.{part}"})
            results.append(op.result(same))
    if extra_input:
        params.append(param(extra_input, [1], np.float32))
    ov.save_model(ov.Model(results, params, "g"), str(path), compress_to_fp16=False)
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


def no_openvino_read(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("OpenVINO read the file before it was checked")

    monkeypatch.setattr(ov.Core, "read_model", refuse)


# ---------------------------------------------------------------- before the model loads
@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "link-to-device", "folder", "no-xml"])
def test_a_path_that_is_no_ir_file_is_one_line_without_reading(tmp_path, monkeypatch, special):
    no_model_load(monkeypatch)
    path = {"fifo": tmp_path / "f.xml", "/dev/zero": "/dev/zero", "link-to-device": tmp_path / "l.xml"}.get(special)
    words = ["not a regular file (a device, FIFO or socket)"]
    if special == "fifo":
        os.mkfifo(path)  # a plain open would wait for a writer forever
    elif special == "link-to-device":
        os.symlink("/dev/zero", path)
    elif special == "/dev/zero":
        words = ["an OpenVINO IR is a .xml file with its .bin beside it"]
    elif special == "folder":
        path, words = tmp_path / "empty", ["must hold the tool's own IR (prefill.xml and decode.xml"]
        path.mkdir()
    else:
        path, words = kv_ir(tmp_path / "m.xml").with_suffix(".bin"), ["an OpenVINO IR is a .xml file"]
    refused(tmp_path, "--ir", path, words=words)


HOSTILE = {
    "entities": (
        '<?xml version="1.0"?>\n<!DOCTYPE net [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;">'
        '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;">]>\n<net name="&c;" version="11"><layers/></net>\n',
        "holds a document type declaration",
    ),
    "external": (
        '<?xml version="1.0"?>\n<!DOCTYPE net SYSTEM "file:///etc/passwd">\n<net version="11">&x;</net>\n',
        "holds a document type declaration",
    ),
    "deep": ('<?xml version="1.0"?>\n<net version="11">' + "<a>" * 40 + "</a>" * 40 + "</net>\n", "nests deeper"),
    "not-xml": ("net version=11 " * 4, "is not well-formed XML"),
    "not-ir": ('<?xml version="1.0"?>\n<html version="11"><body/></html>\n', "is not OpenVINO IR (its root is <html"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_xml_is_refused_before_openvino_reads_it(tmp_path, monkeypatch, case):
    no_model_load(monkeypatch)
    no_openvino_read(monkeypatch)
    text, words = HOSTILE[case]
    (tmp_path / "m.xml").write_text(text)
    (tmp_path / "m.bin").write_bytes(b"")
    refused(tmp_path, "--ir", tmp_path / "m.xml", words=[words], user=tmp_path)


def test_an_xml_over_the_size_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from gemma4_trace.replayer.runtimes import openvino_file

    no_model_load(monkeypatch)
    x = kv_ir(tmp_path / "m.xml")
    monkeypatch.setattr(openvino_file, "MAX_XML", 1000)
    refused(tmp_path, "--ir", x, words=[f"{x.stat().st_size} bytes (an IR's .xml: 16 to 1000)"], user=tmp_path)


@pytest.mark.parametrize("damage", ["xml-truncated", "bin-truncated", "bin-empty", "bin-missing", "bin-link", "size"])
def test_a_damaged_ir_is_refused_before_the_model_loads(tmp_path, monkeypatch, damage):
    no_model_load(monkeypatch)
    folder = tmp_path / "m"
    folder.mkdir()
    x = kv_ir(folder / "m.xml")
    b = x.with_suffix(".bin")
    if damage == "xml-truncated":
        x.write_bytes(x.read_bytes()[: x.stat().st_size // 2])
        words = ["m.xml is not well-formed XML"]
    elif damage in ("bin-truncated", "bin-empty"):
        b.write_bytes(b.read_bytes()[: 1000 if damage == "bin-truncated" else 0])
        words = ["ends at byte", f"of m.bin, which holds {1000 if damage == 'bin-truncated' else 0} (truncated?)"]
    elif damage == "bin-missing":
        b.unlink()
        words = ["its weights m.bin do not exist beside it"]
    elif damage == "bin-link":
        os.rename(b, tmp_path / "real.bin")
        os.symlink(tmp_path / "real.bin", b)
        words = ["its weights m.bin are a link"]
    else:  # a constant whose declared size is not what its type and shape need
        text = x.read_text()
        x.write_text(text.replace('shape="680, 64" offset="0" size="174080"', 'shape="680, 64" offset="0" size="1000"'))
        words = ["declares 1000 bytes; its type f32 and shape [680, 64] need 174080"]
    refused(tmp_path, "--ir", x, words=words, user=folder)


MAPS = {
    "unknown-kind": ('format = 1\nlayout = "kv-cache"\n[kinds]\nlogitz = { value = "x" }\n', "'logitz' is no kind"),
    "no-layer": ('format = 1\nlayout = "kv-cache"\n[kinds]\nq = { value = "q" }\n', "must hold {layer}"),
    "not-toml": ("format = = 1\n", "not valid TOML"),
    "huge": ("# " + "x" * (65 << 10) + "\n", "bytes, more than the 65536 allowed"),
}


@pytest.mark.parametrize("case", sorted(MAPS))
def test_a_hostile_map_is_one_line_before_the_model_loads(tmp_path, monkeypatch, case):
    no_model_load(monkeypatch)
    x = kv_ir(tmp_path / "m.xml")
    text, words = MAPS[case]
    m = tmp_path / "map.toml"
    m.write_text(text)
    refused(tmp_path, "--ir", x, "--ir-map", m, words=["--ir-map", words], user=tmp_path)


# ---------------------------------------------------------------- once the model loads, before anything runs
def custom(tmp_path, kinds: str, layout: str = "kv-cache"):
    m = tmp_path / "map.toml"
    m.write_text(f'format = 1\nlayout = "{layout}"\n[kinds]\n{kinds}')
    return m


def test_names_the_ir_lacks_and_two_sites_on_one_tensor_are_refused(tmp_path):
    d = tmp_path / "ir"
    d.mkdir()
    x = kv_ir(d / "m.xml")
    m = custom(tmp_path, 'embeddings = { value = "embeds" }\nlayer_out = { value = "model.layers.{layer}.out" }\n')
    words = ["--ir-map map.toml sha256:", "layer_out layer 0: no value 'model.layers.0.out' in m.xml"]
    refused(tmp_path, "--ir", x, "--ir-map", m, words=words, user=d)
    m = custom(tmp_path, 'embeddings = { value = "embeds" }\nfinal_hidden = { node = "model/embed_tokens/*", '
               'op = "Multiply", output = 0 }\n')  # fmt: skip
    refused(tmp_path, "--ir", x, "--ir-map", m, words=["maps embeddings and final_hidden to one tensor 'embeds'"])
    m = custom(tmp_path, 'embeddings = { node = "model/*", output = 0 }\n')
    refused(tmp_path, "--ir", x, "--ir-map", m, words=["nodes match 'model/*'", "narrow it or set pick"], user=d)
    # the built-in mobius map, chosen by the op names: its per-layer inputs' op is not there
    refused(tmp_path, "--ir", x, words=["--ir-map built-in mobius: [kinds] per_layer_inputs: no output 0"], user=d)


@pytest.mark.parametrize(
    "case, words",
    [
        ("caches", "does not match REF's model config: caches (layers that write K/V) 4 (REF 5)"),
        ("heads", "does not match REF's model config: KV heads of layer 0 2 (REF 1)"),
        ("vocab", "does not match REF's model config: vocabulary 500 (REF 680)"),
        ("input", "takes input 'foo', which the kv-cache layout does not feed"),
        ("layout", "is one graph; the map built-in export is for the step-graphs layout"),
    ],
)
def test_an_ir_that_does_not_fit_the_layout_or_refs_config_is_refused(tmp_path, case, words):
    d = tmp_path / "ir"
    d.mkdir()
    kw = {"caches": dict(caches=OWNERS[:4]), "heads": dict(caches=((2, 16), *OWNERS[1:])), "vocab": dict(vocab=500)}
    x = kv_ir(d / "m.xml", **kw.get(case, {}), extra_input="foo" if case == "input" else None)
    args = ["--ir-map", "export" if case == "layout" else custom(tmp_path, 'embeddings = { value = "embeds" }\n')]
    refused(tmp_path, "--ir", x, *args, words=["--ir", words], user=d)


def test_an_ir_no_built_in_map_fits_and_a_map_without_its_ir_are_refused(tmp_path):
    d = tmp_path / "ir"
    d.mkdir()
    x = kv_ir(d / "m.xml")
    x.write_text(x.read_text().replace('name="model/', 'name="decoder/'))
    refused(tmp_path, "--ir", x, words=["no built-in map fits this IR"], user=d)
    refused(tmp_path, "--runtime", "openvino", "--ir-map", "mobius", words=["--ir-map", "goes with --ir PATH"])
    refused(tmp_path, "--runtime", "static", "--ir-map", "mobius", words=["goes with --runtime openvino"])
