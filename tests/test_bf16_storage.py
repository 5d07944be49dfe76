"""bfloat16 values stored as their 16-bit patterns (schema.STORAGE_BF16): half the bytes of
float32, read back as the same float32 values, so readers, content hashes and the diff give
the same results as for the float32-stored trace of the same run."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

from gemma4_trace.recorder.record import record_trace
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceCorruptError
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke
from tests.support.synth import write_trace


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    ref, bf16 = d / "ref.h5", d / "bf16.h5"
    record_trace(output=ref, max_new_tokens=4, dtype="float32")
    record_trace(output=bf16, max_new_tokens=4, dtype="bfloat16")
    wide = d / "bf16-as-float32.h5"
    _as_float32_storage(bf16, wide)
    return ref, bf16, wide


def _as_float32_storage(src, dst) -> None:
    """The same trace with every bf16-stored dataset rewritten as float32 (the storage before)."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        paths = []
        f.visititems(lambda name, obj: paths.append(name) if S.ATTR_STORAGE in obj.attrs else None)
        for p in paths:
            ds = f[p]
            attrs = {k: v for k, v in ds.attrs.items() if k != S.ATTR_STORAGE}
            values = (ds[()].astype(np.uint32) << 16).view(np.float32)
            del f[p]
            new = f.create_dataset(
                p, data=values, maxshape=(None, *values.shape[1:]), compression="gzip", shuffle=True, fletcher32=True
            )
            for k, v in attrs.items():
                new.attrs[k] = v


def test_bf16_run_stored_in_16_bits(runs):
    ref, bf16, wide = runs
    with h5py.File(bf16, "r") as f:
        q = f["tensors/L00/q"]
        assert q.dtype == np.uint16 and q.attrs[S.ATTR_STORAGE].decode() == S.STORAGE_BF16
        assert f["tensors/logits"].dtype == np.uint16
        assert f["tensors/L00/mask"].dtype == np.bool_ and S.ATTR_STORAGE not in f["tensors/L00/mask"].attrs
        assert f["tensors/token"].dtype == np.int64
    with h5py.File(ref, "r") as f:  # a float32 run is stored as before
        assert f["tensors/L00/q"].dtype == np.float32 and S.ATTR_STORAGE not in f["tensors/L00/q"].attrs
    # shuffle + gzip already squeeze the zero low halves of float32-stored bf16 values: the file is
    # only a little smaller; the gain is the half as many bytes to compress and write
    assert bf16.stat().st_size < wide.stat().st_size


def test_readers_hash_and_diff_identical_for_both_storages(runs):
    ref, bf16, wide = runs
    with TraceReader(bf16) as a, TraceReader(wide) as b:
        assert a.kinds_present() == b.kinds_present()
        for kind, layer in a.kinds_present():
            x, y = a.read(kind, layer), b.read(kind, layer)
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), (kind, layer)
            assert a.read(kind, layer, slice(1, 3)).tobytes() == b.read(kind, layer, slice(1, 3)).tobytes()
        assert a.stored_as("q", 0) == S.STORAGE_BF16 and b.stored_as("q", 0) == "float32"
        assert a.source_dtype("q", 0) == b.source_dtype("q", 0) == "bfloat16"
        assert a.content_hash() == b.content_hash()  # a hash of the values, not of how they are stored
    for args in ([ref, "{}"], ["{}", ref], ["{}", "{}"]):
        outs = []
        for run in (bf16, wide):
            res = invoke("diff", *[str(run) if a == "{}" else str(a) for a in args], "--json")
            assert res.exit_code in (0, 1), res.output
            outs.append(res.output.replace(str(run), "RUN"))
        assert outs[0] == outs[1]
    res = invoke("show", str(bf16))
    assert res.exit_code == 0 and "bfloat16" in res.output


def test_values_that_are_not_bf16_widen_to_float32(tmp_path, monkeypatch):
    """A runtime that says bfloat16 but hands over other float32 values loses nothing: the dataset
    (the rows written so far too) is stored as float32."""
    from gemma4_trace.traces import writer

    monkeypatch.setattr(writer, "MAX_CHUNK_ROWS", 1)  # a write per row: rows 0-2 are written before row 3 comes
    path = tmp_path / "t.h5"

    def bf(a):
        return (np.asarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)

    def edit(kind, layer, step, rows):  # bf16 values, but the last step's logits are not
        if rows.dtype.kind != "f" or (kind == "logits" and step == 3):
            return rows
        return bf(rows)

    write_trace(path, new_tokens=4, source_dtype="bfloat16", edit=edit)
    with TraceReader(path) as a:
        assert a.stored_as("logits") == "float32" and a.stored_as("q", 0) == S.STORAGE_BF16
        logits = a.read("logits")
        assert np.array_equal(logits[:3], bf(logits[:3])) and not np.array_equal(logits[3], bf(logits[3]))
    want = tmp_path / "want.h5"  # the same values, stored as float32 from the start
    write_trace(want, new_tokens=4, source_dtype="float32", edit=edit)
    with TraceReader(path) as a, TraceReader(want) as b:
        assert np.array_equal(a.read("logits"), b.read("logits").astype(np.float32))
        assert np.array_equal(a.read("q", 1), b.read("q", 1))


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda ds: ds.attrs.modify(S.ATTR_STORAGE, np.bytes_(b"float8")), "only a float kind may say"),
        (lambda ds: ds.attrs.__delitem__(S.ATTR_STORAGE), "expected float16, float32 or float64"),
    ],
)
def test_bad_bf16_storage_refused(runs, tmp_path, change, needle):
    bad = tmp_path / "bad.h5"
    shutil.copy(runs[1], bad)
    with h5py.File(bad, "r+") as f:
        change(f["tensors/L00/q"])
    with pytest.raises(TraceCorruptError, match=needle):
        TraceReader(bad)


def test_storage_attribute_on_float32_refused(runs, tmp_path):
    bad = tmp_path / "bad.h5"
    shutil.copy(runs[0], bad)
    with h5py.File(bad, "r+") as f:
        f["tensors/L00/q"].attrs[S.ATTR_STORAGE] = np.bytes_(S.STORAGE_BF16.encode())
    with pytest.raises(TraceCorruptError, match="expected uint16"):
        TraceReader(bad)


def test_bf16_rows_stored_as_float32_when_asked(runs, tmp_path, monkeypatch):
    """The recorder hands bf16 rows over as bit patterns (writer.Bf16Rows); with 16-bit storage
    switched off (the benchmarks' "before", benchmarks/writer_variants.py) the writer widens them:
    the same values, stored as float32."""
    from benchmarks.writer_variants import before

    old = tmp_path / "f32-storage.h5"
    with before(bits=False):
        record_trace(output=old, max_new_tokens=4, dtype="bfloat16")
    with h5py.File(old, "r") as f:
        assert f["tensors/L00/q"].dtype == np.float32 and S.ATTR_STORAGE not in f["tensors/L00/q"].attrs
    with TraceReader(old) as a, TraceReader(runs[2]) as b:
        assert a.stored_as("logits") == b.stored_as("logits") == "float32"
        for kind, layer in b.kinds_present():
            assert np.array_equal(a.read(kind, layer), b.read(kind, layer), equal_nan=True), (kind, layer)
