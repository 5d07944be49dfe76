"""`trace import` of encoder kinds (docs/import.md, "Encoder towers"): a dump of a synthetic
version-2 trace (tests/support/synth.py: a two-image vision tower of 2 layers, 6 + 3 patches, 2 + 1 soft
tokens) imports back to a trace `trace diff` finds equal to it, one changed encoder row is found
at its layer and patch, and bad maps and files are one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.reader import TraceReader
from tests.support import synth
from tests.support.cli import invoke, one_line_error

TOWERS = dict(towers=(synth.VISION,), config=synth.vision_config())
PAD = 16  # the patch embeddings are dumped padded to this many rows

TEXT_MAP = """runtime = "npu"

[[tensor]]
kind = "embeddings"
file = "step{step}/{kind}.npy"

[[tensor]]
kind = "per_layer_inputs"
file = "step{step}/{kind}.npy"

[[tensor]]
kind = "final_hidden"
file = "step{step}/{kind}.npy"

[[tensor]]
kind = "logits"
file = "step{step}/{kind}.npy"
""" + "".join(
    f'\n[[tensor]]\nkind = "{k}"\nfile = "step{{step}}/L{{layer}}_{{kind}}.npy"\n'
    for k in ("mask", "q", "k", "v", "attn_out", "layer_out")
)

VISION_MAP = """
[[tensor]]  # batch axis first, rows padded past the tower's patches; {step} is always 0
kind = "vision.patch_embeddings"
file = "step{step:03d}/patch_embeddings.npy"
axes = ["_", "pos", "d"]
rows = "padded"

[[tensor]]  # NCHW-like: (batch, heads, patches, head_dim)
kind = "vision.q"
file = "vision/L{layer}_q.npy"
axes = ["_", "head", "pos", "d"]

[[tensor]]
kind = "vision.k"
file = "vision/L{layer}_{kind}.npy"

[[tensor]]
kind = "vision.v"
file = "vision/L{layer}_{kind}.npy"

[[tensor]]
kind = "vision.attn_out"
file = "vision/L{layer}_attn.npy"
layers = [0, 1]

[[tensor]]
kind = "vision.mlp_out"
file = "vision/L{layer}_mlp.npy"

[[tensor]]  # (patches, hidden): the default layout
kind = "vision.layer_out"
file = "vision/layer{layer}_out.npy"

[[tensor]]  # raw: "n" is the kind's rows (here its 3 soft tokens)
kind = "vision.pooled"
file = "vision/pooled.bin"
dtype = "float32"
shape = ["n", 8]

