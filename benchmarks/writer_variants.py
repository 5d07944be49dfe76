"""The trace writer's earlier paths, for the benchmarks' A/B only (production code keeps one path).

    with before(threaded=False, bits=False, hand_over=False, direct=False):
        record_loaded(...)   # writes on the model's thread, bf16 stored as float32, HDF5's own gzip

Each switch turns one of the writer changes measured in docs/benchmarks.md off, through the
public name it lives in: `threaded` the writer thread (TraceWriter's own switch, threaded=False:
the writes on the caller's thread, for every trace record_loaded writes), `bits` bfloat16 values
stored as their 16-bit patterns (traces/writer.py Series.bf16), `hand_over` bf16 rows handed to
the writer as 16-bit patterns (recorder/record.py writer_rows; numpy_rows instead: upcast to
float32 on the model's thread), `direct` whole chunks encoded by the writer (Series.direct:
HDF5's gzip 1 on each row block instead)."""

from __future__ import annotations

import contextlib

from gemma4_trace.recorder import record
from gemma4_trace.traces import writer


class OnCallersThread(writer.TraceWriter):
    """A TraceWriter that writes on the caller's thread whatever it is asked (threaded=False)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "threaded": False})


@contextlib.contextmanager
def before(threaded: bool = True, bits: bool = True, hand_over: bool = True, direct: bool = True):
    patches = []  # (owner, name, replacement)
    if not threaded:
        patches.append((record, "TraceWriter", OnCallersThread))
    if not bits:
        series = writer.Series.__init__

        def float32_storage(self, *a, **k):
            series(self, *a, **k)
            self.bf16 = False

        patches.append((writer.Series, "__init__", float32_storage))
    if not hand_over:
        patches.append((record, "writer_rows", record.numpy_rows))
    if not direct:
        patches.append((writer.Series, "direct", lambda self, stored: False))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)
