"""What llama.cpp's eval callback costs a decode step, part by part, on one GGUF file:

    python benchmarks/bench_llamacpp_callback.py /tmp/capture-e2b/cache/gguf/KEY/model.gguf

In this one process (llama.cpp's engine of `--runtime llama.cpp`, replayer/runtimes/llamacpp/engine.py,
without its child process), alternating `--rounds` times between contexts made with
  no callback        the engine alone (`trace replay --kinds` naming no tensor kind)
  trivial callback   a Python callback answering "not wanted" to every node, doing nothing else:
                     what ggml's scheduler asking a Python function about every node costs
  asked, none        the engine's callback with kinds that name no node: its ask, nothing read
  layer_out          the engine's callback reading layer_out (`--kinds layer_out`)
  every kind         the engine's callback reading every kind it finds
each prefilling a 32-token prompt, then timing `--steps` decode steps (best of three per round).
Prints each one's best and median ms per decode step, its ratio to no callback, and how many
nodes the scheduler asked about per step. The tensors read are handed to a function that drops
them: streaming them to the parent process (what a replay adds) is not in these figures.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

CONFIGS = {  # label -> (kinds, trivial callback)
    "no callback": ([], False),
    "trivial callback": (["layer_out"], True),
    "asked, none": (["no such kind"], False),
    "layer_out": (["layer_out"], False),
    "every kind": (None, False),
}


def step_ms(path: str, kinds, trivial: bool, steps: int) -> tuple[float, float]:
    """(best ms per decode step of three runs of `steps`, nodes asked about per step)."""
    from gemma4_trace.replayer.runtimes.llamacpp.engine import LlamaCppEngine

    e = LlamaCppEngine(lambda *report: None)
    asked = [0]
    if trivial:

        def nothing(_ptr, ask, _user):
            asked[0] += ask
            return not ask

        e.cap.c_callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(nothing)
    else:
        ask = e.cap.ask

        def counted(ptr):
            asked[0] += 1
            return ask(ptr)

        e.cap.ask = counted
    e.load(path, 32 + steps, kinds)
    L = e.L
    try:
        e.decode(list(range(100, 132)), 0)
        best = float("inf")
        for _ in range(3):
            L.llama_memory_seq_rm(L.llama_get_memory(e.ctx), 0, 32, -1)  # back to the prompt alone
            asked[0], t0 = 0, time.perf_counter()
            for s in range(steps):
                e.decode([200 + s], 32 + s)
            best = min(best, (time.perf_counter() - t0) / steps)
        return 1e3 * best, asked[0] / steps
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    nodes: dict[str, float] = {}
    for _ in range(a.rounds):
        for label, (kinds, trivial) in CONFIGS.items():
            ms, nodes[label] = step_ms(str(a.gguf), kinds, trivial, a.steps)
            times[label].append(ms)
    base = min(times["no callback"])
    print(f"\n{'':18s} {'best ms/step':>12s} {'median':>8s} {'ratio':>7s} {'asked/step':>11s}")
    for label, t in times.items():
        print(f"{label:18s} {min(t):12.2f} {statistics.median(t):8.2f} {min(t) / base:6.2f}x {nodes[label]:11.0f}")


if __name__ == "__main__":
    main()