[[tensor]]
kind = "vision.soft_tokens"
file = "vision/encoder.npz"
key = "soft_tokens"
"""


def write_dump(ref, dump):
    """Every dataset of REF, saved as the two maps above say."""
    with TraceReader(ref) as r:
        steps = r.step_positions
        for key, layer in r.kinds_present():
            spec = S.KIND_BY_NAME[key]
            data = r.read(key, layer)
            if spec.encoder:
                _save_encoder(dump, spec.name, layer, data)
            elif key != "token":
                for s, (a, b) in enumerate(steps):
                    rows = data[s] if spec.by_step else data[a:b]
                    name = key if layer is None else f"L{layer}_{key}"
                    (dump / f"step{s}").mkdir(parents=True, exist_ok=True)
                    np.save(dump / f"step{s}" / f"{name}.npy", rows)
    (dump / "map.toml").write_text(TEXT_MAP + VISION_MAP)
    return dump


def _save_encoder(dump, name, layer, data):
    (dump / "vision").mkdir(parents=True, exist_ok=True)
    (dump / "step000").mkdir(parents=True, exist_ok=True)
    if name == "patch_embeddings":
        padded = np.zeros((1, PAD, data.shape[1]), data.dtype)
        padded[0, : data.shape[0]] = data
        np.save(dump / "step000" / "patch_embeddings.npy", padded)
    elif name == "q":
        np.save(dump / "vision" / f"L{layer}_q.npy", data.transpose(1, 0, 2)[None])
    elif name in ("k", "v"):
        np.save(dump / "vision" / f"L{layer}_vision.{name}.npy", data)
    elif name == "attn_out":
        np.save(dump / "vision" / f"L{layer}_attn.npy", data)
    elif name == "mlp_out":
        np.save(dump / "vision" / f"L{layer}_mlp.npy", data)
    elif name == "layer_out":
        np.save(dump / "vision" / f"layer{layer}_out.npy", data)
    elif name == "pooled":
        data.astype("<f4").tofile(dump / "vision" / "pooled.bin")
    else:
        np.savez(dump / "vision" / "encoder.npz", soft_tokens=data)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("import-towers")
    synth.write_trace(d / "ref.h5", **TOWERS)
    synth.write_trace(d / "plain.h5")  # the same text tower, no vision tower
    synth.write_trace(d / "no-attn.h5", omit=("vision.attn_out",), **TOWERS)
    write_dump(d / "ref.h5", d / "dump")
    return d


@pytest.fixture
def dump(made, tmp_path):
    """A private copy of the dump, free to break."""
    return shutil.copytree(made / "dump", tmp_path / "dump")


def _import(made, dump, tmp_path, map_text=None, ref="ref.h5"):
    m = dump / "map.toml"
    if map_text is not None:
        m = tmp_path / "map.toml"
        m.write_text(map_text)
    return invoke("import", dump, "--reference", made / ref, "--map", m, "-o", tmp_path / "imp.h5")


def test_a_dump_with_an_encoder_tower_imports_equal_to_its_reference(made, tmp_path):
    res = _import(made, made / "dump", tmp_path)
    assert res.exit_code == 0, res.output
    assert "vision.patch_embeddings, vision.q, vision.k" in res.stdout  # encoder kinds first
    out = tmp_path / "imp.h5"
    with TraceReader(made / "ref.h5") as a, TraceReader(out) as b:
        assert b.towers == a.towers == {"vision": synth.VISION}  # the header (its tower table) is REF's
        assert b.kinds_present() == [kl for kl in a.kinds_present() if kl[0] != "token"] + [("token", None)]
        for key, layer in a.kinds_present():
            assert np.array_equal(a.read(key, layer), b.read(key, layer)), (key, layer)
        assert b.provenance["runtime"] == "npu" and b.mode == "teacher-forced"
    res = invoke("diff", made / "ref.h5", out)
    assert res.exit_code == 0, res.output


def test_one_changed_encoder_row_is_found_at_its_layer_and_patch(dump, made, tmp_path):
    path = dump / "vision" / "layer1_out.npy"
    rows = np.load(path)
    rows[7] += 1.0  # image 2, its patch 1
    np.save(path, rows)
    assert _import(made, dump, tmp_path).exit_code == 0
    res = invoke("diff", made / "ref.h5", tmp_path / "imp.h5", "--json")
    assert res.exit_code == 1, res.output
    d = json.loads(res.stdout)["first_divergence"]
    assert (d["step"], d["tower"], d["kind"], d["layer"], d["position"]) == (0, "vision", "vision.layer_out", 1, 7)


def test_encoder_kinds_without_files_are_absent(dump, made, tmp_path):
    shutil.rmtree(dump / "vision")
    res = _import(made, dump, tmp_path)
    assert res.exit_code == 0, res.output
    absent = "absent: vision.q, vision.k, vision.v, vision.attn_out, vision.mlp_out, vision.layer_out, vision.pooled"
    assert absent in res.stdout
    with TraceReader(tmp_path / "imp.h5") as r:
        assert r.towers == {"vision": synth.VISION}
        assert r.has("vision.patch_embeddings") and not r.has("vision.q", 0)


def _entry(kind, file, extra=""):
    return f'[[tensor]]\nkind = "{kind}"\nfile = "{file}"\n{extra}'


@pytest.mark.parametrize(
    "text,needles",
    [
        (_entry("smell.q", "a.npy"), ["#1", "'smell.q'", "no tower 'smell'", "vision, audio"]),
        (_entry("vision.mask", "a.npy"), ["'vision.mask'", "the vision tower has no kind 'mask'", "layer_out"]),
        (_entry("text.q", "a.npy"), ["a text kind is named alone (q"]),
        (_entry("vision.layer_out", "v/{layer}.npy", "layers = [2]\n"), ["names layer 2", "vision tower has 2 layers"]),
        (_entry("vision.layer_out", "v/{layer}_{position}.npy"), ["file uses {position}", "{step} (always 0)"]),
        (_entry("vision.layer_out", "v/{n}.npy"), ["file uses {n}"]),
        (_entry("vision.q", "v.npz", 'key = "q{start}"\n'), ["key uses {start}"]),
        (_entry("vision.layer_out", "v/{layer}.npy", 'rows = "absolute"\n'), ["'absolute' is for text kinds"]),
        (_entry("vision.layer_out", "v/{layer}.npy", 'axes = ["d"]\n'), ["lack 'pos'", "tower's rows"]),
        (_entry("vision.soft_tokens", "v.npy", "layers = [0]\n"), ["not per layer"]),
    ],
)
def test_bad_encoder_entries_are_one_line(dump, made, tmp_path, text, needles):
    one_line_error(_import(made, dump, tmp_path, text), *needles, out=tmp_path / "imp.h5")


def test_an_encoder_kind_needs_the_tower_in_ref(dump, made, tmp_path):
    res = _import(made, dump, tmp_path, ref="plain.h5")
    one_line_error(res, "kind vision.patch_embeddings: REF records no vision tower", out=tmp_path / "imp.h5")


def test_an_encoder_file_of_a_later_step_is_refused(dump, made, tmp_path):
    (dump / "step001").mkdir(exist_ok=True)
    shutil.copy(dump / "step000" / "patch_embeddings.npy", dump / "step001" / "patch_embeddings.npy")
    needles = [dump / "step001" / "patch_embeddings.npy", "vision.patch_embeddings at step 1", "step 0's only"]
    one_line_error(_import(made, dump, tmp_path), *needles, out=tmp_path / "imp.h5")


@pytest.mark.parametrize("case", ["patches", "soft_tokens", "padded", "width", "raw"])
def test_bad_encoder_files_name_the_file(dump, made, tmp_path, case):
    v = dump / "vision"
    if case == "patches":  # 8 rows for the tower's 9 patches
        path = v / "layer1_out.npy"
        np.save(path, np.load(path)[:8])
        needles = [path, "8 rows on axis 'pos', expected 9 (one per patch of REF's vision tower)"]
    elif case == "soft_tokens":  # 4 rows for its 3 soft tokens
        path = v / "encoder.npz"
        np.savez(path, soft_tokens=np.zeros((4, synth.HIDDEN), np.float32))
        needles = [path, "[soft_tokens]", "4 rows on axis 'pos', expected 3 (one per soft token"]
    elif case == "padded":  # padded, but shorter than the tower's patches
        path = dump / "step000" / "patch_embeddings.npy"
        np.save(path, np.load(path)[:, :5])
        needles = [path, "5 rows on axis 'pos', expected >= 9 (one per patch of REF's vision tower, then padding)"]
    elif case == "width":  # head_dim 5 where the tower table says 4
        path = v / "L0_q.npy"
        np.save(path, np.zeros((1, 2, 9, 5), np.float32))
        needles = [path, "rows of shape [2, 5]", "expected [2, 4] for vision.q"]
    else:  # raw: 3 soft tokens of 8 values make 96 bytes
        path = v / "pooled.bin"
        path.write_bytes(path.read_bytes()[:-4])
        needles = [path, "holds 92 bytes", "make 96"]
    one_line_error(_import(made, dump, tmp_path), *needles, out=tmp_path / "imp.h5")


def test_a_row_wider_than_ref_justifies_is_refused(dump, made, tmp_path):
    """REF without vision.attn_out: no exact width to compare with, so its tower table bounds the row
    (4 x the tower's hidden 8); a width within that is imported (the diff reports the shape)."""
    text = _entry("vision.attn_out", "wide{layer}.npy")
    for width, ok in ((9, True), (33, False)):
        for layer in (0, 1):
            np.save(dump / f"wide{layer}.npy", np.zeros((9, width), np.float32))
        res = _import(made, dump, tmp_path, text, ref="no-attn.h5")
        if ok:
            assert res.exit_code == 0, res.output
            (tmp_path / "imp.h5").unlink()
        else:
            needles = [dump / "wide0.npy", "[33]", "at most 32 values in a vision.attn_out row"]
            one_line_error(res, *needles, out=tmp_path / "imp.h5")
