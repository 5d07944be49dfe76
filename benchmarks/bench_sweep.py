"""`trace sweep` throughput: prompts per minute with --workers 1, --workers 2 and a local Ray cluster.

    python benchmarks/bench_sweep.py [--prompts 8] [--max-new-tokens 8] [--e2b /tmp/e2bs/model --e2b-prompts 2]

Each configuration is one `trace sweep` in its own process over the first --prompts prompts of the
shipped set (@embedded), with an empty artifact cache (so REF is recorded, not read back) and an
empty output folder; its wall time includes starting Python, loading the model once per worker (and
Ray's start: `ray.init(num_cpus=2)` in that process, then `--ray auto`). With --e2b, the same with
each of the three over --e2b-prompts token-id prompts on that checkpoint, then the projection of a
1,000-prompt E2B-size sweep over K machines (one prompt at a time per machine, the measured seconds
per prompt; the model load paid once per machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
RAY_DRIVER = (
    "import sys, ray; ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024, "
    "log_to_driver=False)\nfrom gemma4_trace.cli import main\nmain(sys.argv[1:])"
)


def subset(folder: Path, n: int) -> Path:
    from gemma4_trace.hf.model import embedded_model_dir

    lines = (embedded_model_dir() / "sweep_prompts.jsonl").read_text().splitlines()
    step = max(1, len(lines) // n)
    out = []
    for line in lines[::step][:n]:
        d = json.loads(line)
        if "image" in d:  # a prompts file reads images inside its own folder only
            shutil.copyfile(embedded_model_dir() / d["image"], folder / d["image"])
        out.append(json.dumps(d))
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path


def run(label: str, args: list[str], work: Path, ray: bool = False) -> float:
    env = {**os.environ, "GEMMA4_TRACE_CACHE": str(work / f"cache-{label}")}  # PYTHONPATH: repo_root put the root there
    cmd = [sys.executable, "-c", RAY_DRIVER] if ray else [str(Path(sys.executable).parent / "trace")]
    t0 = time.perf_counter()
    p = subprocess.run(
        [*cmd, "sweep", *args, "-o", str(work / f"out-{label}")], env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise SystemExit(f"{label}: exit {p.returncode}: {p.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--runtime", default="static-w8")
    ap.add_argument("--e2b", default=None, help="an E2B-shaped checkpoint folder (benchmarks/make_e2b_random.py)")
    ap.add_argument("--e2b-prompts", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated labels not to run: w1,w2,ray")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        work = Path(tmp)
        prompts = subset(work, a.prompts)
        common = [str(prompts), "--runtime", a.runtime, "--max-new-tokens", str(a.max_new_tokens)]
        print(f"embedded model, {a.prompts} prompts of the shipped set, {a.max_new_tokens} new tokens, {a.runtime}")
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
        for label, extra, ray in (
            ("w1", ["--workers", "1"], False),
            ("w2", ["--workers", "2"], False),
            ("ray", ["--ray", "auto"], True),
        ):
            if label in skip:
                continue
            s = run(label, common + extra, work, ray)
            print(
                f"  {label:<4} {s:7.1f} s  {60 * a.prompts / s:6.1f} prompts/min "
                f"(load average {os.getloadavg()[0]:.1f})"
            )
        if a.e2b:
            ids = work / "e2b.jsonl"
            ids.write_text(
                "".join(
                    json.dumps({"input_ids": [2] + [100 + 7 * i + j for j in range(31)]}) + "\n"
                    for i in range(a.e2b_prompts)
                )
            )
            e2b = [str(ids), "--model", a.e2b, "--runtime", "static", "--max-new-tokens", "4"]
            print(f"E2B-shaped {a.e2b}: {a.e2b_prompts} prompts of 32 token ids, 4 new tokens, static")
            one = None
            for label, extra, ray in (
                ("e2b-w1", ["--workers", "1"], False),
                ("e2b-w2", ["--workers", "2"], False),
                ("e2b-ray", ["--ray", "auto"], True),
            ):
                if label.removeprefix("e2b-") in skip:
                    continue
                s = run(label, e2b + extra, work, ray)
                one = s if label == "e2b-w1" else one
                print(
                    f"  {label:<8} {s:7.1f} s  {60 * a.e2b_prompts / s:6.2f} prompts/min "
                    f"(load average {os.getloadavg()[0]:.1f})"
                )
            if one is None:
                return
            per = one / a.e2b_prompts  # model load included: an upper bound per prompt
            print("projection, 1,000 E2B-size prompts, one prompt at a time per machine like this one:")
            for k in (1, 4, 16, 64):
                print(f"  K={k:<3} {1000 * per / k / 3600:6.2f} h")


if __name__ == "__main__":
    main()
