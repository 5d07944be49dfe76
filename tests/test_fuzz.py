"""Fuzz `trace show`, `trace show --hash` and `trace diff` with randomly corrupted copies of
a golden trace (a short, seeded run; scripts/fuzz_traces.py runs thousands).

The commands run in-process through click's CliRunner with GEMMA4_TRACE_DEBUG=1, so a bug
of ours escapes as an exception (a failure) instead of the CLI's 'internal error' line;
each command is guarded by an alarm. The cases run in two worker processes (both cores):
HDF5 itself can spin forever or crash on some damaged metadata, inside C code that holds
the GIL, where no Python guard can reach; a worker that dies that way is recorded as a
library defect (docs/robustness.md) and the next worker goes on with the following case.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # hundreds of hostile inputs; make test-fast skips it

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_traces.py"
CASES, SEED = 150, 2024


def _load():
    spec = importlib.util.spec_from_file_location("fuzz_traces", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_traces"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fz():
    return _load()


def test_fuzzed_traces_end_cleanly(fz):
    rep = fz.supervise(CASES, SEED, timeout=8.0, jobs=2, hang_after=15.0)
    summary = fz.format_report(rep, f"supervise({CASES}, {SEED})")
    print(summary)
    assert not rep.failures, summary + "\n" + "\n".join(rep.failures[:5])
    # no hang or crash inside HDF5 either (text is stored as fixed-length strings, and no group below the
    # root tracks link creation order: see docs/robustness.md and test_no_creation_order_below_the_root)
    assert not rep.library, summary + "\n" + "\n".join(rep.library)
    # hostile files: nothing outside the trace opened, no command slow or big (docs/robustness.md)
    assert rep.watch_ok and not rep.outside and not rep.slow and not rep.big, summary
    assert rep.cases == CASES
    # the corruptions reached every outcome: refused, unharmed, and (diff) diverged
    for command in fz.COMMANDS:
        assert rep.outcomes[(command, 2)] > 0 and rep.outcomes[(command, 0)] > 0, summary
    assert rep.outcomes[("diff GOLDEN CORRUPT", 1)] > 0, summary
    assert set(rep.mutations) == set(fz.ALL), summary
    assert {"corrupt data (checksum)", "invalid structure", "unreadable HDF5"} <= set(rep.messages), summary
    # a third of the cases start from the version-2 golden; tower cases the format has a verdict on ran
    assert rep.goldens["v2"] > CASES // 5 and rep.goldens["v1"] > CASES // 2, summary
    assert rep.verdicts["must be refused"] > 0 and rep.verdicts["must read"] > 0, summary


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
    from tests.support import invoke, one_line_error

    bad = _tower_trace(fz, tmp_path / f"{name}.h5", lambda f: mutate(fz, f))
    r = invoke("show", bad)
    if needles is None:
        assert r.exit_code == 0, r.output
    else:
        line = one_line_error(r, *needles)
        assert "is damaged" not in line, line


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


def test_outside_watch_sees_a_read(fz, tmp_path):
    """The check itself: reading a watched file is seen (so 0 reads outside means something)."""
    target = tmp_path / "canary.bin"
    target.write_bytes(b"x")
    watch = fz.OutsideWatch([tmp_path])
    assert watch.ok
    assert watch.events() == []
    target.read_bytes()
    assert "canary.bin" in watch.events()


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
