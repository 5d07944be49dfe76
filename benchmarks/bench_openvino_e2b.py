"""OpenVINO at E2B width: the IR conversion, NNCF's compression, the replays and what the diff finds.

    python benchmarks/bench_openvino_e2b.py /tmp/openvino-e2b --prompt 32 --new 8

Builds (once, in a child process) the E2B-shaped random checkpoint of benchmarks/e2b_shaped.py
(every E2B text width, 10 layers, vocabulary 16,384, float32), records REF on a seeded random
prompt, then runs each command in a fresh process with the artifact cache in WORK/cache, empty at
the start:

  export    trace export-openvino --runtime MODE: the float IR converted (torch.export + the PyTorch
            frontend), then each compressed IR from it (NNCF) and each folded baseline from that
  replay    trace replay REF --runtime MODE (teacher-forced) on the cached IR: wall time with
            start-up and the CPU plugin's compile, peak RSS of the trace process and of its child
  diff      trace diff REF RUN, and each compressed RUN against its -dq baseline: the first line

The table is printed at the end. On a busy machine every time is a bound, not a speed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_llamacpp_e2b import cli  # noqa: E402  (a trace command in a fresh process, its peak RSS)
from benchmarks.e2b_shaped import build  # noqa: E402

MODES = ("openvino", "openvino-int8", "openvino-int8-dq", "openvino-int4", "openvino-int4-dq")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    model = a.work / "model"
    if a.build_only:
        build(model)
        return
    # built in a child: a process's peak RSS counts what it inherits at fork, so this one stays small
    subprocess.run([sys.executable, __file__, str(a.work), "--build-only"], check=True)
    cache = a.work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "GEMMA4_TRACE_CACHE": str(cache)}
    rng = random.Random(0)
    ids = ",".join(str(rng.randrange(10, 16000)) for _ in range(a.prompt))
    ref = a.work / "ref.h5"
    cli(env, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref, "--force")
    max_seq = a.prompt + a.new
    rows, runs = [], {}
    for mode in MODES:
        out = a.work / mode
        r = cli(env, "export-openvino", "--model", model, "--runtime", mode, "--max-seq", max_seq, "-o", out, "--force")
        rows.append((f"export-openvino --runtime {mode}", r))
    for mode in MODES:
        runs[mode] = a.work / f"{mode}.h5"
        args = ("--model", model, "--runtime", mode, "--max-seq", max_seq, "-o", runs[mode], "--force")
        r = cli(env, "replay", ref, *args)
        rows.append((f"replay --runtime {mode}", r))
    diffs = []
    for name, against in (
        ("openvino", ()),
        ("openvino-int8", ()),
        ("openvino-int8", ("--baseline", runs["openvino-int8-dq"])),
        ("openvino-int4", ("--baseline", runs["openvino-int4-dq"])),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "gemma4_trace", "diff", ref, runs[name], *against],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
        )
        diffs.append((name + (f" --baseline {name}-dq" if against else ""), p.stdout.splitlines()[:1]))
    print(f"\n{'command':46s} {'wall s':>8s} {'peak RSS MiB':>13s} {'child MiB':>10s}")
    for name, r in rows:
        print(f"{name:46s} {r['wall']:8.1f} {r['rss']:13.0f} {r['child_rss']:10.0f}")
    for name, r in rows:
        print(f"  {name}: {r['out'].splitlines()[-1][:240] if r['out'] else ''}")
    for name, lines in diffs:
        print(f"diff REF {name}: {lines[0] if lines else ''}")


if __name__ == "__main__":
    main()
