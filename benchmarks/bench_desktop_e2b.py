"""OpenVINO, MLX and keras-hub at E2B width: conversion / loading, quantization, the replays and what the diff finds.

    python benchmarks/bench_desktop_e2b.py openvino /tmp/desktop-e2b --prompt 32 --new 8
    python benchmarks/bench_desktop_e2b.py mlx /tmp/desktop-e2b --prompt 32 --new 8
    python benchmarks/bench_desktop_e2b.py keras-hub /tmp/desktop-e2b --prompt 32 --new 8

Builds (once, in a child process) the E2B-shaped random checkpoint of benchmarks/e2b_shaped.py
(every E2B text width, 10 layers, vocabulary 16,384, float32), records REF on a seeded random
prompt, then runs each command in a fresh process with the artifact cache in WORK/cache, empty at
the start (--cache DIR: that cache as it is, so an export found there is a cache hit):

  export    (openvino) trace export-openvino --runtime MODE: the float IR converted (torch.export +
            the PyTorch frontend), then each compressed IR from it (NNCF), each folded baseline from that
  replay    trace replay REF --runtime MODE (teacher-forced): wall time with start-up (openvino: on
            the cached IR, with the CPU plugin's compile; mlx: with mlx-lm's load and quantization;
            keras-hub: with keras-hub's conversion of the checkpoint, or its cached preset, and JAX's
            first-use compilation), peak RSS of the trace process and of its child (the engine)
  diff      trace diff REF RUN, and each quantized RUN against its -dq baseline: the first line, and
            for a float RUN the worst error over its tolerance of each kind (--json; the headroom a
            measured profile keeps is 1 over the worst)

The table is printed at the end. On a busy machine every time is a bound, not a speed.
"""

from __future__ import annotations

import json
import subprocess

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

from benchmarks.bench_llamacpp_e2b import PY, ROOT, cli, diff_first_line, print_table  # a trace command, a process
from benchmarks.e2b_shaped import CACHE_OPTION, artifact_env, bench_setup, build, token_ids
from gemma4_trace.replayer.node_data import kind_values

FAMILIES = {
    "openvino": ("openvino", "openvino-int8", "openvino-int8-dq", "openvino-int4", "openvino-int4-dq"),
    "mlx": ("mlx", "mlx-q8", "mlx-q8-dq", "mlx-q4", "mlx-q4-dq"),
    "keras-hub": ("keras-hub",),
}


def main() -> None:
    a, model = bench_setup(
        __doc__,
        __file__,
        build,
        ("family", dict(choices=FAMILIES)),
        modes=dict(help="comma-separated, some of the family's runtimes (default: all five)"),
        cache=CACHE_OPTION,
    )
    modes = FAMILIES[a.family] if a.modes is None else tuple(a.modes.split(","))
    if not set(modes) <= set(FAMILIES[a.family]):
        raise SystemExit(f"--modes: {a.family}'s runtimes are {', '.join(FAMILIES[a.family])}")
    env = artifact_env(a.cache, a.work / "cache")
    ids = token_ids(a.prompt, model)
    ref = a.work / "ref.h5"
    cli(env, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref, "--force")
    max_seq = a.prompt + a.new
    rows, runs = [], {}
    for mode in modes if a.family == "openvino" else ():
        out = a.work / "ir"  # one folder, replaced each time: the IR of E2B width is 4.4 GiB (two graphs)
        r = cli(env, "export-openvino", "--model", model, "--runtime", mode, "--max-seq", max_seq, "-o", out, "--force")
        rows.append((f"export-openvino --runtime {mode}", r))
    for mode in modes:
        runs[mode] = a.work / f"{mode}.h5"
        args = ("--model", model, "--runtime", mode, "--max-seq", max_seq, "-o", runs[mode], "--force")
        r = cli(env, "replay", ref, *args)
        rows.append((f"replay --runtime {mode}", r))
    # each run against REF (not the -dq baselines), then each quantized run against its -dq baseline
    pairs = [(name, ()) for name in modes if not name.endswith("-dq")]
    pairs += [(name, ("--baseline", runs[name + "-dq"])) for name, _ in pairs if name + "-dq" in runs]
    diffs = [
        (name + (f" --baseline {name}-dq" if more else ""), diff_first_line(env, ref, runs[name], *more))
        for name, more in pairs
    ]
    print_table(rows, diffs)
    for name in modes:
        if name in FAMILIES[a.family][:1]:  # the family's float runtime
            print(f"worst error / tolerance, REF {name}: {worst_over_tolerance(env, ref, runs[name])}")


def worst_over_tolerance(env, ref, run) -> str:
    """Per compared kind, the worst error over its tolerance (the overlay's values, replayer/node_data.py
    kind_values, of `trace diff --json --full`: every row), worst first."""
    cmd = [PY, "-m", "gemma4_trace", "diff", ref, run, "--json", "--full"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    worst: dict[str, float] = {}
    for (kind, _), value in kind_values(json.loads(p.stdout)).items():
        worst[kind] = max(worst.get(kind, 0.0), value)
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items(), key=lambda kv: -kv[1])) or "(none compared)"


if __name__ == "__main__":
    main()
