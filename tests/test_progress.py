"""Progress on stderr (gemma4_trace/progress.py): live only on a terminal, plain lines in a
log, the steps really run, what a command is doing while a model loads."""

from __future__ import annotations

import io
import subprocess
import sys

from gemma4_trace.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _run(stream, enabled=None, steps=40, total=48):
    p = Progress("recording", enabled, stream=stream)
    p.phase("loading the model")
    p.phase("generating")
    for done in range(1, steps + 1):
        p(done, total)
    p.close()
    return stream.getvalue()


def test_a_log_gets_one_plain_line_per_phase_and_the_real_step_count():
    out = _run(io.StringIO())
    assert "\r" not in out and "\x1b" not in out
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("recording: loading the model: ") and lines[0].endswith(" s")
    assert lines[1].startswith("recording: generating: 40 steps (ended at end of sequence, before 48), ")
    full = _run(io.StringIO(), steps=48)
    assert "generating: 48 steps, " in full and "end of sequence" not in full


def test_a_terminal_gets_a_line_redrawn_in_place():
    out = _run(_Terminal())
    assert "\r" in out and "[" + "#" * 25 in out and "40/48" in out
    assert out.endswith("\n") and out.count("\n") == 2  # each phase ends on its own line
    assert "generating: 40 steps (ended at end of sequence, before 48)" in out


def test_the_option_forces_either_way():
    assert "\r" in _run(io.StringIO(), enabled=True)
    assert "\r" not in _run(_Terminal(), enabled=False)


def test_a_failed_run_only_ends_the_line():
    t = _Terminal()
    p = Progress("replaying", stream=t)
    p.phase("loading the model")
    p.close(completed=False)
    p.close()  # idempotent: the CLI closes again in its finally
    out = t.getvalue()
    assert out.endswith("\n") and "loading the model: " not in out  # no phase reported as finished
    log = io.StringIO()  # a log: nothing but the error the CLI prints (one line)
    p = Progress("replaying", stream=log)
    p.phase("loading the model")
    p.phase("running the steps")
    p(3, 8)
    p.close(completed=False)
    p.close()
    assert log.getvalue() == ""


def test_a_redirected_record_log_has_no_carriage_returns_and_says_what_it_did(tmp_path):
    # the embedded model ends its story at end of sequence after 45 tokens: the count is the real one
    log = tmp_path / "log"
    with open(log, "w") as f:
        r = subprocess.run(
            [sys.executable, "-m", "gemma4_trace", "record", "-o", str(tmp_path / "ref.h5"), "--max-new-tokens", "300"],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    text = log.read_text()
    assert r.returncode == 0, text
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].startswith("recording: loading the model: ") and lines[0].endswith(" s")
    n = int(lines[-1].split(" generated")[0].rsplit(" ", 1)[1])
    assert n < 300 and lines[1].startswith(f"recording: generating: {n} steps (ended at end of sequence, before 300), ")
