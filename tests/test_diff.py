"""trace diff on synthetic traces with divergences planted at known places."""

import dataclasses
import json
import math
from html.parser import HTMLParser

import numpy as np
import pytest

import gemma4_trace.diff.blocks as diff_blocks
from gemma4_trace.diff import diff_traces, format_text, load_tolerances, render_html, write_html
from gemma4_trace.diff.result import Skipped
from gemma4_trace.traces import TraceToolError
from tests.support.cli import site_of
from tests.support.diff_fixtures import chain
from tests.support.synth import LAYERS, WINDOW, write_trace


def plant(**where):
    """An edit that adds `delta` at (kind, layer, step, row, index) or sets `value` there."""
    kind, layer, step = where["kind"], where.get("layer"), where["step"]
    row, index = where.get("row", 0), tuple(where.get("index", (0,)))
    delta, value = where.get("delta", 1.0), where.get("value")

    def edit(k, l, s, rows):
        if (k, l, s) == (kind, layer, step):
            if np.ndim(rows) == 0:  # the chosen token
                return np.int64(value)
            if value is not None:
                rows[(row, *index)] = value
            else:
                rows[(row, *index)] += delta
        return rows

    return edit


def noise(rel, kinds=None, layers=None, seed=7):
    """Gaussian noise of relative size `rel` on float kinds (a lower-precision run)."""
    rng = np.random.default_rng(seed)

    def edit(k, l, s, rows):
        if (
            rows.dtype.kind != "f"
            or k == "token"
            or (kinds and k not in kinds)
            or (layers is not None and l not in layers)
        ):
            return rows
        return rows + rel * rng.standard_normal(rows.shape) * np.sqrt(np.mean(rows**2))

    return edit


@pytest.fixture
def ref(tmp_path):
    p = tmp_path / "ref.h5"
    write_trace(p)
    return p


def run_trace(tmp_path, name="run.h5", **kw):
    p = tmp_path / name
    write_trace(p, mode=kw.pop("mode", "teacher-forced"), **kw)
    return p


def first(r):
    """The first divergence as JSON consumers see it."""
    return r.to_json()["first_divergence"]


def check_contract(j):
    assert set(j) >= {"match", "first_divergence", "tokens"}
    assert isinstance(j["match"], bool)
    t = j["tokens"]
    assert all(isinstance(x, int) for x in t["reference"] + t["candidate"])
    assert isinstance(t["accuracy"], float)
    assert t["first_mismatch_step"] is None or isinstance(t["first_mismatch_step"], int)
    d = j["first_divergence"]
    if d is not None:
        assert isinstance(d["step"], int) and d["phase"] in ("prefill", "decode")
        assert d["layer"] is None or isinstance(d["layer"], int)
        assert isinstance(d["kind"], str) and isinstance(d["position"], int)
        assert isinstance(d["metric"], str) and isinstance(d["value"], float) and isinstance(d["threshold"], float)
    json.dumps(j, allow_nan=False)  # strict JSON


# ---------------------------------------------------------------- match
def test_identical_traces_match(ref, tmp_path):
    r = diff_traces(ref, run_trace(tmp_path))
    assert r.match and r.first_divergence is None
    j = r.to_json()
    check_contract(j)
    assert j["tokens"]["accuracy"] == 1.0 and j["tokens"]["first_mismatch_step"] is None
    assert len(j["tokens"]["reference"]) == 4
    assert format_text(r).startswith("match: no divergence")
    # layer x step growth table, all zero
    assert j["growth"]["layers"] == [0, 1, 2, 3] and len(j["growth"]["table"][0]) == 4
    assert all(v == 0 for row in j["growth"]["table"] for v in row)


def test_static_mask_width_is_not_a_divergence(ref, tmp_path):
    # a static runtime stores masks over max_seq keys; columns past HF's width mean "blocked"
    r = diff_traces(ref, run_trace(tmp_path, mask_width=16))
    assert r.match, format_text(r)


