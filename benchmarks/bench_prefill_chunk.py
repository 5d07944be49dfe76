"""Chunked static prefill: replay peak memory and time at a large max_seq, whole vs chunked.

    python benchmarks/bench_prefill_chunk.py            # --max-seqs 2048,8192 --chunk 128 --prompt 16

A tiny random Gemma 4 (the test variant `base`, 8192 positions), a short prompt and 4 new
tokens recorded once; then `trace replay --max-seq S --prefill-chunk C` for C = 0 (one
prefill step over the whole max_seq, as before) and C = --chunk, each in its own process,
which reports its peak RSS (VmHWM). The ratios are measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root

ROOT = repo_root.ROOT

CHILD = """
import json, sys, time
from gemma4_trace.cli import main
t0 = time.perf_counter()
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code or 0
hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]
print('RESULT ' + json.dumps(dict(seconds=time.perf_counter() - t0, peak_mib=int(hwm) / 1024, exit=code)))
"""


def replay(ref, model, out, max_seq, chunk) -> dict:
    args = [
        "replay",
        str(ref),
        "--model",
        str(model),
        "--max-seq",
        str(max_seq),
        "--prefill-chunk",
        str(chunk),
        "-o",
        str(out),
        "--force",
    ]
    p = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=ROOT)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line or json.loads(line[-1][7:])["exit"] != 0:
        raise SystemExit(f"replay failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads(line[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-seqs", default="2048,8192")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=4)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from gemma4_trace.diff import diff_traces
    from gemma4_trace.recorder.record import record_trace
    from tests.support import tiny_models

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model = tiny_models.build(d / "model", "base", max_position_embeddings=8192)
        ref = d / "ref.h5"
        record_trace(model, ref, input_ids=[2] + list(range(3, 3 + a.prompt - 1)), max_new_tokens=a.new_tokens)
        print(
            f"tiny random Gemma 4 (variant base, 7 layers), prompt {a.prompt} tokens, {a.new_tokens} new tokens; "
            f"trace replay in its own process per row"
        )
        print("| max_seq | prefill | replay s | peak RSS MiB | diff vs REF |")
        print("|---|---|---|---|---|")
        for S in [int(x) for x in a.max_seqs.split(",")]:
            res = {}
            for chunk in (0, a.chunk):
                out = d / f"run_{S}_{chunk}.h5"
                r = replay(ref, model, out, S, chunk)
                res[chunk] = r
                match = diff_traces(ref, out).match
                what = f"whole ({S} rows)" if chunk == 0 else f"chunks of {chunk}"
                print(
                    f"| {S} | {what} | {r['seconds']:.2f} | {r['peak_mib']:.0f} | {'match' if match else 'DIVERGES'} |",
                    flush=True,
                )
            w, c = res[0], res[a.chunk]
            print(
                f"| {S} | chunked / whole | {c['seconds'] / w['seconds']:.2f}x | {c['peak_mib'] / w['peak_mib']:.2f}x "
                "| |",
                flush=True,
            )


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
