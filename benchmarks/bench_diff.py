"""Benchmark `trace diff` on two >1 GB synthetic traces against a plain h5py read of both.

    python benchmarks/bench_diff.py [--prefill 4096] [--decode 1024] [--dir /tmp] [--keep] [--baseline] [--full]
        [--rounds 3] [--workers N]

Writes REF (random float32 with the trace writer) and RUN (REF + 1e-6 relative noise, masks
over a static max_seq key axis) in the folder given, then measures in one run:
  (a) reading every dataset of both files with plain h5py (ds[()], warm page cache),
  (b) `trace diff REF RUN` as a subprocess: wall time and the peak memory of it and its worker
      processes together (summed PSS and RSS, sampled every 20 ms),
alternating (a) and (b) --rounds times, and prints the best of each, b/a (target < 1.0) and the
peak memory (target < 500 MB). With --baseline a third
trace BASE (REF + other 1e-6 noise) is written and (a) reads all three files, (b) runs
`trace diff REF RUN --baseline BASE` (the three-way diff: one pass over three traces).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401
from gemma4_trace.traces import LayerInfo, Provenance, TraceHeader, TraceWriter

HIDDEN, PLE, VOCAB, HEADS = 1536, 256, 32768, 8
TYPES = ["sliding_attention"] * 3 + ["full_attention"]
LAYERS = [
    LayerInfo(TYPES[i % 4], 256 if TYPES[i % 4] == "sliding_attention" else 512, HEADS, 1, "owns", i) for i in range(8)
]


def provenance(mode: str) -> Provenance:
    return Provenance(
        creator_version="bench",
        torch_version="-",
        transformers_version="-",
        h5py_version=h5py.__version__,
        dtype="float32",
        device="cpu",
        runtime="bench",
        mode=mode,
        model_name="bench",
        model_config={"hidden_size": HIDDEN, "num_hidden_layers": len(LAYERS), "vocab_size": VOCAB},
        model_config_sha256="0" * 64,
    )


def write_pair(
    ref_path: Path, run_path: Path, prefill: int, decode: int, seed: int = 0, base_path: Path | None = None
) -> None:
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(seed + 1)
    noise_c = np.random.default_rng(seed + 2)
    max_seq = prefill + decode
    ids = rng.integers(0, VOCAB, size=prefill)
    with contextlib.ExitStack() as stack:
        wa = stack.enter_context(TraceWriter(ref_path, force=True))
        wb = stack.enter_context(TraceWriter(run_path, force=True))
        wc = stack.enter_context(TraceWriter(base_path, force=True)) if base_path else None
        writers = [w for w in (wa, wb, wc) if w is not None]
        header = TraceHeader(provenance("reference"), ids, LAYERS, max_new_tokens=decode + 1, eos_token_ids=[1])
        wa.write_header(header)
        for w in writers[1:]:
            w.write_header(header.with_provenance(header.provenance.replace(mode="teacher-forced")))
        start = 0
        for step in range(decode + 1):
            stop = prefill if step == 0 else start + 1
            n = stop - start
            for w in writers:
                w.begin_step(range(start, stop))

            def put(kind, shape, layer=None):
                x = rng.standard_normal((n, *shape), dtype=np.float32)  # noqa: B023 - called in this iteration
                wa.add(kind, x, layer)
                wb.add(kind, x + np.float32(1e-6) * noise.standard_normal(x.shape, dtype=np.float32), layer)
                if wc is not None:
                    wc.add(kind, x + np.float32(1e-6) * noise_c.standard_normal(x.shape, dtype=np.float32), layer)

            put("embeddings", (HIDDEN,))
            put("per_layer_inputs", (len(LAYERS), PLE))
            for kind, d in (
                ("rope_cos_sliding", 256),
                ("rope_sin_sliding", 256),
                ("rope_cos_full", 512),
                ("rope_sin_full", 512),
            ):
                put(kind, (d,))
            q = np.arange(start, stop)[:, None]
            for i, li in enumerate(LAYERS):
                k = np.arange(max_seq)[None, :]
                allowed = (k <= q) & ((k > q - 512) if li.layer_type == "sliding_attention" else True)
                wa.add("mask", allowed[:, :stop], i)
                for w in writers[1:]:
                    w.add("mask", allowed, i)  # static runtime: keys over max_seq
                put("q", (HEADS, li.head_dim), i)
                put("k", (1, li.head_dim), i)
                put("v", (1, li.head_dim), i)
                put("attn_out", (HIDDEN,), i)
                put("layer_out", (HIDDEN,), i)
            put("final_hidden", (HIDDEN,))
            logits = rng.standard_normal(VOCAB, dtype=np.float32)
            tok = np.int64(np.argmax(logits))
            for w in writers:
                w.add("logits", logits)
                w.add("token", tok)
                w.end_step()
            start = stop


def plain_read(paths) -> tuple[float, int]:
    t0 = time.perf_counter()
    total = 0
    for p in paths:
        with h5py.File(p, "r", locking=False) as f:

            def visit(name, obj):
                nonlocal total
                if isinstance(obj, h5py.Dataset):
                    total += obj[()].nbytes

            f.visititems(visit)
    return time.perf_counter() - t0, total


def _tree(pid: int) -> list[int]:
    """pid and its descendants (a diff's worker processes hang under its forkserver)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
    return out


def _memory_kib(pids: list[int]) -> tuple[int, int]:
    """(summed RSS, summed PSS) of the processes in KiB: RSS counts pages they share once per process."""
    rss = pss = 0
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
    return rss, pss


def timed_diff(cmd: list[str]) -> tuple[float, float, float, subprocess.CompletedProcess]:
    """(wall s, peak summed RSS MB, peak summed PSS MB) of `cmd` and all its processes, sampled every 20 ms."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss, pss = _memory_kib(_tree(proc.pid))
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    out, err = proc.communicate()
    return wall, peak_rss / 1024, peak_pss / 1024, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--keep", action="store_true", help="reuse existing files and keep them")
    ap.add_argument("--baseline", action="store_true", help="three traces: trace diff REF RUN --baseline BASE")
    ap.add_argument("--full", action="store_true", help="trace diff --full")
    ap.add_argument("--rounds", type=int, default=3, help="(a) and (b) alternate this many times; the best of each")
    ap.add_argument("--workers", help="GEMMA4_TRACE_DIFF_WORKERS for (b) (default: the diff's own choice)")
    args = ap.parse_args()
    ref, run = Path(args.dir) / "bench_diff_ref.h5", Path(args.dir) / "bench_diff_run.h5"
    base = Path(args.dir) / "bench_diff_base.h5" if args.baseline else None
    files = [ref, run] + ([base] if base else [])
    if not (args.keep and all(p.exists() for p in files)):
        t0 = time.perf_counter()
        write_pair(ref, run, args.prefill, args.decode, base_path=base)
        print(f"wrote {len(files)} traces in {time.perf_counter() - t0:.1f} s")
    sizes = [p.stat().st_size / 1e9 for p in (ref, run)]
    print(
        f"REF {sizes[0]:.2f} GB, RUN {sizes[1]:.2f} GB on disk; {args.prefill} prefill positions + "
        f"{args.decode} decode steps, {len(LAYERS)} layers, hidden {HIDDEN}, q {HEADS}x256/512, vocab {VOCAB}"
    )
    if args.workers is not None:
        os.environ["GEMMA4_TRACE_DIFF_WORKERS"] = args.workers
    trace = shutil.which("trace") or str(Path(sys.executable).with_name("trace"))
    cmd = [trace, "diff", str(ref), str(run)] + (["--baseline", str(base)] if base else [])
    cmd += ["--full"] if args.full else []
    plain_read(files)  # warm the page cache
    reads, diffs = [], []
    for _ in range(args.rounds):  # alternated, so both see the machine in the same state
        reads.append(plain_read(files))
        diffs.append(timed_diff(cmd))
    ta, nbytes = min(reads)
    tb = min(d[0] for d in diffs)
    peak_rss, peak_pss = max(d[1] for d in diffs), max(d[2] for d in diffs)
    p = diffs[-1][3]
    print(p.stdout.strip().splitlines()[0] if p.stdout else p.stderr.strip().splitlines()[0])
    print(f"exit code {p.returncode}")
    print(
        f"(a) plain h5py read of all {len(files)} files: best {ta:.1f} s of "
        f"{', '.join(f'{r[0]:.1f}' for r in reads)} ({nbytes / 1e9:.2f} GB decompressed, {nbytes / 1e6 / ta:.0f} MB/s)"
    )
    print(f"(b) {' '.join(cmd)}: best {tb:.1f} s of {', '.join(f'{d[0]:.1f}' for d in diffs)}")
    print(
        f"b/a = {tb / ta:.2f} (target < 1.0); peak memory of trace diff and its workers: "
        f"{peak_pss:.0f} MB PSS, {peak_rss:.0f} MB RSS summed (target < 500)"
    )
    if not args.keep:
        for q in files:
            os.unlink(q)


if __name__ == "__main__":
    main()
