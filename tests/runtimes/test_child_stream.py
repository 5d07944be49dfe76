"""Tensors a child engine streams (replayer/child.py): sent in batches, in order, all of them; a
crash before a batch is sent still names the last kind streamed (the child's progress file), and
a progress file that is not the child's line names nothing."""

from __future__ import annotations

import io
import os
import pickle
import struct

import numpy as np
import pytest

from gemma4_trace.replayer import child as NC
from gemma4_trace.traces.errors import TraceToolError

ENGINE = "tests.support.stream_engine:StreamEngine"


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


# ---------------------------------------------------------------- the wire: arrays out of band
def _arrays():
    rng = np.random.default_rng(0)
    big = rng.standard_normal((3, NC.PIPE_BYTES // 4 + 5), dtype=np.float32)  # more than a widened pipe holds
    return {
        "big": big,
        "fortran": np.asfortranarray(rng.standard_normal((7, 5))),
        "strided": big[:, ::3],  # not contiguous: pickled in band
        "scalar": np.array(3.5, dtype=np.float16),
        "empty": np.zeros((0, 4), dtype=np.int64),
        "bools": np.array([True, False, True]),
        "ints": np.arange(11, dtype=np.int64).reshape(1, 11),
    }


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == a[k].dtype and b[k].shape == a[k].shape, k
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


@pytest.mark.parametrize("inband", [False, True])
def test_arrays_come_back_as_they_went_both_ways(monkeypatch, inband):
    if inband:
        monkeypatch.setenv(NC.WIRE_ENV, "inband")  # what the benchmarks compare with
    c = NC.Child("stream", ENGINE)
    try:
        sent = _arrays()
        tag, got = c.call("echo", sent, phase="prefill")
        assert tag == "echo"
        _same(sent, got)
        assert all(v.flags.writeable for v in got.values())  # torch.from_numpy takes them as they are
    finally:
        c.close()


def _wire(msg, inband=False) -> bytes:
    stream = io.BytesIO()
    NC.send_msg(stream, msg, inband)
    return stream.getvalue()


def test_out_of_band_buffers_carry_the_arrays_and_in_band_does_not():
    msg = ("outputs", list(_arrays().values()))
    oob, inb = _wire(msg), _wire(msg, inband=True)
    assert NC.HEAD.unpack(oob[: NC.HEAD.size])[1] == 6  # every contiguous array; the strided one in band
    assert NC.HEAD.unpack(inb[: NC.HEAD.size])[1] == 0
    for data in (oob, inb):
        tag, arrays = NC.recv_msg(io.BytesIO(data))
        assert tag == "outputs"
        _same(dict(enumerate(msg[1])), dict(enumerate(arrays)))


def test_a_stream_that_ends_inside_a_message_is_no_message():
    data = _wire(("outputs", [np.arange(1000, dtype=np.float32)]))
    for cut in (0, 5, NC.HEAD.size, NC.HEAD.size + 4, len(data) - 1):
        assert NC.recv_msg(io.BytesIO(data[:cut])) is None, cut


OOB = pickle.dumps(np.arange(4), protocol=5, buffer_callback=lambda b: None)


def _head(n: int, sizes, tail=b"") -> bytes:
    return NC.HEAD.pack(n, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes) + tail


@pytest.mark.parametrize(
    "data",
    [
        NC.HEAD.pack(0, NC.MAX_BUFFERS + 1),  # more buffers than any message of ours
        _head(NC.MAX_REPLY + 1, []),  # a pickle longer than the limit
        _head(8, [NC.MAX_REPLY - 4]),  # the pickle and its buffers together longer
        _head(4, [], b"\x00\x01\x02\x03"),  # bytes that are no pickle
        _head(len(OOB), [], OOB),  # a pickle whose buffer is not there
    ],
)
def test_a_malformed_message_is_refused_before_anything_is_allocated(data):
    with pytest.raises(NC.Malformed):
        NC.recv_msg(io.BytesIO(data))


def test_a_malformed_reply_is_one_line_and_ends_the_child(child):
    child.proc.stdout = io.BytesIO(NC.HEAD.pack(0, NC.MAX_BUFFERS + 1))  # as if the child had written it
    with pytest.raises(TraceToolError) as e:
        child._receive("decode step 2")
    assert str(e.value) == "stream sent a malformed reply in decode step 2 before reporting anything"
    assert child.proc.wait(timeout=10) < 0  # killed


class _Marker:
    """Unpickled, this would create `path`: proof that a reply ran code in the parent."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_reply_that_names_a_callable_is_refused_and_runs_nothing(child, tmp_path):
    """A child runs third-party native code on untrusted files, confined; a reply that named a
    callable would run it in the parent, outside the confinement. Only numpy's array, dtype and scalar
    constructors may be named: anything else is a malformed reply, and nothing ran."""
    marker = tmp_path / "ran"
    data = _wire(("outputs", [np.arange(3, dtype=np.float32), _Marker(marker)]))
    with pytest.raises(NC.Malformed):
        NC.recv_msg(io.BytesIO(data))
    assert not marker.exists()
    child.proc.stdout = io.BytesIO(data)  # as if the child had written it
    with pytest.raises(TraceToolError, match="malformed reply"):
        child._receive("prefill")
    assert not marker.exists()
    # what replies hold passes: arrays (contiguous or not, any dtype), numpy scalars, plain data
    good = ("ready", {"a": (np.ones((2, 3), np.float16).T, np.float32(2.5), np.bool_(True), [1, "x", None], b"z")})
    tag, body = NC.recv_msg(io.BytesIO(_wire(good)))
    assert tag == "ready" and body["a"][1] == np.float32(2.5) and body["a"][0].shape == (3, 2)
    # the parent's commands, read by the child, are trusted (they carry paths and engine names)
    assert NC.recv_msg(io.BytesIO(_wire(("load", tmp_path))), trusted=True) == ("load", tmp_path)


def test_a_reply_larger_than_the_replay_could_hold_is_refused_before_it_is_allocated():
    """A child's reply is bounded by what a step of the replay may hold (its model's kinds at
    max_seq rows: traces/limits.py step_bytes), not by MAX_REPLY alone: a 2 GB reply from a child
    replaying the embedded model at max_seq 16 would be allocated under a 16 GiB limit."""
    from gemma4_trace.hf.model import load_model

    rt = NC.ChildRuntime()
    assert rt.reply_limit() == NC.MAX_REPLY  # before the runtime knows its model
    rt.loaded, rt.max_seq = load_model(weights=False), 16
    limit = rt.reply_limit()
    assert NC.REPLY_FLOOR < limit < NC.REPLY_FLOOR + (8 << 20)
    rt.max_seq = 96  # the image golden's: its patches too
    assert limit < rt.reply_limit() < NC.REPLY_FLOOR + (64 << 20)
    rt.max_seq = 16
    child = rt.start("stream", ENGINE, streams=True)
    try:
        row = limit // 4 + 1  # one float32 tensor a little over the limit (the child sends it whole)
        with pytest.raises(TraceToolError) as e:
            child.call("stream", 1, row, None, phase="prefill")
        assert str(e.value) == "stream sent a malformed reply in prefill before reporting anything"
        assert child.proc.wait(timeout=10) < 0  # killed
    finally:
        rt.close()
