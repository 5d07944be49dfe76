"""The capture tax: a runtime alone (tokens out, no probe) against `trace replay` (every kind captured
and written), per prefill token and per decode step, at E2B width.

    python benchmarks/bench_capture.py /tmp/capture-e2b --prompt 32 --new 8

Builds (once, in a child process) the E2B-shaped random checkpoint of benchmarks/e2b_shaped.py,
records REF, then for each runtime, in this one process on the one loaded model, alternates
`--repeats` times between
  alone    the runtime's prefill and REF's teacher-forced decode steps with no probe (nothing
           captured, only logits out),
  capture  replay_loaded (replayer/core.py): the same steps with the probe capturing every kind
           and the trace written, as `trace replay` does,
and keeps each one's best time. Covered: the runtimes whose capture is the probe (the static
runtime and its quantized variants: without a probe nothing is captured) and llama.cpp (alone: its
context made without the eval callback, llama.cpp's own fast path). The other adapters capture
inside their exported graphs (ONNX, .pte, LiteRT's keep-every-tensor, OpenVINO IR, MLX's
modules): they have no tokens-only mode yet, so they are not in this table.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_llamacpp_e2b import cli  # noqa: E402  (a trace command in a fresh process)
from benchmarks.e2b_shaped import bench_setup, build  # noqa: E402

RUNTIMES = ("static", "static-w8", "static-w4g32", "static-w8a8", "llama.cpp:F32", "llama.cpp:Q4_K_M")


def make(name: str, loaded, max_seq: int, capture: bool):
    """The runtime `name`; llama.cpp without its eval callback when not `capture` (its tokens-only
    mode); the static runtimes capture only through the probe, which `alone` does not give."""
    from gemma4_trace.replayer.core import make_runtime
    from gemma4_trace.replayer.runtimes.registry import parse_runtime

    choice = parse_runtime(name)
    if choice.gguf and not capture:
        from gemma4_trace.replayer.runtimes.llamacpp.runtime import LlamaCppRuntime

        return LlamaCppRuntime(loaded, max_seq, choice.type, capture=False)
    return make_runtime(choice, loaded, max_seq)


def alone(rt, ref, max_seq: int) -> tuple[float, list[float]]:
    """Seconds of the prefill and of each decode step, no probe; prefill in the rows per step a
    replay uses (replay_loaded sets the same)."""
    import torch

    from gemma4_trace.replayer.api import Capabilities
    from gemma4_trace.replayer.ops import resolve_prefill_chunk

    if Capabilities.of(rt).prefill_chunk:
        rt.prefill_chunk = resolve_prefill_chunk(None, max_seq)
    with torch.no_grad():
        t0 = time.perf_counter()
        rt.prefill(ref.prompt_ids, ref.extra, None)
        steps, T = [time.perf_counter() - t0], len(ref.prompt_ids)
        for s in range(1, ref.n_steps):
            t0 = time.perf_counter()
            rt.decode(ref.tokens[s - 1], T + s - 1, None)
            steps.append(time.perf_counter() - t0)
    return steps[0], steps[1:]


def captured(loaded, ref, ref_path, rt, max_seq: int) -> tuple[float, list[float]]:
    """Seconds of the prefill and of each decode step of replay_loaded (the trace written)."""
    from gemma4_trace.replayer.core import replay_loaded

    marks = [time.perf_counter()]
    with tempfile.TemporaryDirectory() as d:
        replay_loaded(
            loaded,
            ref,
            rt,
            Path(d) / "run.h5",
            reference_path=ref_path,
            max_seq=max_seq,
            progress=lambda done, total: marks.append(time.perf_counter()),
        )
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return steps[0], steps[1:]


def main() -> None:
    a, model = bench_setup(__doc__, __file__, build, repeats=dict(type=int, default=2))
    import random

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.api import close_runtime
    from gemma4_trace.replayer.core import default_max_seq, read_reference

    rng = random.Random(0)
    ids = ",".join(str(rng.randrange(10, 16000)) for _ in range(a.prompt))
    ref_path = a.work / "ref.h5"
    cli(None, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref_path, "--force")
    ref = read_reference(ref_path)
    loaded = load_model(model)
    max_seq = default_max_seq(len(ref.prompt_ids), ref.max_new_tokens)
    print(f"\n{'runtime':14s} {'prefill ms/token':>28s} {'decode ms/step':>28s}")
    print(f"{'':14s} {'alone':>8s} {'capture':>9s} {'ratio':>9s} {'alone':>8s} {'capture':>9s} {'ratio':>9s}")
    for name in RUNTIMES:
        best = {"alone": (float("inf"), float("inf")), "capture": (float("inf"), float("inf"))}
        for _ in range(a.repeats):
            for how in ("alone", "capture"):
                rt = make(name, loaded, max_seq, capture=how == "capture")
                if how == "alone":
                    try:
                        p, d = alone(rt, ref, max_seq)
                    finally:
                        close_runtime(rt)
                else:
                    p, d = captured(loaded, ref, ref_path, rt, max_seq)  # replay_loaded closes it
                per = (p / len(ref.prompt_ids), sum(d) / max(len(d), 1))
                best[how] = tuple(min(x, y) for x, y in zip(best[how], per))
        (pa, da), (pc, dc) = best["alone"], best["capture"]
        prefill = f"{1e3 * pa:8.2f} {1e3 * pc:9.2f} {pc / pa:8.2f}x"
        print(f"{name:14s} {prefill} {1e3 * da:8.1f} {1e3 * dc:9.1f} {dc / da:8.2f}x")


if __name__ == "__main__":
    main()
