"""The quantized static runtimes against the float one at E2B width: wall time and peak RSS.

    python benchmarks/bench_quant_replay.py /tmp/quant-e2b --prompt 32 --new 8

Builds (once, in a child process) the E2B-shaped random checkpoint of benchmarks/e2b_shaped.py
(every E2B text width, 10 layers, vocabulary 16,384, float32), records REF on a seeded random
prompt, then runs `trace replay REF --runtime R` for static, static-w8, static-w4g32 and
static-w8a8, each in a fresh process, side by side in this one run, and prints each one's wall
time (with the model's load) and peak RSS as ratios to the float replay's. The quantized
runtimes hold every weight once (replayer/quant.py: QuantizedWeight), so the targets are
peak RSS <= 1.10x and time <= 1.5x the float replay's.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_llamacpp_e2b import cli, diff_first_line  # noqa: E402  (a trace command in a fresh process)
from benchmarks.e2b_shaped import bench_setup, build  # noqa: E402

RUNTIMES = ("static", "static-w8", "static-w4g32", "static-w8a8")


def main() -> None:
    a, model = bench_setup(__doc__, __file__, build)
    rng = random.Random(0)
    ids = ",".join(str(rng.randrange(10, 16000)) for _ in range(a.prompt))
    ref = a.work / "ref.h5"
    env = None
    cli(env, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref, "--force")
    rows = []
    for name in RUNTIMES:
        run = a.work / f"{name}.h5"
        rows.append((name, cli(env, "replay", ref, "--model", model, "--runtime", name, "-o", run, "--force")))
    base = rows[0][1]
    print(f"\n{'trace replay --runtime':24s} {'wall s':>7s} {'x float':>8s} {'peak RSS MiB':>13s} {'x float':>8s}")
    for name, r in rows:
        t, m = r["wall"] / base["wall"], r["rss"] / base["rss"]
        print(f"{name:24s} {r['wall']:7.1f} {t:8.2f} {r['rss']:13.0f} {m:8.2f}")
    for name, _ in rows:
        print(f"diff REF {name}: {diff_first_line(env, ref, a.work / f'{name}.h5')}")


if __name__ == "__main__":
    main()
