"""cProfile of `trace record` (record_loaded) on the embedded tiny model or the E2B-shaped model.

    python benchmarks/profile_record.py [--model tiny|e2b] [--dtype bfloat16] [--steps 32]
        [--prompt-len 600] [--shared-kv-prefill all|last] [--top 25] [--replay]

Prints the wall time of plain generate() and of the recording, then the top functions by
cumulative and by own time, so the share spent in the model, in the hooks and in the trace
writer can be read off. --replay profiles `trace replay` of the recorded trace instead.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
from gemma4_trace.hf.model import DEMO_PROMPT, load_model
from gemma4_trace.recorder.record import PromptInputs, prepare_inputs, record_loaded


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("tiny", "e2b"), default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--shared-kv-prefill", default="all")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument(
        "--model-dir",
        help="where the E2B-shaped checkpoint is built once (default: a temporary folder); a folder that holds a "
        "checkpoint already is used as it is (hf/tiny_model: a quick check)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = None if args.model == "tiny" else e2b_shaped.build(args.model_dir or tmp / "e2b")
        lm = load_model(model_dir, dtype=args.dtype)
        if args.model == "tiny":
            ids = prepare_inputs(lm, DEMO_PROMPT, None, [], chat=True).input_ids
        else:
            ids = e2b_shaped.random_prompt(args.prompt_len, lm.text_config.vocab_size)
        plain_generate(lm, ids, 2)  # warm up
        t0 = time.perf_counter()
        plain_generate(lm, ids, args.steps)
        t_gen = time.perf_counter() - t0
        out = tmp / "t.h5"
        kw = dict(max_new_tokens=args.steps, shared_kv_prefill=args.shared_kv_prefill)
        prof = cProfile.Profile()
        if args.replay:
            from gemma4_trace.replayer.replay import replay_trace  # noqa: PLC0415

            record_loaded(lm, PromptInputs(ids), out, **kw)
            target = lambda: replay_trace(out, tmp / "r.h5", model_dir=model_dir)  # noqa: E731
        else:
            target = lambda: record_loaded(lm, PromptInputs(ids), out, **kw)  # noqa: E731
        t0 = time.perf_counter()
        prof.runcall(target)
        t_rec = time.perf_counter() - t0
        size = out.stat().st_size
        print(
            f"{args.model} {args.dtype}: prompt {len(ids)}, {args.steps} new tokens; generate() {t_gen:.2f} s, "
            f"{'replay' if args.replay else 'record'} {t_rec:.2f} s under cProfile; trace {size / 2**20:.1f} MiB"
        )
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            print(s.getvalue())
        s = io.StringIO()  # the tool's own share: hooks, hand-over, writer, h5py
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(r"recorder/|replayer/|traces/|h5py", args.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
