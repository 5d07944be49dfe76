"""OpenVINO, MLX and keras-hub at E2B width: conversion / loading, quantization, the replays and what the
diff finds; and the user's own file (`--onnx`, `--ir`, `--pte`, `--mlx-model`) at E2B width.

    python benchmarks/bench_desktop_e2b.py openvino /tmp/desktop-e2b --prompt 32 --new 8
    python benchmarks/bench_desktop_e2b.py mlx /tmp/desktop-e2b --prompt 32 --new 8
    python benchmarks/bench_desktop_e2b.py keras-hub /tmp/desktop-e2b --prompt 32 --new 8
    python benchmarks/bench_desktop_e2b.py own-file /tmp/desktop-e2b --prompt 32 --new 8

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

own-file: each mode's file written outside the replay (onnx, openvino, executorch: `trace export-onnx`,
`export-openvino`, `export-pte` into WORK/own-MODE; mlx-q4: an mlx-lm folder quantized to 4 bits by
mlx-lm; mobius: mobius-onnx's model.onnx of the checkpoint, as a user would build it; mobius-ir: that
graph converted by `openvino.convert_model`), then `trace replay REF --onnx / --ir / --pte /
--mlx-model FILE` (the user-file replay: its checks, its copy of
the file where it makes one, the run), beside `--runtime MODE` where one exists: how many of
the two traces' datasets are bit-identical, and each user-file run's diff against REF.

The table is printed at the end. On a busy machine every time is a bound, not a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

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
    "own-file": ("onnx", "openvino", "executorch", "mlx-q4", "mobius", "mobius-ir"),
}
# own-file: mode -> (how the file is written, the replay option, the file in the folder, the built-in runtime)
OWN = {
    "onnx": ("export-onnx", "--onnx", "", "onnx"),
    "openvino": ("export-openvino", "--ir", "", "openvino"),
    "executorch": ("export-pte", "--pte", "", "executorch"),
    "mlx-q4": ("mlx-lm's quantize_model", "--mlx-model", "", "mlx-q4"),
    "mobius": ("mobius-onnx's build", "--onnx", "model.onnx", "mobius"),
    "mobius-ir": ("openvino.convert_model", "--ir", "model.xml", None),
}
# the files the tool does not export, written as a user would: mobius-onnx's build (no promoted outputs),
# openvino's conversion of that graph, and an mlx-lm folder quantized to 4 bits by mlx-lm's quantize_model
WRITE = {
    "mlx-q4": (
        "from gemma4_trace.replayer.runtimes.mlx_folder import save_conversion\n"
        "save_conversion(ARGS[0], 4, ARGS[1])\n"
        "print('wrote an mlx-lm folder, 4 bits')\n"
    ),
    "mobius": (
        "from gemma4_trace.replayer.runtimes.mobius import build\n"
        "build(ARGS[0], Path(ARGS[1]), kinds=())\n"
        "print('wrote model.onnx')\n"
    ),
    "mobius-ir": (
        "import openvino as ov\n"
        "ov.save_model(ov.convert_model(ARGS[0] + '/model.onnx'), ARGS[1] + '/model.xml', compress_to_fp16=False)\n"
        "print('wrote model.xml, model.bin')\n"
    ),
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
    if a.family == "own-file":
        return own_files(env, model, ref, modes, a.work, max_seq)
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


def own_files(env, model, ref, modes, work: Path, max_seq: int) -> None:
    """The own-file family (module docstring): write each mode's file, replay it as the user's, and
    compare its trace with the built-in runtime's dataset by dataset."""
    rows, diffs, same, worst = [], [], [], []
    for mode in modes:
        how, option, name, builtin = OWN[mode]
        folder = work / f"own-{mode}"
        if how.startswith("export-"):
            r = cli(env, how, "--model", model, "--max-seq", max_seq, "-o", folder, "--force")
        else:  # mobius-ir converts the mobius mode's graph (written first when absent)
            source = work / "own-mobius"
            if mode == "mobius-ir" and not (source / "model.onnx").exists():
                python_child(env, WRITE["mobius"], model, source)
            folder.mkdir(exist_ok=True)
            r = python_child(env, WRITE[mode], source if mode == "mobius-ir" else model, folder)
        rows.append((f"{how} ({mode})", r))
        mine = work / f"own-{mode}.h5"
        target = folder / name if name else folder
        args = ("--model", model, option, target, "--max-seq", max_seq, "-o", mine, "--force")
        rows.append((f"replay {option} own-{mode}", cli(env, "replay", ref, *args)))
        diffs.append((f"{option} own-{mode}", diff_first_line(env, ref, mine)))
        worst.append((f"{option} own-{mode}", worst_over_tolerance(env, ref, mine)))
        if builtin:
            theirs = work / f"{builtin}.h5"
            r = cli(
                env,
                "replay",
                ref,
                "--model",
                model,
                "--runtime",
                builtin,
                "--max-seq",
                max_seq,
                "-o",
                theirs,
                "--force",
            )
            rows.append((f"replay --runtime {builtin}", r))
            same.append((f"{option} own-{mode}", builtin, *identical_datasets(theirs, mine)))
    print_table(rows, diffs)
    for own, builtin, equal, total, differ in same:
        note = f" (differ: {', '.join(differ[:6])})" if differ else ""
        print(f"own file == built-in, {own} vs --runtime {builtin}: {equal}/{total} datasets bit-identical{note}")
    for own, line in worst:
        print(f"worst error / tolerance, REF {own}: {line}")


def python_child(env, code: str, *args) -> dict:
    """`code` in a fresh python (ARGS its arguments, Path imported), timed like cli(): wall seconds, peak RSS."""
    prelude = "import resource, sys\nfrom pathlib import Path\nARGS = sys.argv[1:]\n"
    report = "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 0, file=sys.stderr)\n"
    t0 = time.perf_counter()
    p = subprocess.run(
        [PY, "-c", prelude + code + report, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{code.splitlines()[0]} failed (exit {p.returncode}):\n{p.stdout}{p.stderr[-2000:]}")
    kb = [int(ln.split()[1]) for ln in p.stderr.splitlines() if ln.startswith("PEAK_RSS_KB")]
    return dict(wall=wall, out=p.stdout.strip(), rss=kb[-1] / 1024 if kb else 0.0, child_rss=0.0)


def identical_datasets(a: Path, b: Path) -> tuple[int, int, list[str]]:
    """How many of two traces' datasets hold the same bytes (dtype and shape too), of how many (the
    union of their names), and the names that differ or are in one only."""
    import h5py
    import numpy as np

    def datasets(path):
        out = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
        return out

    x, y = datasets(a), datasets(b)
    names = sorted(x.keys() | y.keys())
    differ = [
        n for n in names if n not in x or n not in y or x[n].dtype != y[n].dtype or not np.array_equal(x[n], y[n])
    ]
    return len(names) - len(differ), len(names), differ


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
