"""The plug-in API when things go wrong (issue 12, section 4), with the plug-ins of
tests/support/crashy_runtime.py on the embedded model's golden traces.

- a plug-in's exception is one line naming the plug-in's file:line and what the step had
  reported before it ("after layer 4 q"); --debug / GEMMA4_TRACE_DEBUG=1 print the chained traceback;
- a runtime may report a subset of a step's rows (probe positions=): the trace flags the rows
  present, the diff compares those and names the absent ones;
- a mask divergence on an image prompt names the image block of the keys.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceCorruptError
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error, site_of

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "traces" / "golden" / "short.h5"
IMAGE = ROOT / "traces" / "golden" / "image.h5"
PLUGIN = "tests.support.crashy_runtime"
SOURCE = (ROOT / "tests" / "support" / "crashy_runtime.py").read_text().splitlines()


def site(marker: str) -> str:
    """'tests/support/crashy_runtime.py:N' of the line carrying `marker`."""
    n = next(i for i, line in enumerate(SOURCE, 1) if marker in line)
    return f"tests/support/crashy_runtime.py:{n}"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in messages are relative to the current folder
    monkeypatch.delenv("GEMMA4_TRACE_DEBUG", raising=False)


@pytest.mark.parametrize(
    "factory,expected",
    [
        (
            "make_crash_after_layer4_q",
            "runtime crashy failed in prefill at {AFTER} after layer 4 q: ValueError: NPU kernel rejected the q tile",
        ),
        (
            "make_crash_after_embeddings_in_decode",
            "runtime crashy failed in decode step 1 at {AFTER} after embeddings: "
            "ValueError: NPU kernel rejected the embeddings tile",
        ),
        # raised inside our rms_norm (and torch): the site is the plug-in's call, its innermost frame
        (
            "make_crash_in_our_helper",
            "runtime crashy-helper failed in prefill at {HELPER} before reporting anything: "
            "RuntimeError: The size of tensor a (3) must match",
        ),
        (
            "make_crash_in_factory",
            f"runtime plug-in {PLUGIN}:make_crash_in_factory failed to start at {{FACTORY}}: "
            "RuntimeError: no NPU device found",
        ),
    ],
)
def test_crash_names_the_plugin_line_and_what_it_had_reported(tmp_path, factory, expected):
    out = tmp_path / "run.h5"
    line = one_line_error(invoke("replay", GOLDEN, "--runtime", f"{PLUGIN}:{factory}", "-o", out))
    want = expected.format(
        AFTER=site("CRASH-SITE-AFTER"), HELPER=site("CRASH-SITE-HELPER"), FACTORY=site("CRASH-SITE-FACTORY")
    )
    assert want in line, line
    assert not out.exists()


@pytest.mark.parametrize("how", ["group", "command", "env"])
def test_debug_prints_the_chained_traceback(tmp_path, how):
    out = tmp_path / "run.h5"
    args = ["replay", GOLDEN, "--runtime", f"{PLUGIN}:make_crash_after_layer4_q", "-o", out]
    args = {"group": ["--debug", *args], "command": [*args, "--debug"], "env": args}[how]
    r = invoke(*args, env={"GEMMA4_TRACE_DEBUG": "1"} if how == "env" else None)
    assert r.exit_code == 2, r.output
    text = r.output
    n = int(site("CRASH-SITE-AFTER").rsplit(":", 1)[1])
    # the plug-in's own frame, the driver's re-raise, chained, and the one line last
    assert f'crashy_runtime.py", line {n}, in _hook' in text, text
    assert "The above exception was the direct cause of the following exception" in text
    assert "ValueError: NPU kernel rejected the q tile" in text and "TraceToolError" in text
    assert text.rstrip().splitlines()[-1].startswith("error: runtime crashy failed in prefill at ")
    assert not out.exists()
    # debug does not stick: the next invocation is one line again
    one_line_error(invoke("replay", GOLDEN, "--runtime", f"{PLUGIN}:make_crash_after_layer4_q", "-o", out))


def test_factory_crash_with_debug_shows_its_origin(tmp_path):
    r = invoke("--debug", "replay", GOLDEN, "--runtime", f"{PLUGIN}:make_crash_in_factory", "-o", tmp_path / "r.h5")
    assert r.exit_code == 2 and "RuntimeError: no NPU device found" in r.output and "in _crash_now" in r.output


def test_deferred_construction_replays_and_matches(tmp_path):
    out = tmp_path / "run.h5"
    r = invoke("replay", GOLDEN, "--runtime", f"{PLUGIN}:make_deferred", "-o", out)
    assert r.exit_code == 0, r.output
    assert invoke("diff", GOLDEN, out).exit_code == 0


@pytest.mark.parametrize(
    "factory,needle",
    [
        (
            "make_positions_past_step",
            "positions must be increasing absolute positions within this step's 0..12, got [11, 12, 13]",
        ),
        ("make_positions_unsorted", "got [5, 3]"),
    ],
)
def test_bad_positions_are_one_line(tmp_path, factory, needle):
    line = one_line_error(invoke("replay", GOLDEN, "--runtime", f"{PLUGIN}:{factory}", "-o", tmp_path / "r.h5"))
    assert "runtime bad-positions" in line and needle in line, line
    assert line.endswith(f"(reported at {site('CRASH-SITE-POSITIONS')})"), line  # where the plug-in reported


# ------------------------------------------------------------------ a subset of a step's rows
@pytest.fixture(scope="module")
def last_row_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    runs = {}
    for name in ("make_last_row_only", "make_last_row_only_planted"):
        runs[name] = d / f"{name}.h5"
        r = invoke("replay", GOLDEN, "--runtime", f"{PLUGIN}:{name}", "-o", runs[name])
        assert r.exit_code == 0, r.output
    return runs


def test_trace_flags_the_rows_present(last_row_runs):
    with TraceReader(GOLDEN) as ref, TraceReader(last_row_runs["make_last_row_only"]) as run:
        T = run.prompt_len
        flags = run.rows_present("final_hidden")
        assert flags.tolist() == [False] * (T - 1) + [True] * (run.n_positions - T + 1)
        assert run.rows_present("layer_out", 3) is None and ref.rows_present("final_hidden") is None
        a, b = ref.read("final_hidden"), run.read("final_hidden")
        assert not b[: T - 1].any()  # absent rows are zeros, never NaN
        rel = np.linalg.norm(a[flags] - b[flags], axis=1) / np.linalg.norm(a[flags], axis=1)
        assert rel.max() < 1e-5


def test_show_says_how_many_rows_were_reported(last_row_runs):
    out = invoke("show", last_row_runs["make_last_row_only"]).output.splitlines()
    i = next(i for i, ln in enumerate(out) if ln.strip().startswith("final_hidden"))
    assert out[i + 1].strip() == "rows reported: 3 of 15"  # the last prompt row + 2 decode rows
    assert "rows reported" not in invoke("show", GOLDEN).output


def test_diff_compares_present_rows_and_names_the_absent(last_row_runs):
    r = invoke("diff", GOLDEN, last_row_runs["make_last_row_only"])
    assert r.exit_code == 0, r.output
    assert "note: rows not reported (not compared): final_hidden positions 0-11 (absent in RUN)" in r.output
    js = json.loads(invoke("diff", GOLDEN, last_row_runs["make_last_row_only"], "--json").output)
    fh = next(t for t in js["tensors"] if t["kind"] == "final_hidden")
    assert (fh["absent_rows"], fh["absent_positions"], fh["absent_in"]) == (12, "0-11", "RUN")
    assert fh["status"] == "ok" and fh["rows_compared"] == fh["rows"]
    assert all("absent_rows" not in t for t in js["tensors"] if t["kind"] != "final_hidden")


def test_planted_bug_in_a_present_row_is_found(last_row_runs):
    js = json.loads(invoke("diff", GOLDEN, last_row_runs["make_last_row_only_planted"], "--json").output)
    d = js["first_divergence"]
    assert not js["match"]
    assert site_of(d, "step", "kind", "position", "channel") == (0, "final_hidden", 12, 0)
    assert d["run_value"] == pytest.approx(d["ref_value"] + 1.0, abs=1e-5)


def test_calibrate_and_baseline_leave_absent_rows_out(last_row_runs, tmp_path):
    """A BASE that reports only the last prompt row: calibrating from it does not widen
    final_hidden's tolerance by its zero rows, and --baseline judges RUN's rows BASE lacks by the
    tolerance alone (not by an envelope of BASE's zeros)."""
    base = last_row_runs["make_last_row_only"]
    tol = tmp_path / "tol.toml"
    assert invoke("calibrate", GOLDEN, base, "-o", tol).exit_code == 0
    r = invoke("diff", GOLDEN, last_row_runs["make_last_row_only_planted"], "--tolerances", tol, "--json")
    d = json.loads(r.output)["first_divergence"]
    assert (d["kind"], d["position"], d["threshold"]) == ("final_hidden", 12, pytest.approx(1e-4))
    run = tmp_path / "planted3.h5"
    assert invoke("replay", GOLDEN, "--runtime", f"{PLUGIN}:make_planted_prompt_row", "-o", run).exit_code == 0
    d = json.loads(invoke("diff", GOLDEN, run, "--baseline", base, "--json").output)["first_divergence"]
    assert site_of(d, "step", "kind", "position", "channel") == (0, "final_hidden", 3, 0)


def _edit(src, dst, fn):
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        fn(f)
    return dst


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda f: (
                f.__delitem__(S.rows_present_path("final_hidden", None)),
                f.create_dataset(S.rows_present_path("final_hidden", None), data=np.ones(3, bool)),
            ),
            "expected (15,)",
        ),
        (
            lambda f: (
                f.__delitem__(S.rows_present_path("final_hidden", None)),
                f.create_dataset(S.rows_present_path("final_hidden", None), data=np.ones(15, np.int8)),
            ),
            "dtype int8",
        ),
        (
            lambda f: f.create_dataset(S.rows_present_path("logits", None), data=np.ones(3, bool)),
            "does not store by position",
        ),
        (
            lambda f: f.create_dataset(S.tensor_path("k", 6) + S.ROWS_PRESENT_SUFFIX, data=np.ones(15, bool)),
            "does not store by position",
        ),
    ],
)
def test_reader_refuses_bad_row_flags(last_row_runs, tmp_path, edit, needle):
    bad = _edit(last_row_runs["make_last_row_only"], tmp_path / "bad.h5", edit)
    with pytest.raises(TraceCorruptError, match="not a valid trace") as e:
        TraceReader(bad)
    assert needle in str(e.value), str(e.value)


