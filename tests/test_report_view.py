"""What a user sees in a diff report (issue 21): "not compared" is never a number, `--full`
reads every row, the heatmap's scale and frames. Candidates are goldens with seeded edits
(tests/diff_fixtures.py), so the numbers do not depend on the CPU's kernels."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from gemma4_trace.cli import main
from gemma4_trace.diff import diff_traces, format_text, render_html
from gemma4_trace.recorder import golden
from tests.diff_fixtures import chain, copy_trace, noise, set_at


@pytest.fixture(scope="module")
def token_pair(tmp_path_factory):
    """A candidate with an error in layer 1's attention output in the prefill and noise in layer 5's q
    from step 12 (behind the first divergence: found only by --full)."""
    d = tmp_path_factory.mktemp("token")
    shutil.copyfile(golden.golden_path("window"), d / "ref.h5")
    copy_trace(d / "ref.h5", d / "run.h5",
               edit=chain(noise("attn_out", 1, 0, 1e-2, seed=1),
                          noise("q", 5, 12, 0.2, seed=2, head=1)))
    return d / "ref.h5", d / "run.h5"


def _json(*args) -> dict:
    r = CliRunner().invoke(main, ["diff", *map(str, args), "--json"])
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
    copy_trace(tmp_path / "ref.h5", tmp_path / "run.h5",
               edit=chain(set_at("mask", 6, 3, (0, 20), True), set_at("mask", 6, 9, (0, 30), True)))
    full = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5", full=True)
    m6 = next(t for t in full.tensors if (t.kind, t.layer) == ("mask", 6))
    assert m6.status == "diverged" and m6.mismatched_rows == 2 and m6.rows_compared == m6.rows
    short = diff_traces(tmp_path / "ref.h5", tmp_path / "run.h5")
    assert short.first_divergence.step == full.first_divergence.step == 3
    assert "partly compared" in format_text(short) and "compared (of" not in format_text(full)
