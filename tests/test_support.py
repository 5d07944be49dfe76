"""The shared checks of tests/support/cli.py can fail: each rule of one_line_error rejects what it must."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from tests.support.cli import invoke, one_line_error, site_of

GOOD = "error: x.h5 is not a valid trace: no /meta\n"


def result(code=2, stdout="", stderr=GOOD):
    return SimpleNamespace(exit_code=code, stdout=stdout, stderr=stderr)


def test_one_line_error_accepts_the_one_line():
    assert one_line_error(result(), "x.h5", "no /meta") == GOOD.rstrip("\n")
    noise = "Failed to load image Python extension\n"  # third-party start-up noise is set aside
    assert one_line_error(result(stderr=noise + GOOD)) == GOOD.rstrip("\n")
    p = subprocess.CompletedProcess([], 2, stdout="", stderr=GOOD)
    assert one_line_error(p, "x.h5") == GOOD.rstrip("\n")


@pytest.mark.parametrize(
    "bad,needles",
    [
        (result(code=1), ()),
        (result(code=0), ()),
        (result(stdout="progress\n"), ()),
        (result(stderr=GOOD + "more\n"), ()),
        (result(stderr=GOOD.rstrip("\n")), ()),  # no newline at the end
        (result(stderr="x.h5 is bad\n"), ()),
        (result(stderr="error: \n"), ()),
        (result(stderr="error: internal error (KeyError: 'x'); set GEMMA4_TRACE_DEBUG=1\n"), ()),
        (result(stderr="Traceback (most recent call last):\n"), ()),
        (result(stderr="error: \x1b[31mred\x1b[0m\n"), ()),
        (result(), ("not in the line",)),
    ],
)
def test_one_line_error_rejects(bad, needles):
    with pytest.raises(AssertionError):
        one_line_error(bad, *needles)


def test_one_line_error_checks_nothing_was_written(tmp_path):
    out = tmp_path / "run.h5"
    one_line_error(result(), out=out)
    (tmp_path / ".trace-partial-run.h5").write_bytes(b"")
    with pytest.raises(AssertionError):
        one_line_error(result(), out=out)
    out.write_bytes(b"")
    with pytest.raises(AssertionError):
        one_line_error(result(), out=out)


def test_invoke_runs_the_cli_and_site_of_reads_dicts_and_objects(tmp_path):
    one_line_error(invoke("show", tmp_path / "none.h5"), "none.h5")
    d = {"step": 2, "phase": "decode", "layer": 1, "kind": "k", "position": 6}
    assert site_of(d) == (2, 1, "k", 6)
    assert site_of(SimpleNamespace(**d), "kind", "phase") == ("k", "decode")