# ------------------------------------------------------------------ masks on an image prompt
def test_mask_divergence_names_the_image_block(tmp_path):
    """Image tokens attending causally (TICO's text masks): the first image query of sliding layer 0
    misses the later keys of its own image, and the report says which keys are that image."""
    out = tmp_path / "run.h5"
    r = invoke("replay", IMAGE, "--runtime", f"{PLUGIN}:make_causal_vision", "-o", out)
    assert r.exit_code == 0, r.output
    with TraceReader(IMAGE) as ref:
        ids = list(ref.prompt_ids)
        token = ref.model_config["image_token_id"]
    first, last = ids.index(token), len(ids) - 1 - ids[::-1].index(token)
    assert ids[first : last + 1] == [token] * (last - first + 1)  # one image block
    r = invoke("diff", IMAGE, out)
    assert r.exit_code == 1
    head = r.output.splitlines()[0]
    assert head.startswith(
        f"first divergence: prefill step 0, layer 0 (sliding_attention), kind mask, position {first}:"
    )
    assert f"blocked in RUN, allowed in REF (REF allows 0-{last}; RUN allows 0-{first})" in head
    assert head.endswith(f"; keys {first}-{last} = image 1 (the query's own)"), head
    d = json.loads(invoke("diff", IMAGE, out, "--json").output)["first_divergence"]
    assert d["image_blocks"] == [{"image": 1, "first": first, "last": last}]
    assert d["n_blocked_in_run_allowed_in_ref"] == last - first
    # a text prompt's mask divergence names no image
    text_run = tmp_path / "text.h5"
    assert (
        invoke("replay", GOLDEN, "--runtime", "tests.support.bug_zoo:make_window_off_by_one", "-o", text_run).exit_code
        == 0
    )
    d = json.loads(invoke("diff", GOLDEN, text_run, "--json").output)["first_divergence"]
    assert d["kind"] == "mask" and "image_blocks" not in d and "= image" not in d["sentence"]


