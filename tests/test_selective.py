"""Selective recording: `--layers / --kinds / --steps` on record and replay, on the embedded model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma4_trace.recorder import golden
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.selection import Selection, parse_ranges, ranges_text
from tests.support.cli import invoke, one_line_error

FILTERS = ["--layers", "0-1,3", "--kinds", "q,k,layer_out", "--steps", "0,2-3"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("sel")
    full, sel = d / "full.h5", d / "sel.h5"
    for out, extra in ((full, []), (sel, FILTERS)):
        res = invoke("record", "--max-new-tokens", 5, "-o", out, *extra)
        assert res.exit_code == 0, res.output
    return d, full, sel


def test_selective_trace_keeps_what_was_asked(traces):
    _, full, sel = traces
    with TraceReader(full) as a, TraceReader(sel) as b:
        assert a.selection is None
        assert b.selection == Selection((0, 1, 3), ("q", "k", "layer_out", "logits", "token"), (0, 2, 3))
        kept = set(b.kinds_present())
        assert kept == {(k, l) for k in ("q", "k", "layer_out") for l in (0, 1, 3) if a.has(k, l)} | {
            ("logits", None),
            ("token", None),
        }
        assert np.array_equal(a.tokens(), b.tokens()) and np.array_equal(a.read("logits"), b.read("logits"))
        steps = b.step_positions
        present = b.rows_present("q", 0)
        for s, (start, stop) in enumerate(steps):  # kept steps hold HF's rows, the others zeros flagged absent
            assert present[start:stop].all() == (s in (0, 2, 3)) and present[start:stop].any() == (s in (0, 2, 3))
            x, y = a.read("q", 0, slice(start, stop)), b.read("q", 0, slice(start, stop))
            assert np.array_equal(x, y) if s in (0, 2, 3) else not y.any()
    assert full.stat().st_size > 2 * sel.stat().st_size


def test_replay_defaults_to_the_reference_selection_and_diff_says_so(traces):
    d, full, sel = traces
    out = d / "run_sel.h5"
    assert invoke("replay", sel, "-o", out).exit_code == 0
    with TraceReader(sel) as a, TraceReader(out) as b:
        assert b.selection == a.selection and set(b.kinds_present()) == set(a.kinds_present())
    res = invoke("diff", sel, out, "--json")
    assert res.exit_code == 0, res.output
    j = json.loads(res.output)
    assert j["match"]
    notes = [n for n in j["notes"] if "selective" in n]
    assert len(notes) == 2 and "layers 0-1,3; kinds q,k,layer_out (+ logits, token); steps 0,2-3" in notes[0]
    # a full REF against the selective RUN: matches on what RUN kept, and says what it did not compare
    res = invoke("diff", full, out)
    assert res.exit_code == 0, res.output
    assert "RUN is a selective recording, keeping only layers 0-1,3" in res.output


def test_replay_filters_override(traces):
    d, full, _ = traces
    out = d / "run_l0.h5"
    assert invoke("replay", full, "--layers", "0", "--kinds", "layer_out", "-o", out).exit_code == 0
    with TraceReader(out) as r:
        assert set(r.kinds_present()) == {("layer_out", 0), ("logits", None), ("token", None)}
        assert r.rows_present("layer_out", 0) is None  # every step kept
    assert invoke("diff", full, out).exit_code == 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--layers", "0-99"], "--layers 8-99: the model has 8 layers (0-7)"),
        (["--kinds", "q,attention"], "--kinds: unknown kind 'attention'"),
        (["--steps", "4-2"], "bad range '4-2'"),
        (["--layers", "1-x"], "expected numbers and ranges"),
        (["--steps", "9"], "the run has 5 steps"),
    ],
)
def test_bad_filters_are_one_line(tmp_path, args, needle):
    for cmd in (["record", "--max-new-tokens", "5"], ["replay", str(golden.golden_path("short"))]):
        if cmd[0] == "replay" and args == ["--steps", "9"]:
            needle = "the run has 3 steps"  # the short golden: 3 new tokens
        one_line_error(invoke(*cmd, *args, "-o", tmp_path / "x.h5"), needle, out=tmp_path / "x.h5")


def test_ranges_round_trip():
    assert parse_ranges("0-3,17, 5", "layers") == (0, 1, 2, 3, 5, 17)
    assert ranges_text((0, 1, 2, 3, 5, 17)) == "0-3,5,17"
    s = Selection.parse("0-3,17", "q,v", None)
    assert Selection.from_json(json.dumps(s.to_json())) == s
