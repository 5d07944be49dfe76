"""What a user sees in a diff report (issue 21): "not compared" is never a number, `--full`
reads every row, the heatmap's scale and frames. Candidates are goldens with seeded edits
(tests/support/diff_fixtures.py), so the numbers do not depend on the CPU's kernels."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest

from gemma4_trace.diff import diff_traces, format_text, render_html
from gemma4_trace.diff.html import EXACT, NONFINITE, NOT_COMPARED, _Scale
from gemma4_trace.recorder import golden
from tests.support.cli import invoke
from tests.support.diff_fixtures import chain, copy_trace, noise, second_choice, set_at


@pytest.fixture(scope="module")
def token_pair(tmp_path_factory):
    """A candidate with an error in layer 1's attention output in the prefill and noise in layer 5's q
    from step 12 (behind the first divergence: found only by --full)."""
    d = tmp_path_factory.mktemp("token")
    shutil.copyfile(golden.golden_path("window"), d / "ref.h5")
    copy_trace(
        d / "ref.h5",
        d / "run.h5",
        edit=chain(noise("attn_out", 1, 0, 1e-2, seed=1), noise("q", 5, 12, 0.2, seed=2, head=1)),
    )
    return d / "ref.h5", d / "run.h5"


def _json(*args) -> dict:
    r = invoke("diff", *map(str, args), "--json")
    assert r.exit_code == 1, r.output
    return json.loads(r.output)


def test_tensors_not_compared_have_null_metrics_and_say_why(token_pair):
    j = _json(*token_pair)
    none = [t for t in j["tensors"] if t["status"] == "not compared"]
    assert none, "the early stop leaves tensors unread"
    for t in none:
        assert t["rows_compared"] == 0
        assert "not read" in t["reason"]
        if t["kind"] != "mask":
            assert t["max_rel_l2"] is None and t["max_abs"] is None and t["min_cosine"] is None
    assert any(f"{len(none)} not compared" in n and "--full" in n for n in j["notes"])
    # the HTML table says so instead of 0 / 1
    html = render_html(diff_traces(*token_pair))
    rows = [r for r in html.split("<tr") if "not compared: rows after" in r]
    assert len(rows) == len(none)
    assert all('<td class="nc">not compared</td>' in r for r in rows if 'class="l">mask<' not in r)


def test_full_compares_every_row_and_finds_the_same_first_divergence(token_pair):
    short, full = _json(*token_pair), _json(*token_pair, "--full")
    assert full["first_divergence"] == short["first_divergence"]
    assert all(t["rows_compared"] == t["rows"] for t in full["tensors"])
    assert not any(t["status"] in ("not compared", "partly compared") for t in full["tensors"])
    # the noise after the first divergence is found (and only) with --full
    q5 = {t["kind"] + str(t["layer"]): t for t in full["tensors"]}["q5"]
    assert q5["status"] == "diverged" and q5["failed_rows"] > 0 and q5["max_rel_l2"] > 1e-2
    assert {t["kind"] + str(t["layer"]): t for t in short["tensors"]}["q5"]["status"] == "not compared"
    assert not any("not compared" in n for n in full["notes"])


def test_full_on_a_mask_divergence_counts_every_mismatched_row(tmp_path):
    shutil.copyfile(golden.golden_path("window"), tmp_path / "ref.h5")
    copy_trace(
        tmp_path / "ref.h5",
        tmp_path / "run.h5",
        edit=chain(set_at("mask", 6, 3, (0, 20), True), set_at("mask", 6, 9, (0, 30), True)),
    )
    full = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5", full=True)
    m6 = next(t for t in full.tensors if (t.kind, t.layer) == ("mask", 6))
    assert m6.status == "diverged" and m6.mismatched_rows == 2 and m6.rows_compared == m6.rows
    short = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5")
    assert short.first_divergence.step == full.first_divergence.step == 3
    assert "partly compared" in format_text(short) and "compared (of" not in format_text(full)


# ---------------------------------------------------------------- the heatmap
TOLERANCE_MAP = ("<h2>Error growth: layer x step</h2>", "<h2>Against the tolerance alone")
BASELINE_MAP = "<h2>Error growth against the baseline"


def _section(page: str, heading: str) -> str:
    """The page from a heading to the next one."""
    return page.split(heading, 1)[1].split("<h2>", 1)[0]


def _cells(page: str, row_title: str) -> list[str]:
    """The tooltips of one heatmap row's cells, in step order, in the map against the tolerance."""
    heading = next(h for h in TOLERANCE_MAP if h in page)
    return re.findall(r"<title>(" + re.escape(row_title) + r", step \d+: [^<]*)</title>", _section(page, heading))


