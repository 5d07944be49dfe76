"""Where an OpenVINO replay's capture time goes, part by part, at E2B width:

    python benchmarks/bench_openvino_outputs.py /tmp/capture-e2b --modes openvino,openvino-int8

On bench_capture.py's E2B-shaped model, REF and artifact cache (WORK; the IRs are built there
first when absent), for each mode's three IRs (no kind as an output: the runtime alone;
layer_out only: `--kinds layer_out`; every kind), alternating `--repeats` times, best of each:
  infer    the prefill and one decode step compiled and run in this process (openvino's
           CompiledModel called on the replay's own inputs): the plugin's work alone
  kernels  the sum of the plugin's own per-node times in that run (PERF_COUNT: every node's
           real time; what the extra outputs would cost if they broke a fusion or forced a copy)
  child 1st  the IR through the runtime's child process (StepGraphRuntime.prefill / decode with no
           probe), the first call of a fresh runtime: what a replay's one prefill pays
  child    the same, a later call: infer plus the outputs copied, pickled and sent back
Ratios are to the IR without extra outputs, per prompt token (prefill) and per step (decode).
The whole replay, with the trace written, is bench_capture.py's row.
"""

from __future__ import annotations

import os
import time

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

from benchmarks.bench_capture import context
from benchmarks.e2b_shaped import bench_setup, build, token_ids

KINDS = {"none": (), "layer_out": ("layer_out",), "every": None}


def feeds(loaded, ref, max_seq: int) -> dict:
    """{step: {input name: array}} of the replay's prefill and first decode step, caches zero."""
    import numpy as np
    import torch

    from gemma4_trace.replayer import functional as F

    host = F.FunctionalKV(loaded, max_seq)
    caches = {n: c.numpy() for n, c in zip(F.cache_names(host), F.zero_caches(host))}
    args = host.prepare_prefill(torch.tensor(ref.prompt_ids, dtype=torch.long), ref.extra)
    T = len(ref.prompt_ids)
    decode = {"token": np.array([[ref.tokens[0]]], dtype=np.int64), "input_pos": np.array([T], dtype=np.int64)}
    prefill = {n: a.cpu().numpy() for n, a in zip(F.PREFILL_INPUTS, args)}
    return {"prefill": {**prefill, **caches}, "decode": {**decode, **caches}}


def measure(loaded, ref, max_seq: int, mode: str, repeats: int) -> dict:
    """{(part, kinds name, step): best seconds}: `repeats` rounds alternating between the
    variants, each made fresh in its round (one variant's compiled IR in memory at a time: a
    float IR at this width holds about 2 GB a step), run once untimed, then timed."""
    import openvino
    import torch

    from gemma4_trace.replayer.api import close_runtime
    from gemma4_trace.replayer.runtimes.openvino import CONFIG, OpenVINORuntime, ir

    core, inputs, T = openvino.Core(), feeds(loaded, ref, max_seq), len(ref.prompt_ids)
    ids = torch.tensor(ref.prompt_ids, dtype=torch.long)

    def infer(kinds, perf=False) -> tuple:
        """({step: run once}, close); with `perf` a run returns the plugin's own seconds."""
        art = ir(loaded, max_seq, mode, kinds)
        try:
            config = {**CONFIG, "PERF_COUNT": "YES"} if perf else CONFIG
            c = {s: core.compile_model(core.read_model(str(art.path / f"{s}.xml")), "CPU", config) for s in inputs}
        finally:
            art.close()
        if not perf:
            return {s: (lambda s=s: c[s](inputs[s])) for s in inputs}, lambda: c.clear()
        reqs = {s: c[s].create_infer_request() for s in inputs}

        def kernels(s: str) -> float:
            reqs[s].infer(inputs[s])
            return sum(n.real_time.total_seconds() for n in reqs[s].get_profiling_info())

        return {s: (lambda s=s: kernels(s)) for s in inputs}, lambda: (reqs.clear(), c.clear())

    def child(kinds) -> tuple:
        rt = OpenVINORuntime(loaded, max_seq, mode, kinds)
        run = {"prefill": lambda: rt.prefill(ids, ref.extra, None), "decode": lambda: rt.decode(ref.tokens[0], T, None)}
        return run, lambda: close_runtime(rt)

    got = {}

    def keep(part: str, name: str, step: str, fn) -> None:
        t0 = time.perf_counter()
        took = fn()
        took = took if isinstance(took, float) else time.perf_counter() - t0  # kernels report their own
        got[(part, name, step)] = min(got.get((part, name, step), float("inf")), took)

    for _ in range(repeats):
        for name, kinds in KINDS.items():
            for part, make in (("infer", infer), ("kernels", lambda k: infer(k, True)), ("child", child)):
                run, close = make(kinds)
                try:
                    for step, fn in run.items():
                        if part == "child":
                            keep("child 1st", name, step, fn)
                        else:
                            fn()  # untimed: the first run of a compiled model
                        keep(part, name, step, fn)
                finally:
                    close()
    return got


def main() -> None:
    a, model = bench_setup(
        __doc__,
        __file__,
        build,
        modes=dict(default="openvino,openvino-int8,openvino-int4"),
        repeats=dict(type=int, default=5),
    )
    os.environ.setdefault("GEMMA4_TRACE_CACHE", str(a.work / "cache"))
    loaded, ref, _, max_seq = context(a.work, model, token_ids(a.prompt, model), a.new, False)
    T = len(ref.prompt_ids)
    print(f"\n{'mode':16s} {'part':9s} {'prefill ms/token: none':>23s} {'layer_out':>16s} {'every':>16s}", end="")
    print(f" {'decode ms/step: none':>21s} {'layer_out':>16s} {'every':>16s}")
    for mode in a.modes.split(","):
        got = measure(loaded, ref, max_seq, mode, a.repeats)
        for part in ("infer", "kernels", "child 1st", "child"):
            cells = []
            for step, per in (("prefill", T), ("decode", 1)):
                base = got[(part, "none", step)]
                cells.append(f"{1e3 * base / per:23.2f}" if step == "prefill" else f"{1e3 * base:21.2f}")
                for name in ("layer_out", "every"):
                    t = got[(part, name, step)]
                    cells.append(f"{1e3 * t / per:8.2f} ({t / base:4.2f}x)")
            print(f"{mode:16s} {part:9s} {' '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