# ---------------------------------------------------------------- first divergence
def test_planted_value_reported_exactly(ref, tmp_path):
    run = run_trace(tmp_path, edit=plant(kind="k", layer=2, step=2, index=(0, 3)))
    r = diff_traces(ref, run)
    d = first(r)
    assert not r.match
    assert site_of(d, "step", "phase", "layer", "kind", "position") == (2, "decode", 2, "k", 6)
    assert (d["head"], d["channel"]) == (0, 3)
    assert d["metric"] == "rel_l2" and d["value"] > d["threshold"] == 1e-4
    assert d["run_value"] == pytest.approx(d["ref_value"] + 1.0, abs=1e-5)
    assert d["worst"]["index"] == [0, 3]
    assert d["origin"]["verdict"] == "introduced"
    check_contract(r.to_json())
    line = format_text(r).splitlines()[0]
    assert line.startswith("first divergence: decode step 2, layer 2 (sliding_attention, stores K/V")
    assert "kind k, position 6, head 0 channel 3: rel-L2" in line and "> 1e-4 (REF" in line
    # the typed result behind the JSON
    t = r.first_divergence
    assert (t.phase, t.layer_info.kv_role, t.detail.first.names, t.origin.input.kind) == (
        "decode",
        "stores",
        {"head": 0, "channel": 3},
        "layer_out",
    )


def test_earliest_in_dataflow_order_wins(ref, tmp_path):
    run = run_trace(
        tmp_path,
        edit=chain(
            plant(kind="embeddings", step=2, index=(1,)),  # later step
            plant(kind="attn_out", layer=3, step=1, index=(2,)),  # same step, later layer
            plant(kind="layer_out", layer=0, step=1, index=(4,)),  # <- first
            plant(kind="q", layer=1, step=0, row=3, index=(1, 5), delta=0.0),  # no change
        ),
    )
    d = first(diff_traces(ref, run))
    assert site_of(d, "step", "layer", "kind", "position", "channel") == (1, 0, "layer_out", 5, 4)


def test_prefill_first_failing_position_and_head(ref, tmp_path):
    run = run_trace(
        tmp_path,
        edit=chain(
            plant(kind="q", layer=1, step=0, row=4, index=(0, 0)),
            plant(kind="q", layer=1, step=0, row=2, index=(1, 6)),  # earlier position wins
        ),
    )
    d = first(diff_traces(ref, run))
    assert site_of(d, "step", "phase", "layer", "kind", "position", "head", "channel") == (
        0,
        "prefill",
        1,
        "q",
        2,
        1,
        6,
    )


def test_sliding_window_off_by_one_in_mask(ref, tmp_path):
    # decode step 3 feeds position 7; window 4 allows keys 4..7; the runtime also allows key 3
    assert WINDOW == 4

    def widen(k, l, s, rows):
        if k == "mask" and LAYERS[l].layer_type == "sliding_attention" and s == 3:
            rows[0, 3] = True
        return rows

    r = diff_traces(ref, run_trace(tmp_path, edit=widen, mask_width=12))
    d = first(r)
    assert site_of(d, "step", "layer", "kind", "position", "metric") == (3, 0, "mask", 7, "mask_keys")
    assert d["allowed_in_run_blocked_in_ref"] == [3] and d["blocked_in_run_allowed_in_ref"] == []
    assert d["value"] == 1.0
    assert "key 3 allowed in RUN, blocked in REF" in format_text(r)
    assert d["origin"]["verdict"] == "introduced"


def test_padding_slot_visible_in_mask(ref, tmp_path):
    # the static runtime lets the prefill's last query see a never-written cache slot
    run = run_trace(tmp_path, edit=plant(kind="mask", layer=1, step=0, row=4, index=(10,), value=True), mask_width=12)
    r = diff_traces(ref, run)
    d = first(r)
    assert site_of(d) == (0, 1, "mask", 4)
    assert d["allowed_in_run_blocked_in_ref"] == [10]
    assert "key 10 (never-written slot) allowed in RUN, blocked in REF" in d["sentence"]