def test_heatmap_log_legend_global_frame_and_not_compared_cells(tmp_path):
    shutil.copyfile(golden.golden_path("window"), tmp_path / "ref.h5")
    copy_trace(
        tmp_path / "ref.h5",
        tmp_path / "run.h5",
        omit=("final_hidden",),
        edit=chain(noise("per_layer_inputs", None, 0, 1e-2, seed=3), noise("layer_out", 2, 0, 1e-3, seed=4)),
    )
    result = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5")
    assert result.first_divergence.kind == "per_layer_inputs"
    page = render_html(result)
    scale = re.search(r'<g class="log-scale" data-decades="(\d+)" data-lo="(-?\d+)" data-hi="(-?\d+)"', page)
    lo, hi = int(scale[2]), int(scale[3])
    assert int(scale[1]) == hi - lo >= 4 and lo < 0 < hi  # the tolerance (1e0) inside, the scale drawn:
    legend = page[scale.start() : page.index("</g>", scale.start())]
    ticks = re.findall(r'text-anchor="middle">1(?:e(-?\d+))?</text>', legend)
    shown = [int(t or 0) for t in ticks]  # a label on every decade with room for it, always on the limit
    assert 0 in shown and set(shown) <= set(range(lo, hi + 1)) and len(shown) >= 3, shown
    assert ">= tolerance</text>" in legend
    # a divergence before the layers is framed in a row of its own
    assert re.search(r'<g class="first-div" data-row="inputs" data-step="0">', page)
    # final_hidden is only in REF: its row is drawn "not compared", in the neutral colour, and labelled
    outputs = _cells(page, "final_hidden, logits, token (colour: final_hidden)")
    assert len(outputs) == len(result.growth.steps) and all(c.endswith("not compared") for c in outputs)
    assert page.count('<rect class="nc"') == len(outputs) and "not compared</text>" in page  # legend entry
    # layer 2's error (10x its tolerance) and the exact layers are on the same scale, not one saturated colour
    assert "rel-L2 0 (x0 of the tolerance)" in _cells(page, "layer_out of layer 0")[0]
    assert all("of the tolerance" in c for c in _cells(page, "layer_out of layer 2"))


def test_steps_a_selective_recording_left_out_are_not_compared_in_every_map(tmp_path):
    ref, run, base = (tmp_path / f"{n}.h5" for n in ("ref", "run", "base"))
    assert invoke("record", "--steps", "0-4", "--max-new-tokens", 10, "-o", ref).exit_code == 0
    assert invoke("replay", ref, "-o", run).exit_code == 0
    assert invoke("replay", ref, "-o", base).exit_code == 0
    result = diff_traces(ref, run, baseline_path=base)
    n = len(result.growth.steps)
    assert n == 10 and all(row[5:] == [None] * 5 and None not in row[:5] for row in result.growth.table)
    page = render_html(result)
    for heading in (BASELINE_MAP, TOLERANCE_MAP[1]):
        cells = re.findall(r"<title>layer_out of layer 0, step (\d+): ([^<]*)</title>", _section(page, heading))
        assert [int(st) for st, _ in cells] == list(range(n))
        assert all(text == "not compared" for _, text in cells[5:]) and "rel-L2" in cells[4][1], cells


def test_scale_separates_quantization_noise_from_a_bug():
    # the numbers: int8 noise at 76x the tolerance and a bug at 8,200x were the same red
    scale = _Scale([0.0, 2e-3, 76.0, 8200.0, None])
    assert (scale.lo, scale.hi) == (-3, 4)
    colors = {v: scale.color(v) for v in (2e-3, 0.5, 2.0, 76.0, 8200.0)}
    assert len(set(colors.values())) == 5
    assert scale.color(None) == NOT_COMPARED and scale.color(0.0) == EXACT and scale.color(math.inf) == NONFINITE
    assert NOT_COMPARED not in colors.values() and EXACT not in colors.values()
    assert (_Scale([3.0]).hi - _Scale([3.0]).lo) >= 4  # at least four decades even when one value occurs


