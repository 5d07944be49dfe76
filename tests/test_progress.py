"""Progress on stderr (gemma4_trace/progress.py): live only on a terminal, plain lines in a
log, the steps really run, what a command is doing while a model loads."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from gemma4_trace.progress import Progress, heartbeat


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


def test_a_log_is_never_silent_past_the_heartbeat(monkeypatch):
    """Off a terminal, each phase is written when it ends, in order, and a phase past
    GEMMA4_TRACE_HEARTBEAT_S is written as it runs, with its elapsed time and steps."""
    monkeypatch.setenv("GEMMA4_TRACE_HEARTBEAT_S", "0.05")
    log = io.StringIO()
    p = Progress("replaying", stream=log)
    p.phase("loading the model")
    p.phase("lowering")
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("replaying: loading the model: ") and lines[0].endswith(" s")
    time.sleep(0.3)
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3 and all(x.startswith("replaying: lowering ... ") for x in lines[1:]), lines
    p.phase("running the steps")  # from now on written as it happens
    assert log.getvalue().splitlines()[-1].startswith("replaying: lowering: ")
    p(2, 8)
    time.sleep(0.2)
    assert "replaying: running the steps ... 2/8 steps, " in log.getvalue()
    p.close()
    assert log.getvalue().splitlines()[-1].startswith("replaying: running the steps: 2 steps")
    assert "\r" not in log.getvalue()
    term = _Terminal()  # a terminal: only its own redrawn line, no heartbeat lines
    p = Progress("replaying", stream=term)
    p.phase("lowering")
    time.sleep(0.2)
    p.close()
    assert " ... 0 s\n" not in term.getvalue() and term.getvalue().count("\n") == 1


def test_a_command_without_phases_beats_off_a_terminal_only(monkeypatch):
    monkeypatch.setenv("GEMMA4_TRACE_HEARTBEAT_S", "0.05")
    log, term = io.StringIO(), _Terminal()
    for stream in (log, term):
        with heartbeat("trace sweep", "running the prompts", lambda: "3 of 9 prompts done", stream=stream):
            time.sleep(0.3)
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3 and all(
        x.startswith("trace sweep: running the prompts ... 3 of 9 prompts done, ") for x in lines
    )
    assert term.getvalue() == ""
    n = len(lines)
    time.sleep(0.2)
    assert len(log.getvalue().splitlines()) == n  # the beat ends with the block


def test_the_option_forces_either_way():
    assert "\r" in _run(io.StringIO(), enabled=True)
    assert "\r" not in _run(_Terminal(), enabled=False)


def test_a_failed_run_says_the_phases_it_got_through():
    t = _Terminal()
    p = Progress("replaying", stream=t)
    p.phase("loading the model")
    p.close(completed=False)
    p.close()  # idempotent: the CLI closes again in its finally
    out = t.getvalue()
    assert out.endswith("\n") and "loading the model: " not in out  # no phase reported as finished
    log = io.StringIO()  # a log: the phases it got through, then (the CLI's) error line
    p = Progress("replaying", stream=log)
    p.phase("loading the model")
    p.phase("running the steps")
    p(3, 8)
    p.close(completed=False)
    p.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("replaying: loading the model: "), lines


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