def test_future_key_blocked_and_allowed(ref, tmp_path):
    run = run_trace(
        tmp_path,
        edit=chain(
            plant(kind="mask", layer=0, step=0, row=1, index=(2,), value=True),  # future token leaks
            plant(kind="mask", layer=0, step=0, row=1, index=(0,), value=False),
        ),
    )
    d = first(diff_traces(ref, run))
    assert (
        d["position"] == 1 and d["allowed_in_run_blocked_in_ref"] == [2] and d["blocked_in_run_allowed_in_ref"] == [0]
    )
    assert "key 2 (future) allowed in RUN" in d["sentence"] and "key 0 blocked in RUN, allowed in REF" in d["sentence"]


def test_nan_never_passes(ref, tmp_path):
    run = run_trace(tmp_path, edit=plant(kind="attn_out", layer=3, step=1, index=(2,), value=np.nan))
    d = first(diff_traces(ref, run))
    assert site_of(d, "step", "layer", "kind", "metric", "channel") == (1, 3, "attn_out", "nonfinite", 2)
    # NaN at the same place in both traces is not a match either
    nan = plant(kind="final_hidden", step=0, row=1, index=(0,), value=np.inf)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, edit=nan)
    write_trace(b, edit=nan)
    r = diff_traces(a, b)
    assert not r.match and first(r)["kind"] == "final_hidden" and first(r)["metric"] == "nonfinite"
    json.dumps(r.to_json(), allow_nan=False)


def test_shape_mismatch_is_a_divergence_not_a_crash(ref, tmp_path):
    def cut(k, l, s, rows):
        return rows[:, :, :7] if (k, l) == ("q", 1) else rows

    r = diff_traces(ref, run_trace(tmp_path, edit=cut))
    d = first(r)
    assert site_of(d, "kind", "layer", "metric", "step") == ("q", 1, "shape", 0)
    assert "(2, 8) in REF vs (2, 7) in RUN" in format_text(r)


def test_logits_divergence_global_kind(ref, tmp_path):
    def capless(k, l, s, rows):  # e.g. a missing final soft-cap
        return rows * 1.5 if k == "logits" and s == 1 else rows

    d = first(diff_traces(ref, run_trace(tmp_path, edit=capless)))
    assert site_of(d) == (1, None, "logits", 5)
    assert d["origin"]["verdict"] == "introduced" and d["origin"]["input_kind"] == "final_hidden"


def test_row_blocks_give_the_same_answer(tmp_path, monkeypatch):
    monkeypatch.setattr(diff_blocks, "BLOCK_BYTES", 1)  # one chunk per read
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, prompt_len=700, new_tokens=2)
    write_trace(b, prompt_len=700, new_tokens=2, edit=plant(kind="layer_out", layer=2, step=0, row=650, index=(3,)))
    d = first(diff_traces(a, b))
    assert site_of(d, "kind", "layer", "position", "channel") == ("layer_out", 2, 650, 3)


# ---------------------------------------------------------------- tokens
def _token_flip(tokens, step, alt, top, second):
    """Edit for both traces: logits at `step` with REF's token at `top` and `alt` at `second`."""

    def edit(k, l, s, rows):
        if k == "logits" and s == step:
            rows[:] = -3.0
            rows[tokens[step]] = top
            rows[alt] = second
        return rows

    return edit


@pytest.mark.parametrize("second,label", [(2.8, "near tie"), (-1.0, "real error")])
def test_token_flip_labelled(tmp_path, second, label):
    tokens = write_trace(tmp_path / "probe.h5")
    alt = (int(tokens[2]) + 1) % 11
    logits = _token_flip(tokens, 2, alt, 3.0, second)
    write_trace(tmp_path / "ref.h5", edit=logits)
    run = run_trace(tmp_path, edit=chain(logits, plant(kind="token", step=2, index=(), value=alt)))
    r = diff_traces(tmp_path / "ref.h5", run)
    d, t = first(r), r.to_json()["tokens"]
    assert site_of(d, "step", "kind", "layer", "position", "metric") == (2, "token", None, 6, "token")
    assert t["first_mismatch_step"] == 2 and t["accuracy"] == 0.75
    assert t["reference_token"] == tokens[2] and t["candidate_token"] == alt
    assert t["candidate_rank"] == 2 and t["reference_margin"] == pytest.approx(3.0 - second)
    assert t["label"] == label == d["label"]
    assert f"RUN chose token {alt}, REF chose {tokens[2]} ({label}" in format_text(r)
    check_contract(r.to_json())


