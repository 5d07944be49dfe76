"""Encoder towers in the trace (schema version 2): written and read back, refused when damaged,
walked by the diff before the text tower, selected and tolerated by TOWER.KIND.

The traces are synthetic (tests/support/synth.py: a two-image vision tower of 2 layers) written by the real
writer; a text-only trace stays version 1 (tests/test_golden.py checks the goldens' content hashes).
"""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest

from gemma4_trace.traces import TraceReader, TraceWriter
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.selection import Selection
from tests.support import synth
from tests.support.cli import invoke, one_line_error

TOWERS = dict(towers=(synth.VISION,), config=synth.vision_config())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """REF, a RUN equal to it, a RUN off at vision layer 1 patch 7 (and later in the text tower),
    a RUN off in the text tower alone, and a text-only REF."""
    d = tmp_path_factory.mktemp("towers")

    def off_vision(kind, layer, step, rows):
        if kind == "vision.layer_out" and layer == 1:
            rows[7] += 1.0
        if kind == "layer_out" and layer == 2:
            rows += 1.0
        return rows

    def off_text(kind, layer, step, rows):
        if kind == "q" and layer == 1 and step == 2:
            rows += 1.0
        return rows

    synth.write_trace(d / "ref.h5", **TOWERS)
    synth.write_trace(d / "same.h5", mode="teacher-forced", **TOWERS)
    synth.write_trace(d / "vision.h5", mode="teacher-forced", edit=off_vision, **TOWERS)
    synth.write_trace(d / "text.h5", mode="teacher-forced", edit=off_text, **TOWERS)
    synth.write_trace(d / "plain.h5")
    synth.write_trace(d / "plain-off.h5", mode="teacher-forced", edit=off_text)
    return d


def test_a_trace_with_towers_is_version_2_and_reads_back(pair):
    with TraceReader(pair / "ref.h5") as r:
        assert r.f.attrs[S.ATTR_SCHEMA_VERSION] == 2
        assert r.towers == {"vision": synth.VISION}
        assert r.header().towers == (synth.VISION,)
        sites = r.sites()
        assert [str(s) for s in sites[:3]] == ["vision.patch_embeddings", "vision.q layer 0", "vision.k layer 0"]
        assert sites.index(S.Site("vision", "soft_tokens")) < sites.index(S.Site("text", "embeddings"))
        assert r.read("vision.layer_out", 1).shape == (9, 8)  # 6 + 3 patches, the tower's hidden 8
        assert r.read("vision.soft_tokens").shape == (3, synth.HIDDEN)  # 2 + 1 soft tokens, the text width
        assert r.read("vision.q", 0).shape == (9, 2, 4)
    with TraceReader(pair / "plain.h5") as r:  # the text tower alone: version 1, no towers/ table
        assert r.f.attrs[S.ATTR_SCHEMA_VERSION] == 1 and S.GROUP_TOWERS not in r.f and r.towers == {}


def test_the_rows_written_are_the_rows_read(tmp_path):
    """Two images reported apart come back as one dataset, image after image."""
    rng = np.random.default_rng(3)
    first, second = rng.standard_normal((6, 8)), rng.standard_normal((3, 8))
    seen = {}

    def keep(kind, layer, step, rows):
        if kind == "vision.patch_embeddings":
            rows = np.concatenate([first, second])
        seen[(kind, layer)] = rows.copy()
        return rows

    synth.write_trace(tmp_path / "t.h5", edit=keep, **TOWERS)
    with TraceReader(tmp_path / "t.h5") as r:
        for key, layer in r.kinds_present():
            if S.KIND_BY_NAME[key].encoder:
                np.testing.assert_array_equal(r.read(key, layer), seen[(key, layer)].astype(np.float32))
        np.testing.assert_array_equal(r.read("vision.patch_embeddings")[6:], second.astype(np.float32))


def test_an_older_reader_refuses_version_2_in_one_line(pair, monkeypatch):
    """A reader whose newest version is 1 (every release before towers) says so, never misreads."""
    monkeypatch.setattr(S, "SCHEMA_VERSION", 1)
    with pytest.raises(TraceToolError, match="schema version 2, newer than this tool reads \\(1\\); upgrade"):
        TraceReader(pair / "ref.h5")