def test_report_helper_returns_what_to_continue_with():
    import torch

    from gemma4_trace.replayer.api import report

    x = torch.ones(2, 3)

    class Probe:
        def __init__(self, back):
            self.back, self.calls = back, []

        def tensor(self, kind, value, layer=None, positions=None):
            self.calls.append((kind, layer, positions))
            return self.back

    assert report(None, "layer_out", x, layer=1) is x
    p = Probe(None)
    assert report(p, "layer_out", x, layer=1) is x and p.calls == [("layer_out", 1, None)]
    ref = torch.zeros(1, 3)
    p = Probe(ref)
    assert report(p, "final_hidden", x[1:], positions=[12]) is ref and p.calls == [("final_hidden", None, [12])]


def test_image_blocks_of_two_images():
    """Which image block each differing key is in: two images (ids 9), keys differing in the second only."""
    from types import SimpleNamespace

    from gemma4_trace.diff.core import _Differ

    ids = [2, 5, 7, 9, 9, 9, 8, 11, 7, 9, 9, 9, 9, 8, 3]  # image 1 = 3-5, image 2 = 9-12
    d = SimpleNamespace(ref=SimpleNamespace(model_config={"image_token_id": 9}, prompt_ids=np.array(ids)))
    ra = np.zeros(16, dtype=bool)
    ra[:13] = True  # REF: query 10 sees its whole image (keys up to 12)
    rb = ra.copy()
    rb[11:13] = False  # RUN: causal inside the image
    assert _Differ._image_blocks_of(d, ra, rb, 10) == [{"image": 2, "first": 9, "last": 12}]
    rb2 = ra.copy()
    rb2[4] = False  # a key of image 1, seen from a text query
    assert _Differ._image_blocks_of(d, ra, rb2, 14) == [{"image": 1, "first": 3, "last": 5}]
    assert _Differ._image_blocks_of(d, ra, ra[:14], 14) is None  # widths differ, no key differs
    d.ref.model_config = {}
    assert _Differ._image_blocks_of(d, ra, rb, 10) is None  # a text-only model
