"""The trace writer's chunk encoding, timed on the chunks of a real trace.

    python benchmarks/bench_encode.py TRACE.h5 [--repeats 3]

Reads every stored chunk of TRACE's row datasets back to its values (HDF5 undoes the filters),
then encodes them all again, best of --repeats, three ways: zlib's Z_RLE on every byte plane
that is not noise (the writer before ISA-L), the writer's encode_chunk as it is (ISA-L level 1),
and one zlib stream at level 1 (HDF5's own gzip 1 + shuffle, for scale). Prints seconds and
encoded MiB for each; the same bytes go in every time.
"""

from __future__ import annotations

import argparse
import time
import zlib

import h5py
import numpy as np

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

from gemma4_trace.traces import chunks


def chunks_of(path: str) -> list[np.ndarray]:
    out = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and obj.chunks and obj.ndim >= 1 and obj.dtype.kind in "uif":
            if obj.dtype.itemsize < 2 or obj.id.get_num_chunks() == 0:
                return
            rows = obj.chunks[0]
            for k in range(obj.id.get_num_chunks()):
                start = obj.id.get_chunk_info(k).chunk_offset[0]
                block = obj[start : start + rows]
                if block.shape[0] < rows:
                    block = np.concatenate([block, np.zeros((rows - block.shape[0], *block.shape[1:]), block.dtype)])
                out.append(np.ascontiguousarray(block))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return out


def _zlib_compressor(setting: int):
    if setting == chunks.STORED:
        return zlib.compressobj(0, zlib.DEFLATED, -15)
    return zlib.compressobj(1, zlib.DEFLATED, -15, 8, zlib.Z_RLE)


def zlib_rle(chunk: np.ndarray) -> bytes:
    """The writer before ISA-L: noise planes stored, the rest zlib Z_RLE, one stream."""
    body = chunks.deflate_planes(chunks.shuffle(chunk), _zlib_compressor)
    return body + chunks.fletcher32(body).to_bytes(4, "little")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    blocks = chunks_of(a.trace)
    raw = sum(c.nbytes for c in blocks) / 2**20
    print(f"{a.trace}: {len(blocks)} stored chunks, {raw:.1f} MiB of values")
    ways = {
        "zlib Z_RLE per plane (before)": zlib_rle,
        "encode_chunk (ISA-L level 1 per plane)": chunks.encode_chunk,
        "one zlib level-1 stream (HDF5's gzip 1)": lambda c: chunks.encode_chunk(c, zlib.Z_DEFAULT_STRATEGY),
    }
    for name, fn in ways.items():
        best = float("inf")
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = [fn(c) for c in blocks]
            best = min(best, time.perf_counter() - t0)
        for c, o in zip(blocks[:50], out[:50]):  # every way is a zlib stream of the shuffled bytes
            assert zlib.decompress(o[:-4]) == chunks.shuffle(c).tobytes()
        print(f"{name:42s} {best:6.3f} s  {sum(len(o) for o in out) / 2**20:7.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