def test_the_diff_walks_the_encoder_first_and_names_its_tower(pair):
    r = invoke("diff", pair / "ref.h5", pair / "vision.h5", "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)["first_divergence"]
    assert (d["step"], d["layer"], d["kind"], d["position"], d["tower"]) == (0, 1, "vision.layer_out", 7, "vision")
    assert d["origin"]["verdict"] == "introduced" and d["origin"]["input_kind"] == "vision.layer_out"
    text = invoke("diff", pair / "ref.h5", pair / "vision.h5").stdout
    assert "prefill step 0, vision tower, layer 1, kind layer_out, patch 7 (image 2, its patch 1)" in text
    origin = next(line for line in text.splitlines() if "origin:" in line)
    assert "introduced in vision layer 1: its input (vision.layer_out of layer 0)" in origin
    assert "layer output" not in origin  # the divergent tensor is the layer's output


def test_a_text_divergence_of_a_trace_with_towers(pair):
    r = invoke("diff", pair / "ref.h5", pair / "text.h5", "--json")
    d = json.loads(r.stdout)["first_divergence"]
    assert (d["step"], d["layer"], d["kind"], d["tower"]) == (2, 1, "q", "text")
    assert invoke("diff", pair / "ref.h5", pair / "same.h5").exit_code == 0


def test_a_text_only_diff_has_no_tower_field(pair):
    r = invoke("diff", pair / "plain.h5", pair / "plain-off.h5", "--json")
    d = json.loads(r.stdout)["first_divergence"]
    assert d["kind"] == "q" and "tower" not in d


def test_traces_with_other_tower_tables_are_refused(pair, tmp_path):
    other = synth.VISION.__class__("vision", 2, 8, 2, 4, item_rows=(5, 4), item_tokens=(2, 1))
    synth.write_trace(tmp_path / "other.h5", towers=(other,), config=synth.vision_config())
    r = invoke("diff", pair / "ref.h5", tmp_path / "other.h5")
    one_line_error(r, "traces encode different inputs in the vision tower: REF rows 6+3", "RUN rows 5+4")
    wider = synth.VISION.__class__("vision", 2, 16, 2, 4, item_rows=(6, 3), item_tokens=(2, 1))
    config = synth.vision_config() | {"vision_config": synth.VISION_CONFIG | {"hidden_size": 16}}
    synth.write_trace(tmp_path / "wider.h5", towers=(wider,), config=config)
    r = invoke("diff", pair / "ref.h5", tmp_path / "wider.h5")
    one_line_error(r, "different model architectures", "vision tower (2 layers, hidden 8, 2 heads of 4) vs (2 layers")


def test_tolerances_and_selections_name_a_tower(pair, tmp_path):
    tol = tmp_path / "tol.toml"
    tol.write_text('[[rule]]\nkind = "vision.layer_out"\nrel_l2 = 10\nmax_abs = 10\n')
    r = invoke("diff", pair / "ref.h5", pair / "vision.h5", "--json", "--tolerances", tol)
    assert json.loads(r.stdout)["first_divergence"]["kind"] == "layer_out"  # the text tower's, at layer 2
    tol.write_text('[[rule]]\nkind = "vision.nope"\nrel_l2 = 1\n')
    one_line_error(invoke("diff", pair / "ref.h5", pair / "vision.h5", "--tolerances", tol), "matches no kind")
    sel = Selection.parse(kinds="vision.layer_out,q")
    assert sel.kinds == ("vision.layer_out", "q", "logits", "token")
    assert sel.keeps("vision.layer_out", 1) and not sel.keeps("vision.q", 0)
    assert Selection.parse(layers="0", kinds="vision.layer_out").keeps("vision.layer_out", 1)  # text layers only
    for kinds, needle in (("smell.q", "unknown tower 'smell'"), ("vision.mask", "the vision tower has no kind 'mask'")):
        with pytest.raises(TraceToolError, match=needle):
            Selection.parse(kinds=kinds)


def test_a_selective_trace_keeps_the_tower_kinds_asked(tmp_path):
    sel = Selection.parse(kinds="vision.soft_tokens,embeddings")
    path = tmp_path / "s.h5"
    with TraceWriter(path, selection=sel) as w:
        _write_by_hand(w)
    with TraceReader(path) as r:
        assert [k for k, _ in r.kinds_present()] == ["vision.soft_tokens", "embeddings", "logits", "token"]


def _write_by_hand(w, rows=9, step1=None):
    """A one-image-tower trace's header and prefill written directly (rows: patches reported)."""
    from gemma4_trace.traces import Provenance, TraceHeader

    tower = synth.VISION
    w.write_header(
        TraceHeader(
            Provenance.from_dict(synth.provenance(config=synth.vision_config())),
            np.arange(5),
            synth.LAYERS,
            max_new_tokens=2,
            eos_token_ids=[1],
            towers=(tower,),
        )
    )
    w.begin_step(range(0, 5))
    for site in S.dataflow({"vision": tower.layers}):
        spec = site.spec
        n = tower.tokens if spec.index == S.ROW_SOFT_TOKEN else rows
        width = {"hidden": 8, "heads": 2, "head_dim": 4, "model_hidden": synth.HIDDEN}
        w.add(site.kind, np.ones((n, *(width[a.width] for a in spec.axes))), layer=site.layer, tower="vision")
    w.add("embeddings", np.ones((5, synth.HIDDEN)))
    w.add("logits", np.ones(synth.VOCAB))
    w.add("token", np.int64(3))
    w.end_step()
    if step1 is not None:
        w.begin_step(range(5, 6))
        step1(w)
        w.end_step()


@pytest.mark.parametrize(
    "how, message",
    [
        (dict(rows=8), "vision.patch_embeddings: 8 rows, but its tower declares 9"),
        (dict(rows=10), "10 rows, more than the 9 its tower declares"),
        (
            dict(step1=lambda w: w.add("layer_out", np.ones((1, 8)), 0, tower="vision")),
            "in the prefill \\(step 0\\), not step 1",
        ),
        (dict(step1=lambda w: w.add("layer_out", np.ones((1, 8)), 5, tower="vision")), "in the prefill"),
        (dict(step1=lambda w: w.add("mask", np.ones((1, 8)), 0, tower="vision")), "no kind 'mask' in the 'vision'"),
    ],
)
def test_the_writer_refuses_rows_its_tower_does_not_declare(tmp_path, how, message):
    path = tmp_path / "w.h5"
    with pytest.raises(ValueError, match=message):
        with TraceWriter(path) as w:
            _write_by_hand(w, **how)
    assert not path.exists() and not list(tmp_path.iterdir())  # no half-written trace


def test_the_probe_takes_a_tower(tmp_path):
    from gemma4_trace.replayer.api import ReportError, WriterProbe

    with TraceWriter(tmp_path / "p.h5") as w:
        _write_by_hand(w)
        w.begin_step(range(5, 6))
        probe = WriterProbe(w, "test")
        for bad, needle in (
            (dict(tower="smell"), "unknown tower 'smell'"),
            (dict(tower="vision", layer=None), "'vision.layer_out' with layer=None; vision.layer_out is per layer"),
        ):
            with pytest.raises(ReportError, match=needle):
                probe.tensor("layer_out", np.ones((1, 8)), **({"layer": 0} | bad))
        with pytest.raises(ReportError, match="in the prefill"):
            probe.tensor("layer_out", np.ones((1, 8)), layer=0, tower="vision")
        with pytest.raises(ReportError, match="more than 1 row"):  # a decode step's one row of hidden
            probe.tensor("layer_out", np.ones((1, 10**6)), layer=0)
        w.end_step()


def _damage(src, dst, fn):
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        fn(f)
    return dst


def _set_config(f, **over):
    cfg = json.loads(f.attrs["model_config"])
    for k, v in over.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    f.attrs["model_config"] = json.dumps(cfg)


def _resize(name, rows):
    def fn(f):
        data = f[name][()]
        attrs = dict(f[name].attrs)
        del f[name]
        f.create_dataset(name, data=np.resize(data, (rows, *data.shape[1:])))
        for k, v in attrs.items():
            f[name].attrs[k] = v

    return fn


BAD = [
    ("older-reader", lambda f: f.attrs.__setitem__("schema_version", 1), ["schema version 1 but holds a towers/"]),
    ("hidden-disagrees", lambda f: f["towers/vision"].attrs.__setitem__("hidden", 16), ["says hidden 16", "says 8"]),
    ("layers-disagree", lambda f: f["towers/vision"].attrs.__setitem__("layers", 3), ["says layers 3"]),
    ("no-vision-config", lambda f: _set_config(f, vision_config=None), ["has no 'vision_config'"]),
    ("tower-unknown", lambda f: f["towers"].create_group("smell"), ["'smell', which is not part of a trace"]),
    ("table-empty", lambda f: f["towers"].__delitem__("vision"), ["'towers' table is empty"]),
    ("rows-past-tower", _resize("tensors/vision/L01/layer_out", 12), ["has 12 rows, expected 9 (one per patch"]),
    ("tokens-past-tower", _resize("tensors/vision/soft_tokens", 4), ["has 4 rows, expected 3 (one per soft token"]),
    (
        "layer-past-tower",
        lambda f: f.move("tensors/vision/L01", "tensors/vision/L02"),
        ["the vision tower has 2 layers"],
    ),
    (
        "text-kind-in-tower",
        lambda f: f.move("tensors/vision/pooled", "tensors/vision/logits"),
        ["neither a global kind"],
    ),
    ("items-mismatch", _resize("towers/vision/item_tokens", 3), ["2 items' rows but 3 items' soft tokens"]),
    (
        "item-zero",
        lambda f: f["towers/vision/item_rows"].__setitem__(0, 0),
        ["'towers/vision/item_rows' holds", "expected 1.."],
    ),
    ("image-tokens", lambda f: _set_config(f, image_token_id=4), ["declares 3 soft tokens, but the prompt holds"]),
    (
        "attr-missing",
        lambda f: f["towers/vision"].attrs.__delitem__("heads"),
        ["'heads' of 'towers/vision' is missing"],
    ),
]


@pytest.mark.parametrize("name, fn, needles", BAD, ids=[b[0] for b in BAD])
def test_a_damaged_tower_table_is_one_line(pair, tmp_path, name, fn, needles):
    bad = _damage(pair / "ref.h5", tmp_path / f"{name}.h5", fn)
    one_line_error(invoke("show", bad), *needles)
    one_line_error(invoke("diff", bad, pair / "ref.h5"), *needles)


def test_show_names_the_tower(pair):
    text = invoke("show", pair / "ref.h5").stdout
    assert "schema v2" in text
    assert "tower      vision: 2 layers (hidden 8, 2 heads of 4); 2 image(s): 6+3 patches, 2+1 soft tokens" in text


def test_the_heatmap_draws_a_band_per_tower(pair, tmp_path):
    out = tmp_path / "r.html"
    assert invoke("diff", pair / "ref.h5", pair / "vision.h5", "--report", out).exit_code == 1
    page = out.read_text()
    assert "vL0" in page and "vL1" in page and "vision tower layer_out of layer 1 (prefill only)" in page
    assert 'data-row="vL1"' in page  # the first divergence marked on its tower's layer
    assert "The bands above the inputs are the encoder towers' layers" in page


def test_calibrate_writes_tower_rules(pair, tmp_path):
    out = tmp_path / "tol.toml"
    r = invoke("calibrate", pair / "ref.h5", pair / "same.h5", "-o", out)
    assert r.exit_code == 0, r.output
    assert 'kind = "vision.layer_out"\nlayer = 1\nstep = "prefill"' in out.read_text()
    assert 'kind = "vision.layer_out"\nlayer = 1\nstep = "decode"' not in out.read_text()


def test_a_replay_carries_refs_tower_table(pair):
    """RUN's header is REF's: a runtime can report the towers REF records (and a v1 REF stays v1)."""
    from gemma4_trace.replayer.core import read_reference

    assert read_reference(pair / "ref.h5").towers == (synth.VISION,)
    assert read_reference(pair / "plain.h5").towers == ()


def test_a_tower_the_trace_does_not_record_is_named(tmp_path):
    from gemma4_trace.replayer.api import ReportError, WriterProbe

    with TraceWriter(tmp_path / "p.h5") as w:
        _write_by_hand(w)
        w.begin_step(range(5, 6))
        with pytest.raises(ReportError, match="the trace header declares no audio tower"):
            WriterProbe(w, "test").tensor("layer_out", np.ones((1, 8)), layer=0, tower="audio")
        with pytest.raises(ValueError, match="positions= names text positions"):
            w.add("layer_out", np.ones((1, 8)), layer=0, tower="vision", positions=[5])
        w.end_step()


def test_kinds_of_towers_a_trace_lacks_leave_a_version_1_selection(tmp_path):
    """--kinds vision.layer_out on a text-only run: nothing to keep of it, the trace stays version 1."""
    sel = Selection.parse(kinds="vision.layer_out,q")
    synth.write_trace(tmp_path / "t.h5")
    with TraceWriter(tmp_path / "s.h5", selection=sel) as w:
        with TraceReader(tmp_path / "t.h5") as r:
            w.write_header(r.header())
        w.begin_step(range(0, 5))
        w.add("q", np.ones((5, 2, 4)), layer=0)
        w.add("logits", np.ones(synth.VOCAB))
        w.add("token", np.int64(1))
        w.end_step()
    with TraceReader(tmp_path / "s.h5") as r:
        assert r.f.attrs[S.ATTR_SCHEMA_VERSION] == 1 and r.selection.kinds == ("q", "logits", "token")


def test_an_encoder_judged_by_a_baselines_envelope(tmp_path):
    """--baseline: RUN's vision error inside BASE's envelope matches, and the heatmap's band is coloured
    against that envelope (BASE's rel-L2 of the band in the prefill column), as the text rows are."""
    from gemma4_trace.diff import diff_traces

    def scale(k):
        return lambda kind, layer, step, rows: rows * k if kind == "vision.layer_out" else rows

    synth.write_trace(tmp_path / "ref.h5", **TOWERS)
    synth.write_trace(tmp_path / "run.h5", mode="teacher-forced", edit=scale(1.001), **TOWERS)
    synth.write_trace(tmp_path / "base.h5", mode="teacher-forced", edit=scale(1.0005), **TOWERS)
    alone = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5")
    assert not alone.match and alone.first_divergence.kind == "vision.layer_out"  # 1e-3 > the tolerance 1e-4
    r = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5", baseline_path=tmp_path / "base.h5")
    assert r.match, r.first_divergence
    band = r.growth.base[("vision.layer_out", 1)]
    assert band[0] == pytest.approx(5e-4, rel=1e-3) and band[1:] == [None] * 3
