"""The trace writer's earlier paths, for the benchmarks' A/B only (production code keeps one path).

    with before(threaded=False, bits=False, hand_over=False, direct=False):
        record_loaded(...)   # writes on the model's thread, bf16 stored as float32, HDF5's own gzip

Each switch turns one of the writer changes measured in docs/benchmarks.md off by patching the
seam it lives in: `threaded` the writer thread (traces/writer.py _Writes), `bits` bfloat16 values
stored as their 16-bit patterns (_Series.bf16), `hand_over` bf16 rows handed to the writer as
16-bit patterns (recorder/record.py _rows), `direct` whole chunks encoded by the writer
(_Series._direct: HDF5's gzip 1 on each row block instead)."""

from __future__ import annotations

import contextlib

from gemma4_trace.recorder import record
from gemma4_trace.traces import writer


@contextlib.contextmanager
def before(threaded: bool = True, bits: bool = True, hand_over: bool = True, direct: bool = True):
    patches = []  # (owner, name, replacement)
    if not threaded:
        init = writer._Writes.__init__
        patches.append((writer._Writes, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "threaded": False})))
    if not bits:
        series = writer._Series.__init__

        def float32_storage(self, *a, **k):
            series(self, *a, **k)
            self.bf16 = False

        patches.append((writer._Series, "__init__", float32_storage))
    if not hand_over:
        patches.append((record, "_rows", record._np))
    if not direct:
        patches.append((writer._Series, "_direct", lambda self, stored: False))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)
