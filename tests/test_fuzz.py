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
import sys
from pathlib import Path

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
    # no hang or crash inside HDF5 either (text is stored as fixed-length strings, see docs/robustness.md)
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
    """A few cases in this very process (the worker's code path, without the isolation)."""
    rep = fz.fuzz(20, SEED + 1, timeout=8.0)
    assert rep.cases == 20 and not rep.failures, rep.failures[:3]


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
