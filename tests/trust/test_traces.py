"""A trace is untrusted input (docs/robustness.md, "Threat model"): every bad trace is exit 2 and one
line naming the file and what is wrong, for `trace show`, `trace show --hash`, `trace diff` (either
side) and `trace replay` (REF), which refuses it before writing anything. A hostile file (external
storage or links, virtual datasets, sparse or compressed bombs, deep trees, huge attributes) opens
nothing outside itself and costs no more than its header justifies; a file that is no regular file
is never read; no command's output replaces a trace it reads; and the fuzzer
(scripts/fuzz_traces.py) ends cleanly on corrupted copies of the goldens.

The bad traces are copies of the smallest golden trace (a real recording), damaged one way each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from gemma4_trace.recorder import golden
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.traces.selection import parse_ranges
from tests.support.cli import invoke, one_line_error

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = golden_path("short")
# short.h5: 13 prompt ids, 3 steps (15 positions), 8 layers of 4 heads / 1 KV head, max_new_tokens 3


def _replace(f: h5py.File, name: str, data, **kw) -> None:
    """Rewrite a dataset with other data (shape, dtype), keeping its attributes."""
    attrs = {k: f[name].attrs[k] for k in f[name].attrs}
    del f[name]
    ds = f.create_dataset(name, data=data, **kw)
    for k, v in attrs.items():
        ds.attrs[k] = v


def _edit(fn):
    def apply(path: Path):
        with h5py.File(path, "r+") as f:
            fn(f)

    return apply


def _bytes(fn):
    def apply(path: Path):
        path.write_bytes(fn(path.read_bytes()))

    return apply


def _setattr(obj, key, value):
    return _edit(lambda f: f[obj].attrs.__setitem__(key, value))


def _delattr(obj, key):
    return _edit(lambda f: f[obj].attrs.__delitem__(key))


def _delete(name):
    return _edit(lambda f: f.__delitem__(name))


def _rows(name, fn):
    return _edit(lambda f: _replace(f, name, fn(f[name][()])))


def _not_a_trace(path: Path):
    path.unlink()
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(3)


def _rename(src, dst):
    return _edit(lambda f: f.move(src, dst))


def _soft_link(name):
    def fn(f):
        del f[name]
        f[name] = h5py.SoftLink("/nowhere")

    return _edit(fn)


# ---------------------------------------------------------------- hostile files (docs/robustness.md, threat model)
CANARY = b"CANARY-SECRET-BYTES-" * 8  # 160 bytes a trace must never make the tool read


def _canary(path: Path) -> Path:
    c = path.parent / "canary.bin"
    c.write_bytes(CANARY)
    return c


def _external_storage(name):
    """`name` rewritten as a dataset whose bytes live in another file (HDF5 external raw storage)."""

    def apply(path: Path):
        canary = _canary(path)
        with h5py.File(path, "r+") as f:
            old = f[name]
            shape, dtype, attrs = old.shape, old.dtype, dict(old.attrs)
            del f[name]
            ds = f.create_dataset(name, shape=shape, dtype=dtype, external=[(str(canary), 0, h5py.h5f.UNLIMITED)])
            for k, v in attrs.items():
                ds.attrs[k] = v

    return apply


def _external_link(name, target_file="other.h5"):
    def apply(path: Path):
        shutil.copyfile(GOLDEN, path.parent / target_file)  # following the link would "work": a match
        with h5py.File(path, "r+") as f:
            del f[name]
            f[name] = h5py.ExternalLink(target_file, "/" + name)

    return apply


def _virtual(name, source="missing-source.h5"):
    def fn(f):
        old = f[name]
        layout = h5py.VirtualLayout(shape=old.shape, dtype=old.dtype)
        layout[...] = h5py.VirtualSource(source, "/" + name, shape=old.shape)
        attrs = dict(old.attrs)
        del f[name]
        ds = f.create_virtual_dataset(name, layout, fillvalue=0)
        for k, v in attrs.items():
            ds.attrs[k] = v

    return _edit(fn)


def _hard_link(name, to):
    def fn(f):
        del f[name]
        f[name] = f[to]

    return _edit(fn)


def _soft_link_to(name, to):
    def fn(f):
        del f[name]
        f[name] = h5py.SoftLink(to)

    return _edit(fn)


def _sparse(name, shape, chunks, maxshape=None):
    """A dataset declaring a huge shape with nothing stored (every chunk missing)."""

    def fn(f):
        attrs = dict(f[name].attrs)
        del f[name]
        ds = f.create_dataset(name, shape=shape, dtype="float32", chunks=chunks, compression="gzip", maxshape=maxshape)
        for k, v in attrs.items():
            ds.attrs[k] = v

    return _edit(fn)


def _deep_tree(where, depth=2000):
    return _edit(lambda f: f.create_group(f"{where}/" + "/".join(["d"] * depth)))


def _huge_attribute(path: Path):
    """A 20 MiB prompt text (dense attribute storage: the group is recreated in the latest format)."""
    with h5py.File(path, "r+", libver="latest") as f:
        old, new = f["inputs"], f.create_group("inputs_new")
        for k in old:
            f.copy(old[k], new, k)
        for k in old.attrs:
            new.attrs[k] = old.attrs[k]
        del f["inputs"]
        f.move("inputs_new", "inputs")
        f["inputs"].attrs["prompt_text"] = np.array(b"x" * (20 << 20))


def _bomb_header(path: Path):
    """A header of 200,000 prompt positions (consistent everywhere) whose tensors declare 400 MB
    with nothing stored: what a compression bomb declares, in a file of a few MB."""
    n = 200_000
    with h5py.File(path, "r+") as f:
        del f["tensors"], f["inputs/prompt_ids"], f["steps/positions"]
        f["inputs/prompt_ids"] = np.full(n, 5, dtype=np.int64)
        f["inputs"].attrs["max_new_tokens"] = 1
        f["steps/positions"] = np.array([[0, n]], dtype=np.int64)
        t = f.create_group("tensors")
        t["token"] = np.array([5], dtype=np.int64)
        t["token"].attrs["source_dtype"] = "int64"
        for name in ("embeddings", "L00/layer_out"):
            ds = t.create_dataset(name, shape=(n, 256), dtype="float32", chunks=(256, 256), compression="gzip")
            ds.attrs["source_dtype"] = "float32"


HOSTILE = [
    ("external-storage-prompt-ids", _external_storage("inputs/prompt_ids"), ["'inputs/prompt_ids'", "external file"]),
    ("external-storage-tokens", _external_storage("tensors/token"), ["'tensors/token'", "external file"]),
    ("external-storage-tensor", _external_storage("tensors/L02/q"), ["'tensors/L02/q'", "external file"]),
    ("external-link-dataset", _external_link("tensors/L03/q"), ["'tensors/L03/q' is an external link"]),
    ("external-link-tensors", _external_link("tensors"), ["'tensors' is an external link"]),
    ("external-link-model", _external_link("model"), ["'model' is an external link"]),
    (
        "external-link-relative",
        _external_link("tensors/L05", "../bad0/other.h5"),
        ["'tensors/L05' is an external link"],
    ),
    ("soft-link-layer-group", _soft_link_to("tensors/L02", "/tensors/L01"), ["'tensors/L02' is a soft link"]),
    ("hard-link-layer-group", _hard_link("tensors/L02", "tensors/L01"), ["two names"]),
    ("hard-link-dataset", _hard_link("tensors/L04/q", "tensors/L05/q"), ["two names"]),
    ("virtual-dataset", _virtual("tensors/L03/q"), ["'tensors/L03/q' is a virtual dataset"]),
    ("virtual-dataset-tokens", _virtual("tensors/token"), ["'tensors/token' is a virtual dataset"]),
    (
        "sparse-huge-row",
        _sparse("tensors/L00/attn_out", (15, 10**9), (1, 1 << 20)),
        ["'tensors/L00/attn_out'", "more than the model config justifies"],
    ),
    ("sparse-huge-logits", _sparse("tensors/logits", (3, 10**10), (1, 1 << 20)), ["'tensors/logits'", "justifies"]),
    (
        "huge-chunk",
        _sparse("tensors/L00/layer_out", (15, 64), (1 << 20, 64), (None, 64)),
        ["'tensors/L00/layer_out'", "chunks of"],
    ),
    ("compression-bomb", _bomb_header, ["declare", "compression bomb"]),
    ("deep-tree-at-root", _deep_tree("junk"), ["'/' holds 'junk', which is not part of a trace"]),
    ("deep-tree-in-layer", _deep_tree("tensors/L01/junk"), ["'junk' is not a per-layer kind"]),
    ("huge-attribute", _huge_attribute, ["'prompt_text'", "20.0 MiB"]),
    ("many-attributes", _edit(lambda f: [f.attrs.__setitem__(f"a{i}", i) for i in range(100)]), ["113 attributes"]),
    ("max-new-tokens-huge", _setattr("inputs", "max_new_tokens", 1 << 40), ["'max_new_tokens'", "positions"]),
    ("layers-too-many", _rows("model/head_dim", lambda a: a * 0 + 100_000), ["model/head_dim of layer 0 is 100000"]),
]


# (id, how to damage a copy of short.h5, substrings of the error line)
CASES = [
    ("truncated", _bytes(lambda b: b[: len(b) // 2]), ["truncated", "copy it again"]),
    ("truncated-header", _bytes(lambda b: b[:100]), ["not a readable HDF5"]),
    ("empty-file", _bytes(lambda b: b""), ["not a readable HDF5"]),
    ("not-hdf5", _bytes(lambda b: b"step,layer,value\n0,1,2.5\n" * 20), ["not an HDF5 file"]),
    ("hdf5-not-a-trace", _not_a_trace, ["HDF5 file but not a gemma4-trace trace"]),
    ("schema-name-wrong", _setattr("/", "schema", "other-tool"), ["not a gemma4-trace trace"]),
    ("newer-version", _setattr("/", "schema_version", 3), ["schema version 3", "upgrade"]),
    ("v2-without-towers", _setattr("/", "schema_version", 2), ["schema version 2 but has no towers/ table"]),
    ("older-version", _setattr("/", "schema_version", 0), ["schema version 0", "re-record"]),
    ("version-not-int", _setattr("/", "schema_version", "1"), ["'schema_version' should be an integer"]),
    ("version-missing", _delattr("/", "schema_version"), ["'schema_version' is missing"]),
    ("provenance-missing", _delattr("/", "model_config"), ["'model_config' of the root is missing"]),
    ("provenance-wrong-type", _setattr("/", "dtype", 32), ["'dtype' of the root should be text"]),
    ("mode-unknown", _setattr("/", "mode", "replayed"), ["'mode' is 'replayed'"]),
    ("model-config-not-json", _setattr("/", "model_config", "{hidden: 64"), ["'model_config' is not a JSON object"]),
    ("model-config-not-object", _setattr("/", "model_config", "[1, 2]"), ["'model_config' is not a JSON object"]),
    ("prompt-ids-missing", _delete("inputs/prompt_ids"), ["'inputs/prompt_ids' is missing"]),
    (
        "prompt-ids-float",
        _rows("inputs/prompt_ids", lambda a: a.astype(np.float32)),
        ["inputs/prompt_ids", "dtype float32"],
    ),
    ("prompt-ids-2d", _rows("inputs/prompt_ids", lambda a: a[None]), ["inputs/prompt_ids", "shape (1, 13)"]),
    ("prompt-ids-negative", _rows("inputs/prompt_ids", lambda a: a - 100), ["inputs/prompt_ids", "out of range"]),
    ("inputs-attr-missing", _delattr("inputs", "max_new_tokens"), ["'max_new_tokens' of 'inputs' is missing"]),
    ("inputs-attr-wrong-type", _setattr("inputs", "max_new_tokens", "three"), ["'max_new_tokens'", "integer"]),
    ("eos-wrong-type", _setattr("inputs", "eos_token_ids", "1,6"), ["'eos_token_ids'", "integers"]),
    ("chat-flag-wrong-type", _setattr("inputs", "chat_template_applied", "yes"), ["'chat_template_applied'"]),
    ("more-steps-than-max-new-tokens", _setattr("inputs", "max_new_tokens", 2), ["3 steps but max_new_tokens is 2"]),
    ("steps-missing", _delete("steps/positions"), ["'steps/positions' is missing"]),
    ("steps-group-missing", _delete("steps"), ["the group 'steps' is missing"]),
    (
        "steps-wrong-shape",
        _rows("steps/positions", lambda a: np.concatenate([a, a[:, :1]], axis=1)),
        ["steps/positions"],
    ),
    (
        "steps-gap",
        _rows("steps/positions", lambda a: a + np.array([[0, 0], [1, 1], [1, 1]])),
        ["step 1 feeds positions [14, 15)"],
    ),
    ("steps-empty", _rows("steps/positions", lambda a: a[:0]), ["steps/positions"]),
    ("steps-float", _rows("steps/positions", lambda a: a.astype(np.float64)), ["steps/positions", "dtype float64"]),
    ("model-field-missing", _delete("model/head_dim"), ["'model/head_dim' is missing"]),
    ("model-field-short", _rows("model/kv_role", lambda a: a[:-1]), ["inconsistent lengths"]),
    (
        "model-field-dtype",
        _rows("model/num_heads", lambda a: a.astype(np.float32)),
        ["model/num_heads", "expected integer"],
    ),
    (
        "model-field-text-dtype",
        _rows("model/layer_type", lambda a: np.arange(len(a))),
        ["model/layer_type", "expected strings"],
    ),
    (
        "layer-type-unknown",
        _rows("model/layer_type", lambda a: np.array([b"dense"] * len(a), dtype=h5py.string_dtype())),
        ["layer_type of layer 0 is 'dense'"],
    ),
    ("kv-source-out-of-range", _rows("model/kv_source", lambda a: a + 20), ["kv_source of layer 0 is 20"]),
    ("tensors-group-missing", _delete("tensors"), ["'tensors' is missing"]),
    ("token-missing", _delete("tensors/token"), ["'tensors/token'", "missing"]),
    (
        "tensor-extra-rows",
        _rows("tensors/L03/q", lambda a: np.concatenate([a, a[-1:]])),
        ["tensors/L03/q", "16 rows, expected 15"],
    ),
    ("tensor-too-few-rows", _rows("tensors/embeddings", lambda a: a[:12]), ["tensors/embeddings", "12 rows"]),
    ("logits-rows", _rows("tensors/logits", lambda a: a[:2]), ["tensors/logits", "2 rows, expected 3 (one per step)"]),
    ("token-rows", _rows("tensors/token", lambda a: np.concatenate([a, a])), ["tensors/token", "6 rows, expected 3"]),
    ("q-heads-vs-metadata", _rows("tensors/L02/q", lambda a: a[:, :3]), ["tensors/L02/q", "4 heads"]),
    (
        "k-heads-vs-metadata",
        _rows("tensors/L00/k", lambda a: np.concatenate([a, a], axis=1)),
        ["tensors/L00/k", "1 KV heads"],
    ),
    ("ple-layers-vs-metadata", _rows("tensors/per_layer_inputs", lambda a: a[:, :7]), ["per_layer_inputs", "8 layers"]),
    (
        "tensor-rank",
        _rows("tensors/L01/layer_out", lambda a: a[..., None]),
        ["tensors/L01/layer_out", "expected 2 dimension(s)"],
    ),
    ("tensor-scalar", _rows("tensors/final_hidden", lambda a: a[0, 0]), ["tensors/final_hidden", "shape ()"]),
    ("tensor-empty-row", _rows("tensors/L00/attn_out", lambda a: a[:, :0]), ["tensors/L00/attn_out", "empty row"]),
    (
        "tensor-dtype-int",
        _rows("tensors/L04/layer_out", lambda a: a.astype(np.int32)),
        ["tensors/L04/layer_out", "expected float16, float32"],
    ),
    (
        "tensor-dtype-float128",
        _rows("tensors/L04/q", lambda a: a.astype(np.longdouble)),
        ["tensors/L04/q", "has dtype float128"],
    ),
    (
        "mask-dtype-float",
        _rows("tensors/L00/mask", lambda a: a.astype(np.float32)),
        ["tensors/L00/mask", "expected bool"],
    ),
    (
        "token-dtype-float",
        _rows("tensors/token", lambda a: a.astype(np.float64)),
        ["tensors/token", "expected integer"],
    ),
    ("token-negative", _rows("tensors/token", lambda a: a - 1000), ["tensors/token", "out of range"]),
    (
        "source-dtype-missing",
        _delattr("tensors/L05/q", "source_dtype"),
        ["'source_dtype' of 'tensors/L05/q' is missing"],
    ),
    (
        "source-dtype-wrong-type",
        _setattr("tensors/L05/q", "source_dtype", np.zeros(3)),
        ["'source_dtype'", "should be text"],
    ),
    ("unknown-layer-group", _rename("tensors/L03", "tensors/L3"), ["'tensors/L3' is neither"]),
    ("layer-beyond-model", _rename("tensors/L07", "tensors/L09"), ["'tensors/L09'", "8 layers"]),
    (
        "global-kind-in-layer",
        _rename("tensors/embeddings", "tensors/L00/embeddings"),
        ["'embeddings' is not a per-layer kind"],
    ),
    ("dangling-link", _soft_link("tensors/L01/v"), ["'tensors/L01/v' is a soft link"]),
    (
        "dataset-where-group",
        _edit(lambda f: (f.__delitem__("model"), f.__setitem__("model", np.arange(3)))),
        ["'model' is a Dataset, not a group"],
    ),
]


CASES += HOSTILE
IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def bad_traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    out = {}
    for name, damage, _ in CASES:
        p = d / f"{name}.h5"
        shutil.copyfile(GOLDEN, p)
        damage(p)
        out[name] = p
    return out


@pytest.mark.parametrize("name,damage,needles", CASES, ids=IDS)
def test_show_and_hash(bad_traces, name, damage, needles):
    bad = bad_traces[name]
    for args in (["show", bad], ["show", "--hash", bad]):
        one_line_error(invoke(*args), str(bad), *needles)


@pytest.mark.parametrize("name,damage,needles", CASES, ids=IDS)
def test_diff_either_side(bad_traces, name, damage, needles):
    bad = bad_traces[name]
    one_line_error(invoke("diff", GOLDEN, bad), str(bad), *needles)
    one_line_error(invoke("diff", bad, GOLDEN, "--json"), str(bad), *needles)


@pytest.mark.parametrize("name,damage,needles", CASES, ids=IDS)
def test_replay_refuses_bad_reference_and_writes_nothing(bad_traces, tmp_path, name, damage, needles):
    bad = bad_traces[name]
    out = tmp_path / "run.h5"
    one_line_error(invoke("replay", bad, "-o", out), str(bad), *needles)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_missing_file_and_folder(tmp_path):
    for args in (
        ["show", tmp_path / "nope.h5"],
        ["show", "--hash", tmp_path],
        ["diff", GOLDEN, tmp_path / "nope.h5"],
        ["diff", tmp_path, GOLDEN],
        ["replay", tmp_path / "nope.h5", "-o", tmp_path / "o.h5"],
    ):
        one_line_error(invoke(*args), str(tmp_path))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- integrity: stored bytes damaged
def _flip_in_chunk(path: Path, dataset: str, chunk: int = 0) -> None:
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(chunk)
    data = bytearray(path.read_bytes())
    data[info.byte_offset + info.size // 2] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("dataset", ["tensors/L03/q", "tensors/embeddings", "tensors/logits", "tensors/L07/mask"])
def test_flipped_byte_is_corruption_not_divergence(tmp_path, dataset):
    bad = tmp_path / "copy.h5"
    shutil.copyfile(GOLDEN, bad)
    _flip_in_chunk(bad, dataset)
    for args in (
        ["diff", GOLDEN, bad],
        ["diff", bad, GOLDEN],
        ["diff", GOLDEN, bad, "--json"],
        ["show", "--hash", bad],
    ):
        line = one_line_error(invoke(*args), str(bad), f"'{dataset}'")
        assert "is corrupt" in line and "damaged" in line and "checksum" in line
    # the summary reads no tensor data besides the tokens: it still works
    r = invoke("show", bad)
    assert r.exit_code == 0 and "generated  3 tokens" in r.output


def test_flipped_byte_in_tokens_and_inputs(tmp_path):
    bad = tmp_path / "copy.h5"
    shutil.copyfile(GOLDEN, bad)
    _flip_in_chunk(bad, "tensors/token")
    for args in (["show", bad], ["show", "--hash", bad], ["diff", GOLDEN, bad], ["diff", bad, GOLDEN]):
        one_line_error(invoke(*args), str(bad), "is corrupt", "'tensors/token'")
    out = tmp_path / "run.h5"
    one_line_error(invoke("replay", bad, "-o", out), str(bad), "'tensors/token'")
    assert not out.exists()
    img = tmp_path / "image.h5"
    shutil.copyfile(GOLDEN.with_name("image.h5"), img)
    _flip_in_chunk(img, "inputs/extra/pixel_values", 1)
    r = invoke("show", img)  # the summary gives the extra inputs' shapes without reading them
    assert r.exit_code == 0 and "pixel_values (" in r.output, r.output
    one_line_error(invoke("show", "--hash", img), str(img), "'inputs/extra/pixel_values'")


def test_golden_still_reads_and_matches_itself():
    assert invoke("show", GOLDEN).exit_code == 0
    r = invoke("diff", GOLDEN, GOLDEN)
    assert r.exit_code == 0 and r.output.startswith("match")


# ---------------------------------------------------------------- not regular files
def test_fifo_socket_and_device_refused_as_traces(tmp_path):
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.h5"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        for path, word in ((fifo, "FIFO"), (sock_path, "socket"), (Path("/dev/zero"), "character device")):
            for args in (
                ["show", path],
                ["show", "--hash", path],
                ["diff", GOLDEN, path],
                ["diff", path, GOLDEN],
                ["replay", path, "-o", tmp_path / "out.h5"],
            ):
                one_line_error(invoke(*args), str(path), word, "not a regular file")
    finally:
        sock.close()
    assert not (tmp_path / "out.h5").exists()


# ---------------------------------------------------------------- outputs never replace a trace they read
@pytest.fixture
def ref(tmp_path):
    p = tmp_path / "a.h5"
    shutil.copyfile(GOLDEN, p)
    return p


def test_replay_output_onto_its_reference_refused(ref, tmp_path):
    before = ref.read_bytes()
    (tmp_path / "hard.h5").hardlink_to(ref)
    (tmp_path / "sym.h5").symlink_to(ref)
    for out in (ref, tmp_path / "hard.h5", tmp_path / "sym.h5", tmp_path / "." / "a.h5"):
        one_line_error(invoke("replay", ref, "-o", out, "--force"), "is the input")
    assert ref.read_bytes() == before


def test_calibrate_output_onto_a_trace_it_reads_refused(ref, tmp_path):
    base = tmp_path / "b.h5"
    shutil.copyfile(ref, base)
    before = base.read_bytes()
    for out in (base, ref):
        one_line_error(invoke("calibrate", ref, base, "-o", out, "--force"), "is the input")
    assert base.read_bytes() == before


def test_diff_report_onto_a_trace_or_a_device_refused(ref, tmp_path):
    before = ref.read_bytes()
    one_line_error(invoke("diff", ref, ref, "--report", ref, "--force"), "is the input")
    assert ref.read_bytes() == before
    tol = tmp_path / "tol.toml"
    tol.write_text("[tokens]\nnear_tie_margin = 0.5\n")
    one_line_error(invoke("diff", ref, ref, "--tolerances", tol, "--report", tol, "--force"), "is the input")
    assert tol.read_text().startswith("[tokens]")
    one_line_error(invoke("diff", ref, ref, "--report", "/dev/null", "--force"), "not a regular file")
    assert Path("/dev/null").is_char_device()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line_error(invoke("diff", ref, ref, "--report", fifo, "--force"), "not a regular file")


def test_a_repro_never_replaces_ref_and_a_folder_target_is_one_line(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    ref = d / "inputs.npz"  # REF under the name a repro writes
    shutil.copyfile(GOLDEN, ref)
    run = tmp_path / "bug.h5"
    assert invoke("replay", ref, "--runtime", "tests.support.bug_zoo:make_no_softcap", "-o", run).exit_code == 0
    before = ref.read_bytes()
    r = invoke("repro", ref, run, "--at", "0,1", "-o", d, "--force")
    one_line_error(r, "inputs.npz is the input")
    assert ref.read_bytes() == before and sorted(p.name for p in d.iterdir()) == ["inputs.npz"]
    other = tmp_path / "o"
    (other / "weights.npz").mkdir(parents=True)
    r = invoke("repro", ref, run, "--at", "0,1", "-o", other, "--force")
    one_line_error(r, "weights.npz exists and is not a regular file")
    assert sorted(p.name for p in other.iterdir()) == ["weights.npz"]  # nothing of the repro placed


# ---------------------------------------------------------------- bounded before it is read or allocated
def test_show_quotes_a_long_prompt_in_part(tmp_path):
    """A 4 MB prompt text (under the attribute cap): `trace show` prints a summary, not the text."""
    import h5py

    p = tmp_path / "long-prompt.h5"
    shutil.copyfile(GOLDEN, p)
    with h5py.File(p, "r+") as f:
        f["inputs"].attrs["prompt_text"] = "z" * (4 << 20)
    r = invoke("show", p)
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("prompt"))
    assert len(r.output) < 10_000 and "(4194304 characters)" in line, line[:300]


def _with_header(tmp_path, max_new_tokens: int) -> Path:
    import h5py

    p = tmp_path / "long.h5"
    shutil.copyfile(GOLDEN, p)
    with h5py.File(p, "r+") as f:
        f["inputs"].attrs["max_new_tokens"] = max_new_tokens
    return p


def test_replay_with_a_huge_max_new_tokens_refused_before_allocating(tmp_path):
    ref = _with_header(tmp_path, 40_000)
    line = one_line_error(
        invoke("replay", ref, "-o", tmp_path / "run.h5", env={"GEMMA4_TRACE_MEMORY_LIMIT": "4G"}), "40016"
    )
    # the memory estimate (about 78 GiB) or, first for the tiny model, its 2048 positions
    assert ("needs about" in line and "4.0 GiB available" in line) or "max_position_embeddings" in line, line
    assert not (tmp_path / "run.h5").exists()


def test_a_selection_attribute_selecting_millions_is_refused_before_it_is_built(tmp_path):
    """A trace is untrusted: 40 ranges of a million layers in a 694-character attribute took 2.6 GB to
    open; the values a selection may hold are counted before any is stored."""
    import shutil

    import h5py

    from gemma4_trace.traces.errors import TraceToolError
    from gemma4_trace.traces.selection import MAX_SELECTED

    assert len(parse_ranges(f"0-999999,1000000-{MAX_SELECTED - 1}", "steps")) == MAX_SELECTED
    ranges = ",".join(f"{i * 1000001}-{i * 1000001 + 1000000}" for i in range(40))  # 40 million layers
    with pytest.raises(TraceToolError, match="more than 1048576 values selected"):
        parse_ranges(ranges, "layers")
    bad = tmp_path / "bad.h5"
    shutil.copy(golden.golden_path("short"), bad)
    with h5py.File(bad, "r+") as f:
        f.attrs["selection"] = json.dumps({"layers": ranges, "kinds": None, "steps": None})
    one_line_error(invoke("show", bad), "'selection' is not a valid selection", "more than 1048576 values")


@pytest.mark.parametrize("value", [0, -3, 1 << 40, "64", 2.5])
def test_a_max_seq_attribute_out_of_bounds_or_not_an_integer_is_one_line(tmp_path, value):
    """A replay's `max_seq` root attribute (the positions its runtime held) is read only as an integer
    from 1 to the positions a trace may hold."""
    import shutil

    import h5py

    bad = tmp_path / "bad.h5"
    shutil.copy(golden.golden_path("short"), bad)
    with h5py.File(bad, "r+") as f:
        f.attrs["max_seq"] = value
    one_line_error(invoke("show", bad), "'max_seq'")


# ---------------------------------------------------------------- the fuzzer (scripts/fuzz_traces.py), a short run
SCRIPT = ROOT / "scripts" / "fuzz_traces.py"
FUZZ_CASES, SEED = 200, 2024


def _load():
    spec = importlib.util.spec_from_file_location("fuzz_traces", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_traces"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fz():
    return _load()


@pytest.mark.slow
def test_fuzzed_traces_end_cleanly(fz):
    rep = fz.supervise(FUZZ_CASES, SEED, timeout=8.0, jobs=2, hang_after=15.0)
    summary = fz.format_report(rep, f"supervise({FUZZ_CASES}, {SEED})")
    print(summary)
    assert not rep.failures, summary + "\n" + "\n".join(rep.failures[:5])
    # no hang or crash inside HDF5 either (text is stored as fixed-length strings, and no group below the
    # root tracks link creation order: see docs/robustness.md and test_no_creation_order_below_the_root)
    assert not rep.library, summary + "\n" + "\n".join(rep.library)
    # hostile files: nothing outside the trace opened, no command slow or big (docs/robustness.md)
    assert rep.watch_ok and not rep.outside and not rep.slow and not rep.big, summary
    assert rep.cases == FUZZ_CASES
    # the corruptions reached every outcome: refused, unharmed, and (diff) diverged
    for command in fz.COMMANDS:
        assert rep.outcomes[(command, 2)] > 0 and rep.outcomes[(command, 0)] > 0, summary
    assert rep.outcomes[("diff GOLDEN CORRUPT", 1)] > 0, summary
    assert set(rep.mutations) == set(fz.ALL), summary
    assert {"corrupt data (checksum)", "invalid structure", "unreadable HDF5"} <= set(rep.messages), summary
    # a third of the cases start from the version-2 golden; tower cases the format has a verdict on ran
    assert rep.goldens["v2"] > FUZZ_CASES // 5 and rep.goldens["v1"] > FUZZ_CASES // 2, summary
    assert rep.verdicts["must be refused"] > 0 and rep.verdicts["must read"] > 0, summary


@pytest.mark.slow
@pytest.mark.parametrize(
    "hostile",
    ["external_storage", "external_link", "soft_link", "hard_link", "virtual", "sparse", "bomb", "deep", "huge_attr"],
)
def test_hostile_class_sample(fz, hostile):
    """A few cases of each hostile class alone: refused or harmless, never a read outside the file
    (inotify on the files they point at), never slow or big, always one line."""
    rep = fz.fuzz(3, SEED + 7, timeout=30.0, only=hostile, deep_max=20_000)
    summary = fz.format_report(rep, f"fuzz(3, only={hostile})")
    assert rep.cases == 3 and rep.mutations[hostile] == 3, summary
    assert not rep.failures, summary + "\n" + "\n".join(rep.failures[:3])
    assert rep.watch_ok and not rep.outside, summary + "\n" + "\n".join(rep.outside[:3])
    assert not rep.slow and not rep.big, summary


@pytest.mark.slow
def test_version_1_cases_are_as_before(fz):
    """A case that starts from the golden draws nothing more from its generator than before towers
    (the version-2 draw has a stream of its own): `--seed S --case K` replays the same mutation."""
    plain = 0
    for case in range(60):
        rng = np.random.default_rng([SEED, case])
        which, picks = fz.plan_case(SEED, case, rng, None)
        if which == "v1" and picks is None:
            plain += 1
            assert rng.random() == np.random.default_rng([SEED, case]).random()
        assert fz.plan_case(SEED, case, np.random.default_rng([SEED, case]), None, share=0.0) == ("v1", None)
    assert 20 < plain < 60


def _tower_trace(fz, path, mutate):
    fz.tower_golden(path)
    with h5py.File(path, "r+") as f:
        mutate(f)
    return path


def _set_vision(f, value):
    cfg = json.loads(f.attrs["model_config"])
    cfg["vision_config"] = value
    f.attrs["model_config"] = json.dumps(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, mutate, needles",
    [
        # an encoder deeper than the text decoder indexed the text layers' metadata (IndexError, "damaged")
        ("encoder-deeper-than-text", lambda fz, f: fz._relayer(f, "vision", 6), None),
        # a sub-config that is no object, or lacks a size, left the tower table unchecked (read)
        ("sub-config-text", lambda fz, f: _set_vision(f, "garbage"), ["has no 'vision_config' object"]),
        (
            "sub-config-size-text",
            lambda fz, f: _set_vision(f, {**json.loads(f.attrs["model_config"])["vision_config"], "hidden_size": "8"}),
            ["vision_config gives no hidden"],
        ),
        # an attribute of no elements: HDF5's storage size 0 raised in h5py ("damaged")
        (
            "empty-attribute",
            lambda fz, f: f["towers/vision"].attrs.__setitem__("layers", np.array([], np.int64)),
            ["'layers' of 'towers/vision' should be an integer"],
        ),
        # a layer group of 5,001 digits: int() past Python's 4,300 digits raised ("damaged")
        (
            "layer-name-digits",
            lambda fz, f: f.move("tensors/vision/L01", "tensors/vision/L" + "0" * 5000 + "1"),
            ["is neither a global kind nor a layer group"],
        ),
    ],
)
def test_what_the_tower_fuzzing_found(fz, tmp_path, name, mutate, needles):
    """The reader bugs the tower classes found, each fixed: read when valid, else one line."""
    from tests.support.cli import invoke, one_line_error

    bad = _tower_trace(fz, tmp_path / f"{name}.h5", lambda f: mutate(fz, f))
    r = invoke("show", bad)
    if needles is None:
        assert r.exit_code == 0, r.output
    else:
        line = one_line_error(r, *needles)
        assert "is damaged" not in line, line


@pytest.mark.slow
def test_no_creation_order_below_the_root(fz, tmp_path):
    """A group that tracks link creation order keeps 10+ links in a dense heap HDF5 does not checksum:
    one damaged byte of tensors/'s link to L03 there made HDF5 abort (a double free) while `trace show`
    listed the group (the fuzzer's seed 2024, case 122). The writer makes a version-2 trace's groups
    as a version-1 trace's: no creation order below the root, so no such link message exists."""
    import re

    path = fz.tower_golden(tmp_path / "v2.h5")
    with h5py.File(path, "r") as f:
        for group in ("tensors", "tensors/vision", "tensors/L03", "towers", "towers/vision"):
            assert f[group].id.get_create_plist().get_link_creation_order() == 0, group
    assert re.search(rb"\x01\x04.{8}\x03L03", path.read_bytes(), re.S) is None  # flags: creation order, "L03"


@pytest.mark.slow
def test_outside_watch_sees_a_read(fz, tmp_path):
    """The check itself: reading a watched file is seen (so 0 reads outside means something)."""
    target = tmp_path / "canary.bin"
    target.write_bytes(b"x")
    watch = fz.OutsideWatch([tmp_path])
    assert watch.ok
    assert watch.events() == []
    target.read_bytes()
    assert "canary.bin" in watch.events()


@pytest.mark.slow
def test_in_process_cases(fz):
    """A few cases in this very process (the worker's code path, without the isolation): twelve from
    the golden, then one of each tower class alone (read or refused as the format says)."""
    rep = fz.fuzz(12, SEED + 1, timeout=8.0, tower_share=0.0)
    assert rep.cases == 12 and not rep.failures, rep.failures[:3]
    for cls in fz.TOWER:
        rep = fz.fuzz(1, SEED + 3, timeout=30.0, only=cls)
        summary = fz.format_report(rep, f"fuzz(1, only={cls})")
        assert rep.cases == 1 and rep.mutations[cls] == 1, summary
        assert not rep.failures, summary + "\n" + "\n".join(rep.failures[:3])
        assert rep.watch_ok and not rep.outside and not rep.slow and not rep.big, summary


@pytest.mark.slow
def test_checker_rejects_what_it_must(fz):
    """The checks themselves: an internal error, two lines or a traceback are failures."""
    ok = "error: x.h5 is corrupt: ...\n"
    assert fz.check("show", 2, "", ok) is None
    assert fz.check("diff GOLDEN CORRUPT", 1, "first divergence: ...\n", "") is None
    assert fz.check("show", 1, "", "")  # show never exits 1
    assert fz.check("show", 2, "", "error: internal error (KeyError: 'x'); set GEMMA4_TRACE_DEBUG=1\n")
    assert fz.check("show", 2, "", ok + "more\n")
    assert fz.check("show", 2, "", "Traceback (most recent call last):\n")
    assert fz.check("show", None, "", "")  # a hang
    # a tower case alone: read what the format forbids, refuse what it allows, or call whole HDF5 damaged
    damaged = "error: x.h5 is damaged: reading towers/vision failed (IndexError: ...); ...\n"
    assert fz.expect_problem(fz.MUST_REFUSE, True, "show", 0, "")
    assert fz.expect_problem(fz.MUST_REFUSE, True, "diff CORRUPT GOLDEN", 1, "")
    assert fz.expect_problem(fz.MUST_REFUSE, True, "show", 2, ok) is None
    assert fz.expect_problem(fz.MUST_READ, True, "show --hash", 2, "error: x.h5 is not a valid trace: ...\n")
    assert fz.expect_problem(fz.MUST_READ, True, "diff GOLDEN CORRUPT", 2, "error: x.h5 is not a valid trace: .\n")
    other = "error: traces are of different model architectures (REF vs RUN): ...\n"
    assert fz.expect_problem(fz.MUST_READ, True, "diff GOLDEN CORRUPT", 2, other) is None  # valid, not comparable
    assert fz.expect_problem(None, True, "show", 2, damaged)
    assert fz.expect_problem(None, False, "show", 2, damaged) is None  # flipped bits: HDF5's own errors


@pytest.mark.slow
def test_listing_the_watched_folder_is_no_read(fz, tmp_path, monkeypatch):
    """Another process listing the temp folder meanwhile (`ls` in a loop) is not a read outside the
    file: only opens or reads of the watched files count (the folder watch counted every `ls`)."""
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # fuzz's folders land here, the loop looks here
    hits = tmp_path / "hits.txt"
    loop = subprocess.Popen(
        [
            "sh",
            "-c",
            f'while :; do ls -la "{tmp_path}"/trace-fuzz-outside-* >/dev/null 2>&1 && echo hit >> "{hits}"; done',
        ]
    )
    try:
        rep = fz.fuzz(2, SEED + 7, timeout=30.0, only="external_link")
    finally:
        loop.kill()
        loop.wait()
    assert hits.exists() and hits.read_text().count("hit") > 0  # the loop did list the watched folder meanwhile
    assert rep.watch_ok and not rep.outside, "\n".join(rep.outside[:3])
