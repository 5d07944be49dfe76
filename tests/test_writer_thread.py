"""The writer thread (traces/writer.py): rows are written off the model's thread, the model
thread waits only while the queue is full, and an error or an interrupt still ends in one line
and no file."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest

from gemma4_trace.traces import writer
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, without_progress
from tests.support.synth import write_trace


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trace-writer"]


def _failing_write(monkeypatch, exc: BaseException, after: int = 2):
    """Make the writer thread's `after`+1-th write raise `exc`; return the threads that wrote."""
    real, seen = writer.Series.write, []

    def write(self, blocks, final=False):
        seen.append(threading.current_thread())
        if len(seen) > after:
            raise exc
        return real(self, blocks, final)

    monkeypatch.setattr(writer.Series, "write", write)
    return seen


def test_rows_are_written_on_the_writer_thread(tmp_path, monkeypatch):
    seen = _failing_write(monkeypatch, RuntimeError("unused"), after=10**9)
    path = tmp_path / "t.h5"
    write_trace(path)
    assert seen and all(t.name == "trace-writer" for t in seen)
    assert not _writer_threads()
    with TraceReader(path) as r:
        assert r.read("q", 0).shape[0] == r.n_positions


def test_disk_full_in_the_writer_thread_is_one_line_and_no_file(tmp_path, monkeypatch):
    """`trace record` on a real model: ENOSPC raised in the writer thread reads as it always did."""
    seen = _failing_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(writer.os, "sched_getaffinity", lambda pid: set(range(64)))  # a core for the thread
    out = tmp_path / "t.h5"
    res = invoke("record", "--input-ids", "2,17,5", "--max-new-tokens", "6", "-o", str(out))
    lines = without_progress([l for l in res.output.splitlines() if l.strip()])
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "no space left on device writing" in lines[0] and "Traceback" not in res.output, res.output
    assert seen[-1].name == "trace-writer"
    assert list(tmp_path.iterdir()) == [] and not _writer_threads()


def test_writer_thread_error_is_raised_in_the_model_thread(tmp_path, monkeypatch):
    _failing_write(monkeypatch, ValueError("tensors/L01/q: boom"), after=0)
    monkeypatch.setattr(writer, "MAX_CHUNK_ROWS", 1)  # a write per row: the error comes while rows are added
    with pytest.raises(ValueError, match="boom") as info:
        write_trace(tmp_path / "t.h5", new_tokens=6)
    assert "tensors/L01/q: boom" == str(info.value)
    assert list(tmp_path.iterdir()) == [] and not _writer_threads()


def test_interrupt_while_the_writer_thread_writes_leaves_nothing(tmp_path, monkeypatch):
    busy, release = threading.Event(), threading.Event()
    real = writer.Series.write

    def slow(self, blocks, final=False):
        busy.set()
        release.wait(10)
        return real(self, blocks, final)

    monkeypatch.setattr(writer.Series, "write", slow)
    monkeypatch.setattr(writer, "MAX_CHUNK_ROWS", 1)

    def edit(kind, layer, step, rows):
        if step == 2 and kind == "q":
            assert busy.wait(10)
            threading.Timer(0.2, release.set).start()  # the write in progress ends after the interrupt
            raise KeyboardInterrupt
        return rows

    with pytest.raises(KeyboardInterrupt):
        write_trace(tmp_path / "t.h5", new_tokens=6, edit=edit)
    assert list(tmp_path.iterdir()) == [] and not _writer_threads()


class _Slow:
    """A series whose write waits until released."""

    def __init__(self):
        self.release, self.written = threading.Event(), []

    def write(self, blocks, final=False):
        self.release.wait(10)
        self.written.append(blocks)


def test_model_thread_waits_only_while_the_queue_is_full():
    q = writer._Writes(max_bytes=1000)
    s = _Slow()
    try:
        t0 = time.perf_counter()
        q.submit(s, [np.zeros(100, np.float32)])  # 400 bytes: queued at once
        q.submit(s, [np.zeros(100, np.float32)])  # 800 bytes
        assert time.perf_counter() - t0 < 1.0 and s.written == []
        done = threading.Event()
        t = threading.Thread(target=lambda: (q.submit(s, [np.zeros(100, np.float32)]), done.set()))
        t.start()  # 1200 bytes would be queued: waits for the writer
        assert not done.wait(0.5)
        s.release.set()
        assert done.wait(10)
        q.drain()
        assert len(s.written) == 3
    finally:
        s.release.set()
        q.close()
    assert not q.thread.is_alive()


def test_a_writer_thread_only_where_it_has_a_core(tmp_path, monkeypatch):
    """On a GPU, or with a CPU core the model's threads leave free, the writes go to the writer
    thread; when the model's threads take every core they run on the model's thread, between its
    steps (a thread would stall one of the model's threads: docs/benchmarks.md)."""
    import torch

    monkeypatch.setattr(writer.os, "sched_getaffinity", lambda pid: {0, 1})
    assert writer.spare_core("cuda", 2) and writer.spare_core("cpu", 1) and not writer.spare_core("cpu", 2)
    threads = torch.get_num_threads()
    try:
        for n, expected in ((2, "MainThread"), (1, "trace-writer")):
            torch.set_num_threads(n)
            seen = _failing_write(monkeypatch, RuntimeError("unused"), after=10**9)
            res = invoke("record", "--input-ids", "2,17,5", "--max-new-tokens", "2", "-o", str(tmp_path / f"{n}.h5"))
            assert res.exit_code == 0, res.output
            assert seen and {t.name for t in seen} == {expected}, (n, {t.name for t in seen})
    finally:
        torch.set_num_threads(threads)
    with TraceReader(tmp_path / "1.h5") as a, TraceReader(tmp_path / "2.h5") as b:
        assert a.content_hash() == b.content_hash()


@pytest.mark.slow
def test_the_writer_thread_and_the_model_thread_never_enter_hdf5_at_once(tmp_path):
    """H5Dwrite_chunk does not take h5py's lock: the writer thread writing chunks while the model
    thread created the next step's datasets corrupted HDF5's metadata cache ("ring type mismatch",
    "Unspecified error in H5Dwrite_chunk"; 2 of 4 of these writes failed). Every write must finish
    and read back as written."""
    import h5py

    from benchmarks.bench_diff import write_pair

    for seed in range(4):
        ref, run = tmp_path / f"ref{seed}.h5", tmp_path / f"run{seed}.h5"
        write_pair(ref, run, 1024, 64, seed=seed)
        with h5py.File(ref, "r") as a, h5py.File(run, "r") as b:
            x, y = a["tensors/L00/layer_out"][()], b["tensors/L00/layer_out"][()]
            assert x.shape == y.shape == (1088, 1536) and np.abs(x - y).max() < 1e-4 * np.abs(x).max()
