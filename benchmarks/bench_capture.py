"""The capture tax: a runtime alone (tokens out, nothing captured) against `trace replay` (every
kind captured and written), per prefill token and per decode step, at E2B width.

    python benchmarks/bench_capture.py /tmp/capture-e2b --prompt 32 --new 8
    python benchmarks/bench_capture.py /tmp/capture-e2b --runtimes onnx,litert,litert:layer_out

Builds (once, in a child process) the E2B-shaped random checkpoint of benchmarks/e2b_shaped.py
(for TICO and LiteRT (every litert* runtime), the same text decoder with a small vision tower
and a tokenizer: WITH_VISION), records REF, then for each runtime, in this one process on the
one loaded model, alternates `--repeats` times between
  alone    the runtime made with RuntimeChoice.capture empty (the same engine and inputs: the
           exported graphs without extra outputs, llama.cpp without its eval callback, LiteRT's
           interpreter without keep-every-tensor, litert-convert's conversion with the logits
           its only output, MLX and TICO without taps; litert-lm gives tokens either way)
           running the prefill and REF's teacher-forced decode steps with no probe: only logits
           out,
  capture  replay_loaded (replayer/core.py): the same steps with every kind captured and the trace
           written, as `trace replay` does,
and keeps each one's best time. A capture's prefill runs from the runtime's prefill called to its
rows handed to the trace's writer; the trace's start before it (the file made, its header written:
once a replay, whatever the prompt's length) is printed apart. A name `RUNTIME:kind+kind` is the
capture of `trace replay --kinds kind,kind` (the runtime asked to expose only those);
`RUNTIME:every` asks for every kind by name (LiteRT: all of them as extra outputs instead of the
interpreter keeping every tensor). Exports and lowerings are built before any model is loaded
here, each runtime's two variants (alone, capture) in a child process of its own (an int8
lowering at this width holds about 14 GB while it runs), into the artifact cache WORK/cache, and
not timed; the timed runs then load them from there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root

from benchmarks.bench_llamacpp_e2b import cli  # a trace command in a fresh process
from benchmarks.e2b_shaped import E2B_TEXT, bench_setup, build, token_ids

ROOT = repo_root.ROOT

GGUF = ("F32", "Q4_K_M")
# the --kinds selections that meet the target where every kind does not (docs/benchmarks.md)
NARROW = (
    "mobius:layer_out,llama.cpp:Q4_K_M:layer_out,openvino-int8:layer_out,openvino-int4:layer_out,"
    "openvino-int4-dq:layer_out,openvino-int8-dq:k+v,litert:k+v,litert-int8:k+v,litert-wi8:k+v,litert-int4:k+v,"
    "litert-int8-dq:k+v,litert-wi8-dq:k+v,litert-int4-dq:k+v"
)


def every_runtime() -> str:
    """The default --runtimes: every built-in runtime (llama.cpp as F32 and Q4_K_M), then NARROW."""
    from gemma4_trace.replayer.runtimes.registry import RUNTIMES

    # (not the rows that cannot run E2B's decoder, RuntimeSpec.decoders: it has KV sharing and PLE)
    rows = [s for s in RUNTIMES if not (s.decoders and s.decoders.lacks(dict(E2B_TEXT)))]
    names = [f"{s.name}:{t}" if t else s.name for s in rows for t in (GGUF if s.types else (None,))]
    return ",".join(names) + "," + NARROW


def parse(name: str):
    """'litert:layer_out' -> (litert's choice, ("layer_out",)); 'llama.cpp:F32' -> (its choice, None);
    'llama.cpp:Q4_K_M:layer_out' -> (llama.cpp:Q4_K_M's choice, ("layer_out",)); 'litert:k+v' -> (litert's
    choice, ("k", "v"))."""
    from gemma4_trace.replayer.runtimes.registry import parse_runtime
    from gemma4_trace.traces.schema import KIND_NAMES

    base, sep, kinds = name.partition(":")
    if kinds.partition(":")[0] in GGUF:  # llama.cpp:TYPE, llama.cpp:TYPE:kinds
        gguf, _, kinds = kinds.partition(":")
        base, sep = f"{base}:{gguf}", bool(kinds)
    if not sep:
        return parse_runtime(base), None
    if kinds == "every":  # every kind, asked by name (LiteRT: as extra outputs, not every tensor kept)
        return parse_runtime(base), tuple(k for k in KIND_NAMES if k not in ("logits", "token"))
    return parse_runtime(base), tuple(kinds.split("+"))


def variants(choice, kinds) -> dict:
    """{"alone": the runtime with nothing captured, "capture": with `kinds` (every kind: None)}."""
    return {"alone": choice.with_capture(()), "capture": choice.with_capture(kinds) if kinds else choice}


def alone(rt, ref, max_seq: int) -> tuple[float, list[float]]:
    """Seconds of the prefill and of each decode step, no probe; prefill in the rows per step a
    replay uses (replay_loaded sets the same). The runtime's name is read first, untimed, as
    replay_loaded reads it for the trace's header before the prefill: a runtime that loads its
    files when first named (LiteRT) loads there in both."""
    import torch

    from gemma4_trace.replayer.api import Capabilities
    from gemma4_trace.replayer.ops import resolve_prefill_chunk

    if Capabilities.of(rt).prefill_chunk:
        rt.prefill_chunk = resolve_prefill_chunk(None, max_seq)
    _ = rt.name
    with torch.no_grad():
        t0 = time.perf_counter()
        rt.prefill(torch.tensor(ref.prompt_ids, dtype=torch.long), ref.extra, None)  # as replay_loaded passes them
        steps, T = [time.perf_counter() - t0], len(ref.prompt_ids)
        for s in range(1, ref.n_steps):
            t0 = time.perf_counter()
            rt.decode(ref.tokens[s - 1], T + s - 1, None)
            steps.append(time.perf_counter() - t0)
    return steps[0], steps[1:]


def captured(loaded, ref, ref_path, rt, max_seq: int, kinds) -> tuple[float, list[float], float]:
    """Seconds of the prefill and of each decode step of replay_loaded (the trace written; only
    `kinds` kept when given, as `trace replay --kinds` keeps them), and of the trace's start before
    the prefill (the file made, its header written: once a replay, whatever the prompt). The
    prefill runs from the runtime's prefill called to its rows handed to the trace's writer."""
    from gemma4_trace.replayer.core import replay_loaded
    from gemma4_trace.traces.selection import Selection

    selection = Selection.parse(kinds=",".join(kinds)) if kinds else None
    start, marks = time.perf_counter(), []
    prefill = rt.prefill

    def timed_prefill(*args):
        marks.append(time.perf_counter())
        return prefill(*args)

    rt.prefill = timed_prefill
    with tempfile.TemporaryDirectory() as d:
        replay_loaded(
            loaded,
            ref,
            rt,
            Path(d) / "run.h5",
            reference_path=ref_path,
            max_seq=max_seq,
            selection=selection,
            progress=lambda done, total: marks.append(time.perf_counter()),
        )
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return steps[0], steps[1:], marks[0] - start


def measure(name: str, loaded, ref, ref_path, max_seq: int, repeats: int) -> dict:
    """{"alone" | "capture": (best s/prompt token, best s/decode step, best s of the trace's start
    before the prefill: 0 alone)}; the runtime is made fresh
    for every run (exports from the artifact cache), and made once untimed first so that building
    its artifacts is not timed."""
    from gemma4_trace.replayer.api import close_runtime
    from gemma4_trace.replayer.core import make_runtime

    choice, kinds = parse(name)
    made = variants(choice, kinds)
    for c in made.values():  # a warm-up, untimed (the artifacts come from the cache: prepare())
        rt = make_runtime(c, loaded, max_seq)
        try:
            alone(rt, ref, max_seq)
        finally:
            close_runtime(rt)
    best = {how: (float("inf"),) * 3 for how in made}
    for _ in range(repeats):
        for how, c in made.items():
            rt = make_runtime(c, loaded, max_seq)
            if how == "alone":
                try:
                    p, d = alone(rt, ref, max_seq)
                    start = 0.0
                finally:
                    close_runtime(rt)
            else:
                p, d, start = captured(loaded, ref, ref_path, rt, max_seq, kinds)  # replay_loaded closes it
            per = (p / len(ref.prompt_ids), sum(d) / max(len(d), 1), start)
            best[how] = tuple(min(x, y) for x, y in zip(best[how], per))
    return best


# TICO's runtime takes image-text checkpoints only, and LiteRT's export bundles a tokenizer: these run
# on benchmarks/bench_litert_e2b.py's checkpoint (the same E2B-shaped text decoder, a small vision
# tower, the embedded model's tokenizer)
WITH_VISION = ("tico", "litert")
BUILD_WITH_VISION = (
    "import sys; from pathlib import Path; from benchmarks.bench_litert_e2b import build; build(Path(sys.argv[1]))"
)


def has_vision(model: Path) -> bool:
    """Does the checkpoint have a vision tower (hf/tiny_model does: the runtimes of WITH_VISION run on it)?"""
    return "vision_config" in json.loads((Path(model) / "config.json").read_text())


def context(work: Path, model: Path, ids: str, new: int, multimodal: bool):
    """(loaded model, REF, REF's path, max_seq) of the text checkpoint, or, for the runtimes that need
    one, of the same text decoder with a small vision tower (built once, in a child process; a
    checkpoint with a vision tower of its own is used as it is)."""
    import subprocess

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.core import default_max_seq, read_reference

    multimodal = multimodal and not has_vision(model)
    if multimodal:
        model = work / "model-mm"
        if not (model / "config.json").exists():
            subprocess.run([sys.executable, "-c", BUILD_WITH_VISION, str(model)], check=True, cwd=ROOT)
    ref_path = work / ("ref-mm.h5" if multimodal else "ref.h5")
    if not ref_path.exists():
        cli(None, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", new, "-o", ref_path)
    ref = read_reference(ref_path)
    return load_model(model), ref, ref_path, default_max_seq(len(ref.prompt_ids), ref.max_new_tokens)


def prepare(a, name: str, how: str, ids: str, model: Path) -> None:
    """Build (export, lower, quantize) one variant of runtime NAME into the artifact cache: run in
    a child process (`--prepare NAME@HOW`), so that no lowering's memory stays in the timed process
    and the two variants' lowerings do not add up."""
    from gemma4_trace.replayer.api import close_runtime
    from gemma4_trace.replayer.core import make_runtime

    loaded, ref, _, max_seq = context(a.work, model, ids, a.new, name.partition(":")[0].startswith(WITH_VISION))
    choice, kinds = parse(name)
    made = variants(choice, kinds)
    rt = make_runtime(made[how], loaded, max_seq)
    try:
        alone(rt, ref, max_seq)
    finally:
        close_runtime(rt)


def main() -> None:
    a, model = bench_setup(
        __doc__,
        __file__,
        build,
        repeats=dict(type=int, default=2),
        runtimes=dict(help="comma-separated (default: every built-in runtime, then the selections of NARROW)"),
        prepare=dict(help=argparse.SUPPRESS),
        built=dict(action="store_true", help="the artifacts are in WORK/cache already: build nothing first"),
    )
    import subprocess

    from gemma4_trace.traces.errors import TraceToolError

    os.environ.setdefault("GEMMA4_TRACE_CACHE", str(a.work / "cache"))
    ids = token_ids(a.prompt, model)  # the same every run: REF is recorded once
    a.runtimes = a.runtimes or every_runtime()
    if a.prepare:  # a child of the loop below
        prepare(a, *a.prepare.split("@"), ids, model)
        return
    flags = [str(a.work), "--prompt", str(a.prompt), "--new", str(a.new), *a.model_flags]
    failed = {}
    for name in [] if a.built else a.runtimes.split(","):
        for how in ("alone", "capture"):
            p = subprocess.run([sys.executable, __file__, *flags, "--prepare", f"{name}@{how}"])
            if p.returncode:
                failed[name] = f"building its {how} variant failed (exit {p.returncode})"
    contexts = {}
    print(f"\n{'runtime':18s} {'prefill ms/token':>28s} {'decode ms/step':>28s}")
    print(
        f"{'':18s} {'alone':>8s} {'capture':>9s} {'ratio':>9s} {'alone':>8s} {'capture':>9s} {'ratio':>9s}"
        f" {'trace start ms':>15s}"
    )
    for name in a.runtimes.split(","):
        if name in failed:
            print(f"{name:18s} not measured: {failed[name]}", flush=True)
            continue
        mm = name.partition(":")[0].startswith(WITH_VISION)
        if mm not in contexts:
            contexts.clear()  # one loaded model at a time
            contexts[mm] = context(a.work, model, ids, a.new, mm)
        loaded, ref, ref_path, max_seq = contexts[mm]
        try:
            best = measure(name, loaded, ref, ref_path, max_seq, a.repeats)
        except TraceToolError as e:
            print(f"{name:18s} not measured: {e}", flush=True)
            continue
        (pa, da, _), (pc, dc, start) = best["alone"], best["capture"]
        prefill = f"{1e3 * pa:8.2f} {1e3 * pc:9.2f} {pc / pa:8.2f}x"
        decode = f"{1e3 * da:8.1f} {1e3 * dc:9.1f} {dc / da:8.2f}x"
        print(f"{name:18s} {prefill} {decode} {1e3 * start:15.1f}", flush=True)


if __name__ == "__main__":
    main()
