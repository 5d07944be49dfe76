"""`trace record` with each writer change switched on one at a time, side by side with generate().

    python benchmarks/bench_writer.py [--prompt-len 300] [--steps 16] [--repeats 2] [--model-dir DIR]

On the E2B-shaped model (benchmarks/e2b_shaped.py) in bfloat16, loaded once: plain generate(),
then `trace record` with the trace writer as it was (writes on the model's thread, bf16 values
stored as float32), with the writer thread, with the writer thread and bf16 values in 16
bits, and with bf16 rows handed over as 16-bit patterns, and with whole chunks encoded by the
writer (per byte plane: stored or ISA-L deflate); the earlier paths are benchmarks/writer_variants.py's
(production code keeps only the current one). Each timing is the median of --repeats runs, the
variants alternating; the trace size is printed beside each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

import torch

from benchmarks import e2b_shaped
from benchmarks.bench_record import plain_generate
from benchmarks.writer_variants import before
from gemma4_trace.hf.model import load_model
from gemma4_trace.recorder.record import PromptInputs, record_loaded

VARIANTS = {  # name: writer_variants.before's (threaded, bits, hand_over, direct)
    "record (before: writes on the model thread, float32)": (False, False, False, False),
    "record + writer thread": (True, False, False, False),
    "record + writer thread + bf16 in 16 bits": (True, True, False, False),
    "  + bf16 handed over as 16 bits (no upcast)": (True, True, True, False),
    "  + whole chunks encoded by the writer (per plane)": (True, True, True, True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shared-kv-prefill", default="all")
    ap.add_argument(
        "--model-dir",
        help="where the E2B-shaped checkpoint is built once (default: a temporary folder); a folder that holds a "
        "checkpoint already is used as it is (hf/tiny_model: a quick check)",
    )
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        lm = load_model(e2b_shaped.build(args.model_dir or tmp / "e2b"), dtype="bfloat16")
        ids = e2b_shaped.random_prompt(args.prompt_len, lm.text_config.vocab_size)
        plain_generate(lm, ids, 2)  # warm up
        times: dict = {"generate()": []}
        sizes = {}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plain_generate(lm, ids, args.steps)
            times["generate()"].append(time.perf_counter() - t0)
            for name, (threaded, bits, hand_over, direct) in VARIANTS.items():
                out = tmp / "t.h5"
                with before(threaded, bits, hand_over, direct):
                    t0 = time.perf_counter()
                    record_loaded(
                        lm,
                        PromptInputs(ids),
                        out,
                        max_new_tokens=args.steps,
                        force=True,
                        shared_kv_prefill=args.shared_kv_prefill,
                    )
                    times.setdefault(name, []).append(time.perf_counter() - t0)
                sizes[name] = out.stat().st_size
        g = statistics.median(times["generate()"])
        print(
            f"{'E2B-shaped' if args.model_dir is None else args.model_dir} bf16, prompt {args.prompt_len}, "
            f"{args.steps} new tokens, --shared-kv-prefill "
            f"{args.shared_kv_prefill}, median of {args.repeats}; load average now {os.getloadavg()[0]:.1f}"
        )
        m = min(times["generate()"])
        print("  (the fastest run of each is the figure least disturbed by other work on a shared machine)")
        for name, ts in times.items():
            t = statistics.median(ts)
            size = f"  trace {sizes[name] / 2**20:.1f} MiB" if name in sizes else ""
            print(
                f"  {name:<55} median {t:7.2f} s {t / g:5.2f}x   fastest {min(ts):7.2f} s {min(ts) / m:5.2f}x"
                f"{size}  (runs: {', '.join(f'{x:.2f}' for x in ts)})"
            )


if __name__ == "__main__":
    main()
