"""Whole chunks encoded by the writer (traces/writer.py encode_chunk): the bytes
HDF5's own filters would store (byte-identical under zlib's default strategy), read back by
plain h5py, Fletcher-32 still catching a flipped byte, and a trace equal, value for value, to
one written through HDF5's filters."""

from __future__ import annotations

import zlib

import h5py
import numpy as np
import pytest

from benchmarks.writer_variants import before
from gemma4_trace.traces import chunks, writer
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.reader import TraceReader
from tests.support.synth import write_trace


def _filtered(tmp_path, data: np.ndarray) -> h5py.Dataset:
    f = h5py.File(tmp_path / "ref.h5", "w")
    return f.create_dataset("x", data=data, chunks=data.shape, **writer.COMPRESSION)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.int64])
def test_encoded_chunk_equals_hdf5s_own_bytes(tmp_path, dtype):
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((37, 300)) * 1000).astype(dtype)
    ds = _filtered(tmp_path, data)
    mask, stored = ds.id.read_direct_chunk((0, 0))
    ds.file.close()
    assert mask == 0 and chunks.encode_chunk(data, zlib.Z_DEFAULT_STRATEGY) == stored


def test_fletcher32_matches_hdf5_on_odd_and_zero_data(tmp_path):
    for raw in (b"\x01", b"\x00" * 7, b"\xff" * 4097, bytes(range(256)) * 300 + b"\x05"):
        # HDF5's checksum of these bytes: the last 4 bytes of an unfiltered, fletcher32-only chunk
        data = np.frombuffer(raw, dtype=np.uint8)
        with h5py.File(tmp_path / "f.h5", "w") as f:
            ds = f.create_dataset("x", data=data, chunks=data.shape, fletcher32=True)
            stored = ds.id.read_direct_chunk((0,))[1]
        assert stored[:-4] == raw and int.from_bytes(stored[-4:], "little") == chunks.fletcher32(raw)


def test_direct_chunks_read_back_by_plain_h5py(tmp_path):
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((150, 64)).astype(np.float32)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        ds = f.create_dataset("x", shape=(150, 64), dtype=np.float32, chunks=(64, 64), **writer.COMPRESSION)
        for a in range(0, 150, 64):
            chunk = np.zeros((64, 64), np.float32)
            chunk[: min(64, 150 - a)] = rows[a : a + 64]
            ds.id.write_direct_chunk((a, 0), chunks.encode_chunk(chunk))
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert np.array_equal(f["x"][()], rows)


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    chunk = np.arange(4096, dtype=np.float32).reshape(64, 64)
    blob = bytearray(chunks.encode_chunk(chunk))
    blob[len(blob) // 2] ^= 0x10
    with h5py.File(tmp_path / "d.h5", "w") as f:
        ds = f.create_dataset("x", shape=(64, 64), dtype=np.float32, chunks=(64, 64), **writer.COMPRESSION)
        ds.id.write_direct_chunk((0, 0), bytes(blob))
    with h5py.File(tmp_path / "d.h5", "r") as f, pytest.raises(OSError):
        f["x"][()]


def _bf16_values(kind, layer, step, rows):
    """bfloat16 values (stored as 16-bit patterns), except q's rows of step 3: q is widened to float32
    after a whole chunk was written and two rows carried as 16-bit patterns (MAX_CHUNK_ROWS 3)."""
    if rows.dtype.kind != "f" or (kind == "q" and step == 3):
        return rows
    return (np.asarray(rows, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


@pytest.mark.parametrize("source_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("edit", [None, _bf16_values])
def test_trace_equals_one_written_through_hdf5s_filters(tmp_path, monkeypatch, source_dtype, edit):
    """Rows of many steps (a prefill, then one row per decode step: chunks filled across writes,
    a last part chunk) written both ways hold the same values and the same content hash."""
    monkeypatch.setattr(writer, "MAX_CHUNK_ROWS", 3)
    write_trace(tmp_path / "direct.h5", new_tokens=7, source_dtype=source_dtype, edit=edit)
    with before(direct=False):  # HDF5's own filters on every row block (the benchmarks' "before")
        write_trace(tmp_path / "filtered.h5", new_tokens=7, source_dtype=source_dtype, edit=edit)
    with TraceReader(tmp_path / "direct.h5") as a, TraceReader(tmp_path / "filtered.h5") as b:
        assert a.content_hash() == b.content_hash()
        if edit and source_dtype == "bfloat16":
            assert a.stored_as("layer_out", 0) == S.STORAGE_BF16 and a.stored_as("q", 0) == "float32"
    with h5py.File(tmp_path / "direct.h5") as a, h5py.File(tmp_path / "filtered.h5") as b:
        names = []
        a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert names
        for n in names:
            assert np.array_equal(a[n][()], b[n][()]), n
            assert a[n].dtype == b[n].dtype and a[n].chunks == b[n].chunks, n


def _zero_v(kind, layer, step, rows):
    return np.zeros_like(rows) if kind == "v" else rows


@pytest.mark.parametrize("source_dtype", ["float32", "bfloat16"])
def test_chunks_of_zeros_are_not_written_and_read_as_zeros(tmp_path, monkeypatch, source_dtype):
    """Rows of zeros (a kind not recorded at some steps) leave their chunks unwritten: the file has no
    chunk for them, plain h5py and the trace reader read zeros, and the content hash is the one
    of the same trace written through HDF5's filters (which writes every chunk)."""
    monkeypatch.setattr(writer, "MAX_CHUNK_ROWS", 3)
    write_trace(tmp_path / "direct.h5", new_tokens=7, source_dtype=source_dtype, edit=_zero_v)
    with before(direct=False):
        write_trace(tmp_path / "filtered.h5", new_tokens=7, source_dtype=source_dtype, edit=_zero_v)
    with TraceReader(tmp_path / "direct.h5") as a, TraceReader(tmp_path / "filtered.h5") as b:
        assert a.content_hash() == b.content_hash()
    with h5py.File(tmp_path / "direct.h5") as a, h5py.File(tmp_path / "filtered.h5") as b:
        v, q = S.tensor_path("v", 0), S.tensor_path("q", 0)
        assert a[v].shape[0] >= 3 and a[v].id.get_num_chunks() == 0 < b[v].id.get_num_chunks()
        assert not a[v][()].any() and a[q].id.get_num_chunks() == b[q].id.get_num_chunks() > 0
        assert np.array_equal(a[q][()], b[q][()])


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.int64])
def test_per_plane_encoding_reads_back_exactly(tmp_path, dtype):
    """The default encoding (a deflate setting per byte plane: noise stored, the skewed high bytes
    coded by ISA-L) is one valid zlib stream: HDF5 inflates it to the same values, the coded planes
    shrink, and it stores noise planes rather than coding them (a chunk of random bytes grows by
    only the stored blocks' headers)."""
    rng = np.random.default_rng(2)
    data = (rng.standard_normal((64, 300)) * 1000).astype(dtype)
    chunk = chunks.encode_chunk(data)
    assert len(chunk) < 0.9 * data.nbytes
    with h5py.File(tmp_path / "d.h5", "w") as f:
        ds = f.create_dataset("x", shape=data.shape, dtype=dtype, chunks=data.shape, **writer.COMPRESSION)
        ds.id.write_direct_chunk((0, 0), chunk)
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert np.array_equal(f["x"][()], data)
    noise = rng.integers(0, 2**16, size=(64, 300), dtype=np.uint16)
    assert len(chunks.encode_chunk(noise)) <= noise.nbytes * 1.01
    assert len(zlib.decompress(chunks.encode_chunk(noise)[:-4])) == noise.nbytes