def test_accept_near_ties(tmp_path):
    tokens = write_trace(tmp_path / "probe.h5")
    alt = (int(tokens[1]) + 1) % 11
    logits = _token_flip(tokens, 1, alt, 3.0, 2.9)
    write_trace(tmp_path / "ref.h5", edit=logits)
    run = run_trace(tmp_path, edit=chain(logits, plant(kind="token", step=1, index=(), value=alt)))
    tol = tmp_path / "t.toml"
    tol.write_text("[tokens]\naccept_near_ties = true\nnear_tie_margin = 0.2\n")
    r = diff_traces(tmp_path / "ref.h5", run, tol)
    assert r.match and r.tokens.first_mismatch_step == 1 and r.tokens.flip.label == "near tie"


def test_free_running_stops_comparing_numbers_after_token_mismatch(ref, tmp_path):
    tokens = write_trace(tmp_path / "probe.h5")
    alt = (int(tokens[1]) + 1) % 11

    def diverge_after(k, l, s, rows):  # different inputs after the flip: every number differs
        if s >= 2 and rows.dtype.kind == "f":
            rows = rows + 1.0
        return rows

    edit = chain(plant(kind="token", step=1, index=(), value=alt), diverge_after)
    free = diff_traces(ref, run_trace(tmp_path, "free.h5", mode="free-running", edit=edit))
    d = first(free)
    assert site_of(d, "step", "kind") == (1, "token")
    assert free.steps.numbers_compared == 2 and free.steps.compared == 4
    assert any("not compared" in n for n in free.notes)
    assert "tensors of steps 2..3 were not compared" in format_text(free)
    assert len(free.growth.table[0]) == 2
    # teacher-forced: everything is compared, the same plant diverges in numbers too
    tf = diff_traces(ref, run_trace(tmp_path, "tf.h5", edit=edit))
    assert tf.steps.numbers_compared == 4 and (first(tf)["step"], first(tf)["kind"]) == (1, "token")
    assert any(t.kind == "embeddings" and t.status == "diverged" for t in tf.tensors)
    assert not any("not compared" in n for n in tf.notes)


def test_fewer_steps_compares_common_steps(ref, tmp_path):
    r = diff_traces(ref, run_trace(tmp_path, mode="free-running", stop_after=3))
    assert r.match
    assert r.steps.compared == 3 and r.tokens.compared_steps == 3
    assert "RUN has 3 steps, REF has 4: compared the first 3" in format_text(r)


def test_missing_kind_is_reported_but_only_logits_and_token_diverge(ref, tmp_path):
    r = diff_traces(ref, run_trace(tmp_path, "a.h5", omit=("final_hidden", "rope_cos_full")))
    assert r.match
    assert Skipped("final_hidden", None, "only in REF") in r.skipped
    assert "final_hidden (only in REF)" in format_text(r)
    r = diff_traces(ref, run_trace(tmp_path, "b.h5", omit=("logits",)))
    assert not r.match and first(r)["kind"] == "logits" and first(r)["metric"] == "missing"


# ---------------------------------------------------------------- precision and tolerances
def test_bfloat16_run_gets_looser_defaults(ref, tmp_path):
    bf = run_trace(tmp_path, "bf.h5", edit=noise(1e-2), dtype="bfloat16", source_dtype="bfloat16")
    r = diff_traces(ref, bf)
    assert r.match, format_text(r)
    assert {t.precision for t in r.tensors if t.precision} == {"bfloat16"}
    assert r.growth.thresholds[0][0] == 5e-2
    # the same error in a float32 run is a divergence
    f32 = run_trace(tmp_path, "f32.h5", edit=noise(1e-2))
    r = diff_traces(ref, f32)
    assert not r.match and first(r)["kind"] == "embeddings" and first(r)["precision"] == "float32"


