"""Every bad trace input: exit 2 and one line naming the file and what is wrong, for
`trace show`, `trace show --hash`, `trace diff` (either side) and `trace replay` (REF).

The bad traces are copies of the smallest golden trace (a real recording), damaged one
way each; `trace replay` must refuse them before writing anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from gemma4_trace.recorder.golden import golden_path
from tests.support import invoke, one_line_error

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


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[[rule]\n", "not valid TOML"),
        ('[[rule]]\nkind = "q"\nrel_l2 = -1\n', "rel_l2 must be >= 0"),
        ('[[rule]]\nkind = "nope"\nrel_l2 = 1\n', "matches no kind"),
        ("\xff\xfe", "not valid TOML"),
        ("rule = 3\n", "array of tables"),
    ],
)
def test_invalid_tolerances_file(tmp_path, text, needle):
    p = tmp_path / "tol.toml"
    p.write_bytes(text.encode("latin-1"))
    one_line_error(invoke("diff", GOLDEN, GOLDEN, "--tolerances", p), str(p), needle)


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
