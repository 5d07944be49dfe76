"""What streaming a capture's tensors from an engine's child process costs, one message a tensor
against batches (replayer/child.py, FLUSH_BYTES), at E2B width:

    python benchmarks/bench_child_stream.py /tmp/capture-e2b --runtimes llama.cpp:Q4_K_M,llama.cpp:Q4_K_M:layer_out

On bench_capture.py's E2B-shaped model, REF and artifact cache (WORK; runtime names as there),
alternating `--repeats` times, in this one process, between
  alone     the runtime with nothing captured (tokens and logits only)
  each      `trace replay` (replay_loaded, the trace written), the child sending every tensor as
            a message of its own (GEMMA4_TRACE_CHILD_FLUSH_BYTES=0): how the child streamed before
  batched   the same replay, the child sending a step's tensors in one message (the default)
and prints each one's best ms per prompt token and per decode step, and the ratios to alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_capture import alone, captured, context, parse, prompt, variants  # noqa: E402
from benchmarks.e2b_shaped import bench_setup, build  # noqa: E402

HOW = {"alone": None, "each": "0", "batched": None}


def measure(name: str, loaded, ref, ref_path, max_seq: int, repeats: int) -> dict:
    """{how: (best s a prompt token, best s a decode step)}."""
    from gemma4_trace.replayer.api import close_runtime
    from gemma4_trace.replayer.child import FLUSH_ENV
    from gemma4_trace.replayer.core import make_runtime

    choice, kinds = parse(name)
    made = variants(choice, kinds)
    best = {how: (float("inf"),) * 2 for how in HOW}
    for r in range(repeats + 1):  # the first round warms up, untimed
        for how, knob in HOW.items():
            os.environ.pop(FLUSH_ENV, None)
            if knob is not None:
                os.environ[FLUSH_ENV] = knob  # the child inherits it
            rt = make_runtime(made["alone" if how == "alone" else "capture"], loaded, max_seq)
            if how == "alone":
                try:
                    p, d = alone(rt, ref, max_seq)
                finally:
                    close_runtime(rt)
            else:
                p, d, _ = captured(loaded, ref, ref_path, rt, max_seq, kinds)
            if r:
                per = (p / len(ref.prompt_ids), sum(d) / max(len(d), 1))
                best[how] = tuple(min(x, y) for x, y in zip(best[how], per))
    os.environ.pop(FLUSH_ENV, None)
    return best


def main() -> None:
    a, model = bench_setup(
        __doc__, __file__, build, repeats=dict(type=int, default=3), runtimes=dict(default="llama.cpp:Q4_K_M")
    )
    os.environ.setdefault("GEMMA4_TRACE_CACHE", str(a.work / "cache"))
    loaded, ref, ref_path, max_seq = context(a.work, model, prompt(a.prompt), a.new, False)  # bench_capture's REF
    head = ("prompt ms/token", "decode ms/step")
    print(f"\n{'runtime':28s} " + " ".join(f"{h + ': alone, each, batched':>40s}" for h in head))
    for name in a.runtimes.split(","):
        best = measure(name, loaded, ref, ref_path, max_seq, a.repeats)
        cols = []
        for i in range(2):
            base = best["alone"][i]
            cols.append(
                f"{1e3 * base:8.2f} {1e3 * best['each'][i]:8.2f} ({best['each'][i] / base:.2f}x)"
                f" {1e3 * best['batched'][i]:8.2f} ({best['batched'][i] / base:.2f}x)"
            )
        print(f"{name:28s} {cols[0]:>40s} {cols[1]:>40s}", flush=True)


if __name__ == "__main__":
    main()