def test_tolerance_file_loosens_one_kind_and_next_divergence_shows(ref, tmp_path):
    run = run_trace(
        tmp_path,
        edit=chain(
            plant(kind="k", layer=0, step=1, index=(0, 2), delta=0.5),
            plant(kind="attn_out", layer=3, step=2, index=(1,)),
        ),
    )
    assert first(diff_traces(ref, run))["kind"] == "k"
    tol = tmp_path / "tol.toml"
    tol.write_text('[[rule]]\nkind = "k"\nlayer = "0-1"\nrel_l2 = 0.9\n')
    d = first(diff_traces(ref, run, tol))
    assert site_of(d, "step", "layer", "kind") == (2, 3, "attn_out")
    # a later rule overrides an earlier one
    tol.write_text('[[rule]]\nkind = "k"\nrel_l2 = 0.9\n[[rule]]\nkind = "*"\nstep = "decode"\nrel_l2 = 1e-4\n')
    assert first(diff_traces(ref, run, tol))["kind"] == "k"
    # skip a kind in one layer on prefill only: not enough, the plant is on decode step 1
    tol.write_text('[[rule]]\nkind = "k"\nstep = "prefill"\nskip = true\n')
    assert first(diff_traces(ref, run, tol))["kind"] == "k"
    tol.write_text(
        '[[rule]]\nkind = "attn_*"\nlayer = "3"\nstep = "1-"\nmax_abs = 0.5\nrel_l2 = false\n'
        '[[rule]]\nkind = "k"\nskip = true\n'
    )
    d = first(diff_traces(ref, run, tol))
    assert (d["kind"], d["metric"], d["threshold"]) == ("attn_out", "max_abs", 0.5)


def test_tolerance_rule_matching():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.toml"
        p.write_text(
            '[[rule]]\nrel_l2 = 1e-3\n[[rule]]\nkind = ["q", "k"]\nlayer = "1,3"\nstep = "2-3"\nrel_l2 = 0.5\n'
            '[[rule]]\nlayer = "*"\ncosine = 0.99\n[[rule]]\nlayer = "0-"\nmax_abs = 2\n'
        )
        t = load_tolerances(p)
        q1 = t.resolve("q", 1, "float32", 5)
        assert list(q1.limits["rel_l2"]) == [1e-3, 1e-3, 0.5, 0.5, 1e-3]
        assert list(t.resolve("q", 2, "float32", 5).limits["rel_l2"]) == [1e-3] * 5
        assert list(t.resolve("v", 1, "bfloat16", 5).limits["rel_l2"]) == [1e-3] * 5
        assert t.resolve("embeddings", None, "float32", 2).limits["cosine"][0] == 0.99  # "*" matches global kinds
        assert math.isinf(t.resolve("embeddings", None, "float32", 2).limits["max_abs"][0])  # "0-" only layers
        assert t.resolve("layer_out", 7, "float32", 2).limits["max_abs"][0] == 2
        assert load_tolerances(None).resolve("q", 0, "bfloat16", 1).limits["rel_l2"][0] == 5e-2


@pytest.mark.parametrize(
    "text,msg",
    [
        ("[[rule]\n", "not valid TOML"),
        ('[[rule]]\nkind = "q"\nrel = 1\n', "unknown key(s) ['rel']"),
        ('[[rule]]\nkind = "atn_out"\nrel_l2 = 1\n', "kind 'atn_out' matches no kind"),
        ('[[rule]]\nlayer = "5-2"\nrel_l2 = 1\n', "range '5-2' is empty"),
        ('[[rule]]\nlayer = "ten"\nrel_l2 = 1\n', "layer pattern 'ten'"),
        ('[[rule]]\nkind = "q"\nrel_l2 = "big"\n', "rel_l2 must be a number"),
        ('[[rule]]\nkind = "q"\ncosine = 2\n', "cosine is a minimum similarity"),
        ('[[rule]]\nkind = "q"\n', "sets nothing"),
        ("[tolerance]\nx = 1\n", "unknown top-level key"),
        ("[tokens]\nnear_tie_margin = -1\n", "near_tie_margin must be a number >= 0"),
    ],
)
def test_invalid_tolerance_file(tmp_path, ref, text, msg):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(TraceToolError) as e:
        diff_traces(ref, ref, p)
    assert str(p) in str(e.value) and msg in str(e.value)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- growth and origin
