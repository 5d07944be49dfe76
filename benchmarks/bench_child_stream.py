"""What handing a capture's tensors out of an engine's child process costs (replayer/child.py), at
E2B width:

    python benchmarks/bench_child_stream.py /tmp/capture-e2b --runtimes llama.cpp:Q4_K_M,openvino

On bench_capture.py's E2B-shaped model, REF and artifact cache (WORK; runtime names as there),
alternating `--repeats` times, in this one process, between
  alone     the runtime with nothing captured (tokens and logits only; the default wire)
  each      `trace replay` (replay_loaded, the trace written), the child sending every tensor as
            a message of its own with the arrays inside the pickles over 64 KiB pipes
            (GEMMA4_TRACE_CHILD_FLUSH_BYTES=0, GEMMA4_TRACE_CHILD_WIRE=inband): the first protocol
  in band   the same replay, a step's tensors in one message, arrays inside the pickle, 64 KiB
            pipes (GEMMA4_TRACE_CHILD_WIRE=inband): the second
  batched   the same, arrays written after the pickle as they lie, pipes widened (the default)
and prints each one's best ms per prompt token and per decode step, and the ratios to alone.
"""

from __future__ import annotations

import os

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

from benchmarks.bench_capture import alone, captured, context, parse, variants
from benchmarks.e2b_shaped import bench_setup, build, token_ids

HOW = {"alone": {}, "each": {"FLUSH": "0", "WIRE": "inband"}, "in band": {"WIRE": "inband"}, "batched": {}}


def measure(name: str, loaded, ref, ref_path, max_seq: int, repeats: int) -> dict:
    """{how: (best s a prompt token, best s a decode step)}."""
    from gemma4_trace.replayer.api import close_runtime
    from gemma4_trace.replayer.child import FLUSH_ENV, WIRE_ENV
    from gemma4_trace.replayer.core import make_runtime

    choice, kinds = parse(name)
    made = variants(choice, kinds)
    best = {how: (float("inf"),) * 2 for how in HOW}
    for r in range(repeats + 1):  # the first round warms up, untimed
        for how, knobs in HOW.items():
            for knob, env in (("FLUSH", FLUSH_ENV), ("WIRE", WIRE_ENV)):
                os.environ.pop(env, None)
                if knob in knobs:
                    os.environ[env] = knobs[knob]  # the child reads it too
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
    os.environ.pop(WIRE_ENV, None)
    return best


def main() -> None:
    a, model = bench_setup(
        __doc__, __file__, build, repeats=dict(type=int, default=3), runtimes=dict(default="llama.cpp:Q4_K_M")
    )
    os.environ.setdefault("GEMMA4_TRACE_CACHE", str(a.work / "cache"))
    ids = token_ids(a.prompt, model)
    loaded, ref, ref_path, max_seq = context(a.work, model, ids, a.new, False)  # bench_capture's REF
    head = ("prompt ms/token", "decode ms/step")
    print(f"\n{'runtime':28s} " + " ".join(f"{h + ': alone, each, in band, batched':>58s}" for h in head))
    for name in a.runtimes.split(","):
        best = measure(name, loaded, ref, ref_path, max_seq, a.repeats)
        cols = []
        for i in range(2):
            base = best["alone"][i]
            rest = (f"{1e3 * best[h][i]:8.2f} ({best[h][i] / base:.2f}x)" for h in ("each", "in band", "batched"))
            cols.append(f"{1e3 * base:8.2f} " + " ".join(rest))
        print(f"{name:28s} {cols[0]:>58s} {cols[1]:>58s}", flush=True)


if __name__ == "__main__":
    main()
