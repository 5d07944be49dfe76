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

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

from benchmarks.bench_llamacpp_e2b import cli, diff_first_line  # a trace command in a fresh process
from benchmarks.e2b_shaped import bench_setup, build, token_ids

RUNTIMES = ("static", "static-w8", "static-w4g32", "static-w8a8")


def main() -> None:
    a, model = bench_setup(
        __doc__,
        __file__,
        build,
        runtimes=dict(
            default=",".join(RUNTIMES), help="comma-separated, the float one first: the ratios are to it (default: all)"
        ),
    )
    ids = token_ids(a.prompt, model)
    ref = a.work / "ref.h5"
    env = None
    cli(env, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref, "--force")
    rows = []
    for name in a.runtimes.split(","):
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