def test_growth_table_and_inherited_drift(ref, tmp_path):
    # drift that grows through the stack: layer 0 under tolerance, layer 1 just over
    run = run_trace(
        tmp_path,
        edit=chain(
            noise(5e-5, kinds={"layer_out"}, layers={0}, seed=1), noise(2e-4, kinds={"layer_out"}, layers={1}, seed=2)
        ),
    )
    r = diff_traces(ref, run)
    d = first(r)
    assert site_of(d, "kind", "layer", "step") == ("layer_out", 1, 0)
    assert d["origin"]["verdict"] == "inherited"
    t = r.growth.table
    assert len(t) == 4 and len(t[0]) == 4
    assert 1e-5 < t[0][0] < 1e-4 < t[1][0] and t[2][0] == 0
    assert "origin: inherited in layer 1" in format_text(r)


def test_growth_jump_and_introduced(ref, tmp_path):
    run = run_trace(
        tmp_path,
        edit=chain(noise(1e-6, kinds={"layer_out"}, seed=1), plant(kind="layer_out", layer=2, step=3, index=(0,))),
    )
    r = diff_traces(ref, run)
    d = first(r)
    assert site_of(d, "kind", "layer", "step", "position") == ("layer_out", 2, 3, 7)
    assert d["origin"]["verdict"] == "introduced" and d["origin"]["input_layer"] == 1
    assert r.growth.table[2][3] > 1e-2 > r.growth.table[2][2]
    assert r.growth.largest_jump.layer == 2


# ---------------------------------------------------------------- compatibility
def test_incompatible_architecture_refused(ref, tmp_path):
    other = [dataclasses.replace(LAYERS[1], head_dim=16) if i == 1 else li for i, li in enumerate(LAYERS)]
    with pytest.raises(TraceToolError, match="different model architectures.*layer 1 head_dim 8 vs 16"):
        diff_traces(ref, run_trace(tmp_path, "a.h5", layers=other))
    with pytest.raises(TraceToolError, match="layer count 4 vs 3"):
        diff_traces(ref, run_trace(tmp_path, "b.h5", layers=LAYERS[:3]))
    a, b = tmp_path / "c1.h5", tmp_path / "c2.h5"
    write_trace(a, config={"hidden_size": 6, "vocab_size": 11})
    write_trace(b, config={"hidden_size": 8, "vocab_size": 11}, dtype="bfloat16")
    with pytest.raises(TraceToolError, match="hidden_size 6 vs 8"):
        diff_traces(a, b)


def test_different_prompt_refused_dtype_and_runtime_fine(ref, tmp_path):
    with pytest.raises(TraceToolError, match="different prompts.*index 2: "):
        diff_traces(ref, _prompt(tmp_path, ref))
    r = diff_traces(ref, run_trace(tmp_path, "d.h5", dtype="bfloat16"))
    assert r.match and r.candidate.dtype == "bfloat16"


def _prompt(tmp_path, ref):
    from gemma4_trace.traces import TraceReader

    with TraceReader(ref) as r:
        ids = r.prompt_ids.copy()
    ids[2] += 1
    return run_trace(tmp_path, "p.h5", prompt_ids=ids)


# ---------------------------------------------------------------- html
class _Checker(HTMLParser):
    VOID = {
        "meta",
        "br",
        "img",
        "input",
        "hr",
        "link",
        "area",
        "base",
        "col",
        "source",
        "wbr",
        "rect",
        "circle",
        "line",
        "polyline",
        "path",
    }

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.tags = [], [], set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        for k, v in attrs:
            if k in ("src", "href") and v and v.lower().startswith(("http://", "https://", "//")):
                self.errors.append(f"external {k}={v}")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unbalanced </{tag}> (open: {self.stack[-3:]})")
        else:
            self.stack.pop()