def test_baseline_map_shows_where_run_leaves_base(tmp_path):
    shutil.copyfile(golden.golden_path("window"), tmp_path / "ref.h5")
    quant = noise("layer_out", 3, 0, 1e-2, seed=5)  # BASE's noise everywhere in layer 3 ...
    copy_trace(tmp_path / "ref.h5", tmp_path / "base.h5", edit=quant)
    bug = chain(noise("layer_out", 3, 0, 1.2e-2, seed=6), set_at("layer_out", 3, 6, (0, 7), 40.0))  # ... RUN's + a bug
    copy_trace(tmp_path / "ref.h5", tmp_path / "run.h5", edit=bug)
    result = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5", baseline_path=tmp_path / "base.h5")
    d = result.first_divergence
    assert (d.kind, d.layer, d.step) == ("layer_out", 3, 6)
    page = render_html(result)
    assert page.count('<g class="first-div" data-row="L3" data-step="6">') == 2  # framed in both maps
    assert page.index(BASELINE_MAP) < page.index(TOLERANCE_MAP[1])  # the verdict's map first
    assert TOLERANCE_MAP[0] not in page
    second = _section(page, BASELINE_MAP)
    assert ">= envelope</text>" in second
    ratios = [
        float(x) for x in re.findall(r"layer_out of layer 3, step \d+: rel-L2 \S+ \(x(\S+) of the envelope\)", second)
    ]
    assert len(ratios) == len(result.growth.steps)
    assert ratios[6] > 1 and max(ratios[:6] + ratios[7:]) < 1  # only the bug's step leaves BASE's envelope
    # against the plain tolerance every step of layer 3 is far above it
    first = [c for c in _cells(page, "layer_out of layer 3")]
    assert all(float(re.search(r"\(x(\S+) of the tolerance\)", c)[1]) > 10 for c in first)


# ---------------------------------------------------------------- numbers that explain themselves
def test_largest_jump_shows_its_division_and_floor(tmp_path):
    shutil.copyfile(golden.golden_path("window"), tmp_path / "ref.h5")
    copy_trace(tmp_path / "ref.h5", tmp_path / "run.h5", edit=noise("layer_out", 3, 5, 1e-3, seed=1))
    result = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5")
    j = result.growth.largest_jump
    line = next(x for x in format_text(result).splitlines() if "largest jump" in x)
    after, counted, ratio = re.search(
        r"\((\S+) / (\S+) = x(\S+); the input's 0 counted at its tolerance (\S+)\)", line
    ).group(1, 2, 3)
    assert counted == "1e-4" and line.endswith(f"tolerance {counted})")  # layer 2's error is 0: its tolerance counts
    assert float(after) / float(counted) == pytest.approx(float(ratio), rel=0.1) and j.ratio == pytest.approx(
        float(ratio), rel=1e-2
    )


def test_isolated_trace_says_tokens_and_logits_hold_by_construction(tmp_path):
    shutil.copyfile(golden.golden_path("window"), tmp_path / "ref.h5")
    copy_trace(tmp_path / "ref.h5", tmp_path / "iso.h5", mode="isolated", edit=noise("layer_out", 3, 0, 1e-2, seed=1))
    result = diff_traces(tmp_path / "ref.h5", tmp_path / "iso.h5")
    text = format_text(result)
    tokens = next(x for x in text.splitlines() if x.startswith("tokens:"))
    logits = next(x for x in text.splitlines() if x.startswith("logits"))
    assert "by construction" in tokens and "by construction" in logits
    assert "largest jump" not in text and result.growth.largest_jump is not None  # still in the JSON
    assert "rows together" in next(x for x in text.splitlines() if x.startswith("isolated replay"))
    page = render_html(result)
    assert "by construction" in page and "largest jump" not in page and "max rel-L2 (worst row)" in page
    # a teacher-forced candidate says nothing of the kind
    copy_trace(
        tmp_path / "ref.h5", tmp_path / "tf.h5", mode="teacher-forced", edit=noise("layer_out", 3, 0, 1e-2, seed=1)
    )
    assert "by construction" not in format_text(diff_traces(tmp_path / "ref.h5", tmp_path / "tf.h5"))


# ---------------------------------------------------------------- small items
def _with_runtime(src, dst, runtime: str, edit=None):
    """`src` copied as if another runtime (provenance `runtime`) had written it, teacher-forced."""
    from gemma4_trace.traces import TraceReader, TraceWriter
    from gemma4_trace.traces import schema as S

    with TraceReader(src) as r, TraceWriter(dst) as w:
        h = r.header()
        w.write_header(h.with_provenance(h.provenance.replace(runtime=runtime, mode="teacher-forced")))
        for step, (a, b) in enumerate(r.step_positions):
            w.begin_step(range(a, b))
            for kind, layer in r.kinds_present():
                one = S.KIND_BY_NAME[kind].index == "step"
                rows = r.read(kind, layer, slice(step, step + 1) if one else slice(a, b))
                rows = edit(kind, layer, step, rows.copy()) if edit else rows
                w.add(kind, rows[0] if one else rows, layer=layer, source_dtype=r.source_dtype(kind, layer))
            w.end_step()


