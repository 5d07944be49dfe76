"""OpenVINO and MLX at E2B width: conversion / loading, quantization, the replays and what the diff finds.

    python benchmarks/bench_desktop_e2b.py openvino /tmp/desktop-e2b --prompt 32 --new 8
    python benchmarks/bench_desktop_e2b.py mlx /tmp/desktop-e2b --prompt 32 --new 8

Builds (once, in a child process) the E2B-shaped random checkpoint of benchmarks/e2b_shaped.py
(every E2B text width, 10 layers, vocabulary 16,384, float32), records REF on a seeded random
prompt, then runs each command in a fresh process with the artifact cache in WORK/cache, empty at
the start:

  export    (openvino) trace export-openvino --runtime MODE: the float IR converted (torch.export +
            the PyTorch frontend), then each compressed IR from it (NNCF), each folded baseline from that
  replay    trace replay REF --runtime MODE (teacher-forced): wall time with start-up (openvino: on
            the cached IR, with the CPU plugin's compile; mlx: with mlx-lm's load and quantization),
            peak RSS of the trace process and of its child (the engine)
  diff      trace diff REF RUN, and each quantized RUN against its -dq baseline: the first line

The table is printed at the end. On a busy machine every time is a bound, not a speed.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_llamacpp_e2b import cli, diff_first_line, print_table  # noqa: E402  (a trace command in a fresh process)
from benchmarks.e2b_shaped import bench_setup, build  # noqa: E402

FAMILIES = {
    "openvino": ("openvino", "openvino-int8", "openvino-int8-dq", "openvino-int4", "openvino-int4-dq"),
    "mlx": ("mlx", "mlx-q8", "mlx-q8-dq", "mlx-q4", "mlx-q4-dq"),
}


def main() -> None:
    a, model = bench_setup(__doc__, __file__, build, ("family", dict(choices=FAMILIES)))
    cache = a.work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "GEMMA4_TRACE_CACHE": str(cache)}
    rng = random.Random(0)
    ids = ",".join(str(rng.randrange(10, 16000)) for _ in range(a.prompt))
    ref = a.work / "ref.h5"
    cli(env, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref, "--force")
    max_seq = a.prompt + a.new
    rows, runs, modes = [], {}, FAMILIES[a.family]
    for mode in modes if a.family == "openvino" else ():
        out = a.work / "ir"  # one folder, replaced each time: the IR of E2B width is 4.4 GiB (two graphs)
        r = cli(env, "export-openvino", "--model", model, "--runtime", mode, "--max-seq", max_seq, "-o", out, "--force")
        rows.append((f"export-openvino --runtime {mode}", r))
    for mode in modes:
        runs[mode] = a.work / f"{mode}.h5"
        args = ("--model", model, "--runtime", mode, "--max-seq", max_seq, "-o", runs[mode], "--force")
        r = cli(env, "replay", ref, *args)
        rows.append((f"replay --runtime {mode}", r))
    float_, q8, _, q4, _ = modes
    diffs = [
        (name + (f" --baseline {name}-dq" if more else ""), diff_first_line(env, ref, runs[name], *more))
        for name, more in (
            (float_, ()),
            (q8, ()),
            (q4, ()),
            (q8, ("--baseline", runs[q8 + "-dq"])),
            (q4, ("--baseline", runs[q4 + "-dq"])),
        )
    ]
    print_table(rows, diffs)


if __name__ == "__main__":
    main()