def check_html(text):
    c = _Checker()
    c.feed(text)
    c.close()
    assert not c.errors and not c.stack, (c.errors, c.stack)
    assert "link" not in c.tags and "<script src" not in text and "@import" not in text and "url(" not in text
    assert {"svg", "table", "style"} <= c.tags
    return c


def test_html_report_self_contained_and_atomic(ref, tmp_path):
    run = run_trace(tmp_path, edit=plant(kind="v", layer=2, step=1, index=(0, 1)))
    r = diff_traces(ref, run)
    out = tmp_path / "report.html"
    write_html(r, out)
    text = out.read_text()
    check_html(text)
    assert "first divergence: decode step 1, layer 2" in text and "Error growth" in text
    with pytest.raises(TraceToolError, match="already exists"):
        write_html(r, out)
    write_html(diff_traces(ref, ref), out, force=True)
    check_html(out.read_text())
    assert "match: no divergence" in out.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.h5", "report.html", "run.h5"]  # no temporaries
    with pytest.raises(TraceToolError):
        write_html(r, tmp_path / "no-such-folder" / "r.html")
    with pytest.raises(TraceToolError, match="is the input"):
        write_html(r, run, force=True)
    assert diff_traces(ref, run).first_divergence.kind == "v"  # the trace is intact


def test_html_report_mode_and_race(ref, tmp_path, monkeypatch):
    import os

    import gemma4_trace.diff.html as diff_html

    r = diff_traces(ref, ref)
    old = os.umask(0o022)
    try:
        write_html(r, tmp_path / "a.html")
    finally:
        os.umask(old)
    assert (tmp_path / "a.html").stat().st_mode & 0o777 == 0o644  # as traces are
    # another writer creates the file after the existence check: it is kept, ours is refused
    out = tmp_path / "b.html"
    render = diff_html.render_html

    def racing(result):
        out.write_text("the other run's report")
        return render(result)

    monkeypatch.setattr(diff_html, "render_html", racing)
    with pytest.raises(TraceToolError, match="already exists"):
        write_html(r, out)
    assert out.read_text() == "the other run's report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "b.html", "ref.h5"]


def test_html_bins_long_runs(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, new_tokens=450, prompt_len=3)
    write_trace(b, new_tokens=450, prompt_len=3, edit=noise(3e-5, kinds={"layer_out"}))
    r = diff_traces(a, b)
    text = render_html(r)
    check_html(text)
    assert "max over 2 steps" in text and text.count("<rect") < 6 * 230 + 100  # 4 layers, inputs, outputs; the scale


def test_documented_tolerance_examples_parse(tmp_path):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "tolerances.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", doc, re.S)
    assert len(blocks) == 4  # the format block and three examples
    for i, text in enumerate(blocks):
        p = tmp_path / f"ex{i}.toml"
        p.write_text(text)
        load_tolerances(p)


def test_docs_list_every_metric_of_the_registry():
    import re
    from pathlib import Path

    from gemma4_trace.diff.metrics import METRICS, THRESHOLD_METRICS

    docs = Path(__file__).resolve().parents[1] / "docs"
    listed = re.search(r"`metric` - one of (.*?) - `value`", (docs / "diff.md").read_text(), re.S).group(1)
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(m.name for m in METRICS)
    checks = re.findall(r"^\| `(\w+)` +\|", (docs / "tolerances.md").read_text(), re.M)
    assert checks == [m.name for m in THRESHOLD_METRICS]


def test_json_keys_come_from_the_registry(ref, tmp_path):
    # every thresholded metric appears in the failing row's metrics and in each float tensor's summary
    from gemma4_trace.diff.metrics import THRESHOLD_METRICS

    j = diff_traces(ref, run_trace(tmp_path, edit=plant(kind="v", layer=0, step=0, index=(0, 1)))).to_json()
    assert list(j["first_divergence"]["metrics"]) == [m.name for m in THRESHOLD_METRICS]
    floats = [t for t in j["tensors"] if t["kind"] != "mask"]
    assert floats and all({m.summary for m in THRESHOLD_METRICS} <= set(t) for t in floats)
