"""Memory of long runs: peak RSS of `trace record`, `trace replay` and `trace diff` as the
number of decode steps grows (it should stay flat).

    python benchmarks/bench_long_run.py [--steps 250,1000,3000]

Uses a tiny random Gemma 4 (the test variant "base", window 4) with a long position
table; each command runs in its own process, which reports its own peak RSS.
"""

from __future__ import annotations

import argparse
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

RUN_CLI = (
    "import resource, runpy, sys\n"
    "sys.argv = ['trace'] + sys.argv[1:]\n"
    "try:\n    runpy.run_module('gemma4_trace', run_name='__main__')\n"
    "except SystemExit as e:\n    code = e.code\n"
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
)


def cli(*args) -> tuple[float, float, int]:
    """(seconds, peak RSS MiB, exit code) of one `trace` command in a fresh process."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", RUN_CLI, *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    dt = time.perf_counter() - t0
    rss = [int(l.split()[1]) for l in p.stderr.splitlines() if l.startswith("PEAK_RSS_KB")]
    return dt, rss[0] / 1024 if rss else float("nan"), p.returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="250,1000,3000")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model = d / "model"
        # built in a child: this process stays small, and a child's peak RSS starts from its parent's
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from tests.support import tiny_models; "
                "tiny_models.build(sys.argv[1], 'base', max_position_embeddings=16384)",
                str(model),
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        print(
            f"{'decode steps':>12} {'record s':>9} {'record MiB':>10} {'replay s':>9} {'replay MiB':>10} "
            f"{'diff s':>7} {'diff MiB':>8} {'trace MiB':>9}"
        )
        for n in [int(x) for x in args.steps.split(",")]:
            ref, run = d / f"ref{n}.h5", d / f"run{n}.h5"
            tr, mr, _ = cli("record", "--model", model, "--input-ids", "2,5,9,13", "--max-new-tokens", n, "-o", ref)
            tp, mp, _ = cli("replay", ref, "--model", model, "-o", run)
            td, md, code = cli("diff", ref, run)
            size = ref.stat().st_size / 2**20
            print(
                f"{n:>12} {tr:>9.1f} {mr:>10.0f} {tp:>9.1f} {mp:>10.0f} {td:>7.1f} {md:>8.0f} {size:>9.1f}"
                + ("" if code == 0 else f"  (diff exit {code})")
            )


if __name__ == "__main__":
    main()
