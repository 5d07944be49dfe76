"""Size and write time of a trace's tensors under each storage setting, kind group by kind group.

    python benchmarks/bench_compression.py TRACE.h5 [--repeats 2]

Reads every float tensor of TRACE (a bf16 recording, say) and writes it again, in the
writer's chunk layout, with each candidate setting: float32 or bfloat16-bits storage, gzip
level 1 / 4 or none, shuffle on or off, or the writer's own chunk encoding (HDF5 built-ins
only: a trace must stay readable with h5py and numpy alone, so no lzf, no plug-ins). Prints, per kind group (logits, the
hidden-state rows, the mask), MiB on disk and seconds to write, the minimum of --repeats.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

import h5py
import numpy as np

from gemma4_trace.traces import chunks as C
from gemma4_trace.traces import writer as W
from gemma4_trace.traces.reader import TraceReader

SETTINGS = {
    "gzip1+shuffle": dict(compression="gzip", compression_opts=1, shuffle=True),
    "gzip1": dict(compression="gzip", compression_opts=1, shuffle=False),
    "gzip4+shuffle": dict(compression="gzip", compression_opts=4, shuffle=True),
    "none": dict(),
    # gzip1+shuffle as declared, each whole chunk encoded by the writer (per byte plane: stored or ISA-L deflate)
    # (traces/chunks.py encode_chunk); bool masks keep HDF5's own gzip
    "writer chunks": "direct",
}


def group(kind: str) -> str:
    return kind if kind in ("logits", "mask") else "hidden rows"


def write_all(tensors, storage: str, setting: dict, path: Path) -> tuple[dict, dict]:
    sizes, times = {}, {}
    with h5py.File(path, "w", rdcc_nbytes=0) as f:
        for name, data in tensors.items():
            kind = name.split("/")[0]
            if storage == "bf16" and data.dtype == np.float32:
                data = W.bf16_bits(data)
                assert data is not None, f"{name}: not bf16 values"
            row_bytes = max(1, data[0].nbytes)
            rows = int(max(1, min(W.MAX_CHUNK_ROWS, W.CHUNK_BYTES // row_bytes)))
            chunks = (min(rows, data.shape[0]), *data.shape[1:])
            t0 = time.perf_counter()
            if setting == "direct" and data.dtype.itemsize > 1:
                ds = f.create_dataset(name, shape=data.shape, dtype=data.dtype, chunks=chunks, **W.COMPRESSION)
                for a in range(0, data.shape[0], chunks[0]):
                    part = data[a : a + chunks[0]]
                    part = np.pad(part, [(0, chunks[0] - part.shape[0])] + [(0, 0)] * (data.ndim - 1))
                    ds.id.write_direct_chunk((a,) + (0,) * (data.ndim - 1), C.encode_chunk(part))
            else:
                opts = W.COMPRESSION if setting == "direct" else dict(fletcher32=True, **setting)
                ds = f.create_dataset(name, data=data, chunks=chunks, **opts)
            f.flush()
            dt = time.perf_counter() - t0
            g = group(kind)
            sizes[g] = sizes.get(g, 0) + ds.id.get_storage_size()
            times[g] = times.get(g, 0.0) + dt
    return sizes, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tensors = {}
    with TraceReader(args.trace) as r:
        for kind, layer in r.kinds_present():
            if kind != "token":
                tensors[f"{kind}/{layer}"] = r.read(kind, layer)
        print(f"{args.trace}: dtype {r.provenance['dtype']}, {r.n_positions} positions, {r.n_steps} steps")
    raw = {}
    for name, data in tensors.items():
        raw[group(name.split("/")[0])] = raw.get(group(name.split("/")[0]), 0) + data.nbytes
    print("raw float32 MiB: " + ", ".join(f"{g} {b / 2**20:.1f}" for g, b in sorted(raw.items())))
    print(f"{'storage':<8} {'setting':<14} " + " ".join(f"{g + ' MiB':>16} {'s':>6}" for g in sorted(raw)))
    with tempfile.TemporaryDirectory() as d:
        for storage in ("float32", "bf16"):
            for label, setting in SETTINGS.items():
                best_t: dict = {}
                for _ in range(args.repeats):
                    sizes, times = write_all(tensors, storage, setting, Path(d) / "x.h5")
                    best_t = {g: min(t, best_t.get(g, t)) for g, t in times.items()}
                cells = " ".join(f"{sizes[g] / 2**20:>16.2f} {best_t[g]:>6.2f}" for g in sorted(raw))
                print(f"{storage:<8} {label:<14} {cells}", flush=True)


if __name__ == "__main__":
    main()