def test_a_base_of_another_quantization_is_accepted_with_a_note(tmp_path):
    shutil.copyfile(golden.golden_path("short"), tmp_path / "ref.h5")
    quant = noise("layer_out", 1, 0, 1e-3, seed=1)
    _with_runtime(tmp_path / "ref.h5", tmp_path / "w8.h5", "static-w8", quant)
    _with_runtime(tmp_path / "ref.h5", tmp_path / "w4.h5", "static-w4g32", quant)
    _with_runtime(tmp_path / "ref.h5", tmp_path / "bug.h5", "bug-stale-ple-in-decode+w8", quant)
    other = diff_traces(tmp_path / "ref.h5", tmp_path / "w8.h5", baseline_path=tmp_path / "w4.h5")
    notes = [n for n in other.notes if "another quantization" in n]
    assert notes == [
        "BASE ran static-w4g32 (w4g32), RUN static-w8 (w8): RUN is judged by the envelope of another "
        "quantization than its own"
    ]
    same = diff_traces(tmp_path / "ref.h5", tmp_path / "bug.h5", baseline_path=tmp_path / "w8.h5")  # a bug on w8
    assert not any("another quantization" in n for n in same.notes)


def test_mask_keys_are_listed_as_ranges(tmp_path):
    shutil.copyfile(golden.golden_path("window"), tmp_path / "ref.h5")
    copy_trace(tmp_path / "ref.h5", tmp_path / "run.h5", edit=set_at("mask", 6, 0, (5, slice(6, 13)), True))
    sentence = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5").first_divergence.sentence
    assert "position 5: keys 6-12 (future) allowed in RUN, blocked in REF" in sentence, sentence


def test_every_command_lists_debug_in_its_help():
    for name in ("record", "replay", "show", "diff", "calibrate", "import", "export-onnx"):
        r = invoke(name, "--help")
        assert r.exit_code == 0 and "--debug" in r.output, name


def test_show_prints_the_total_and_the_per_layer_size(tmp_path):
    from gemma4_trace.show import summarize
    from gemma4_trace.traces import TraceReader
    from gemma4_trace.traces.limits import fmt_bytes

    with TraceReader(golden.golden_path("window")) as r:
        text = summarize(r)
        total = sum(r.storage_size("q", l) for l in range(len(r.layers)))
        n = len(r.layers)
    line = next(x for x in text.splitlines() if x.strip().startswith("q "))
    assert line.endswith(f"{fmt_bytes(total)} in {n} layers ({fmt_bytes(total / n)} each on average)"), line


def test_a_baseline_match_says_that_base_itself_diverges_from_ref(tmp_path):
    """Under --baseline a green 'match' is relative to BASE: the verdict says where BASE itself leaves
    REF, a token flip BASE makes too is labelled so, and a tensor beyond the tolerance but inside the
    envelope is not a bare 'ok' (issue 56 item 6)."""
    shutil.copyfile(golden.golden_path("window"), tmp_path / "ref.h5")
    flip = set_at("token", None, 4, (), second_choice("window", 4))  # BASE and RUN both choose REF's runner-up
    copy_trace(tmp_path / "ref.h5", tmp_path / "base.h5", edit=chain(noise("layer_out", 3, 0, 1e-2, seed=5), flip))
    copy_trace(tmp_path / "ref.h5", tmp_path / "run.h5", edit=chain(noise("layer_out", 3, 0, 1e-2, seed=6), flip))
    result = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5", baseline_path=tmp_path / "base.h5")
    assert result.match
    against = result.baseline.against_ref
    assert not against.match and against.first_divergence.startswith("prefill step 0, layer 3 (")
    assert "vs BASE " in against.first_divergence and against.tokens_matched == against.tokens_compared - 1
    text = format_text(result)
    assert text.splitlines()[1].startswith("BASE against REF: BASE itself diverges, first at prefill step 0, layer 3")
    page = render_html(result)
    verdict = page[page.index('<div class="verdict') : page.index("</div>")]
    assert "BASE itself diverges" in verdict
    flipped = re.search(r"<tr class=\"x\"><td>4</td>.*?</tr>", page)[0]
    assert "BASE chose it too: inside the envelope" in flipped
    row = re.search(r'<td class="l">layer_out</td><td>3</td>.*?</tr>', page)[0]
    assert "ok: beyond the tolerance, inside BASE&#x27;s envelope" in row or "inside BASE's envelope" in row
    assert json.loads(json.dumps(result.to_json()))["baseline"]["against_ref"]["match"] is False
    # BASE within the tolerances: said as plainly
    copy_trace(tmp_path / "ref.h5", tmp_path / "same.h5")
    same = diff_traces(tmp_path / "ref.h5", tmp_path / "same.h5", baseline_path=tmp_path / "same.h5")
    assert "BASE against REF: no divergence" in format_text(same)
