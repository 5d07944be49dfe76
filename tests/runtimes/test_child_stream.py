"""Tensors a child engine streams (replayer/child.py): sent in batches, in order, all of them; a
crash before a batch is sent still names the last kind streamed (the child's progress file), and
a progress file that is not the child's line names nothing."""

from __future__ import annotations

import os

import pytest

from gemma4_trace.replayer import child as NC
from gemma4_trace.traces.errors import TraceToolError

ENGINE = "tests.runtimes.stream_engine:StreamEngine"


@pytest.fixture
def child():
    c = NC.Child("stream", ENGINE, streams=True)
    yield c
    c.close()


def _call(child, layers, row, die_after=None):
    """The reply, the tensors handed over ((layer, first value, length) each) and the messages
    they came in."""
    got, messages = [], []
    child._receive = _counting(child._receive, messages)
    reply = child.call("stream", layers, row, die_after, phase="prefill", tensor=lambda k, i, a: got.append((i, a)))
    return reply, [(i, float(a[0, 0]), a.shape[1]) for i, a in got], messages


def _counting(receive, messages):
    def wrapped(phase):
        msg = receive(phase)
        messages.append(msg[0])
        return msg

    return wrapped


def test_a_step_s_tensors_come_in_one_message_before_the_reply(child):
    reply, got, messages = _call(child, 12, 1536)
    assert reply == ("done", 12)
    assert got == [(i, float(i), 1536) for i in range(12)]
    assert messages == ["tensors", "done"]
    assert child.last == ("layer_out", 11)


def test_more_than_a_batch_is_sent_in_several_in_order(child):
    row = NC.FLUSH_BYTES // 4 // 3 + 1  # three rows pass FLUSH_BYTES: a batch every three
    reply, got, messages = _call(child, 7, row)
    assert reply == ("done", 7)
    assert got == [(i, float(i), row) for i in range(7)]
    assert messages == ["tensors", "tensors", "tensors", "done"]


@pytest.mark.parametrize("knob", ["0", "1"])
def test_a_flush_size_of_a_byte_sends_each_tensor_on_its_own(monkeypatch, knob):
    monkeypatch.setenv(NC.FLUSH_ENV, knob)  # what benchmarks/bench_child_stream.py compares with
    c = NC.Child("stream", ENGINE, streams=True)
    try:
        reply, got, messages = _call(c, 5, 16)
    finally:
        c.close()
    assert reply == ("done", 5) and got == [(i, float(i), 16) for i in range(5)]
    assert messages == ["tensors"] * 5 + ["done"]


def test_a_crash_before_the_batch_is_sent_names_the_last_kind_streamed(child):
    with pytest.raises(TraceToolError) as e:
        _call(child, 12, 16, die_after=5)
    assert str(e.value).startswith("stream crashed in prefill after layer 5 layer_out: killed by SIGABRT"), e.value


@pytest.mark.parametrize("text", [b"", b"layer_out", b"layer_out 3 4", b"nonsense 3", b"layer_out -1", b"\xff\xfe 3"])
def test_a_progress_file_not_of_the_child_s_making_names_nothing(child, text):
    with open(os.path.join(child.folder, NC.PROGRESS), "wb") as f:
        f.write(text)
    assert child._progress() is None


def test_a_progress_line_reads_back(child):
    with open(os.path.join(child.folder, NC.PROGRESS), "wb") as f:
        f.write(b"final_hidden None".ljust(64))
    assert child._progress() == ("final_hidden", None)
