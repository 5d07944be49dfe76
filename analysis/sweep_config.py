"""`trace sweep`'s settings: the Config every worker gets (what a finished prompt's record must hold to
be reused, analysis/sweep.py), and the checks of --runtime, --baseline-runtime and --gguf, against the
runtime registry and the prompts, before anything runs. Module level imports no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.replayer import artifacts
from gemma4_trace.replayer.artifacts import cache_dir, model_hash
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.inputs import sha256_file

SWEEP_FORMAT = 1


@dataclass
class Config:
    """What every worker needs: picklable, no torch."""

    model_dir: str | None
    runtime: str
    baseline_runtime: str | None
    max_new_tokens: int
    tolerances: str | None
    baseline_factor: float
    chat: bool
    keep_traces: bool
    cache: str  # the artifact cache folder (replayer/artifacts.cache_dir) at the driver
    caching: bool = True  # artifacts cached (not --no-cache), in every worker as at the driver
    settings: dict = field(default_factory=dict)  # what a finished prompt's JSON must hold to be reused
    sys_path: list = field(default_factory=list)  # the driver's folder: plug-in runtimes found as there
    gguf: str | None = None  # RUN: llama.cpp on this GGUF file as it is (--gguf)
    # BASE: the static runtime on a GGUF's dequantized weights (--baseline-runtime auto for a GGUF
    # port): the file's path, or ":TYPE" for the project's own conversion of the model to TYPE
    baseline_weights_from: str | None = None


def make_settings(model_hash: str, runtime, baseline_runtime, max_new_tokens, tolerances, factor) -> dict:
    from importlib.metadata import version

    tol = None
    if tolerances is not None:
        from gemma4_trace.diff.tolerances import resolve_tolerances

        tol = sha256_file(resolve_tolerances(tolerances))
    return {
        "format": SWEEP_FORMAT,
        "model": model_hash,
        "runtime": runtime,
        "baseline_runtime": baseline_runtime,
        "max_new_tokens": max_new_tokens,
        "tolerances_sha256": tol,
        "baseline_factor": factor if baseline_runtime else None,
        "version": version("gemma4-trace"),
    }


def resolve_baseline(runtime: str, baseline_runtime: str | None, gguf) -> tuple[str | None, str | None]:
    """(BASE's runtime, or the GGUF whose dequantized weights BASE runs on) for --baseline-runtime:
    a runtime's name as given, or `auto`: the runtime's own baseline from its registry row (llama.cpp
    and --gguf: the static runtime on the file's dequantized weights; mlx-q4: mlx-q4-dq; ...)."""
    if baseline_runtime != AUTO:
        return baseline_runtime, None
    from gemma4_trace.replayer.runtimes.registry import parse_runtime

    if gguf is not None:
        return None, str(Path(gguf).resolve())
    choice = parse_runtime(runtime)
    spec = choice.spec
    if spec is None or spec.baseline is None:
        raise TraceToolError(
            f"--baseline-runtime auto: --runtime {runtime} has no baseline of its own; name one (--baseline-runtime RT)"
        )
    if spec.baseline.weights is not None:  # BASE runs on the weights of RUN's own conversion, at its type
        if choice.type in spec.float_types:
            raise TraceToolError(f"--baseline-runtime auto: {choice.text} is not quantized; name a baseline")
        return None, f":{choice.type}"
    return spec.baseline.runtime, None


AUTO = "auto"


def check_runtimes(runtime: str | None, baseline_runtime: str | None, gguf) -> str:
    """RUN's runtime (llama.cpp with --gguf), every choice checked before anything runs: the runtimes
    installed, the GGUF's header, `auto` resolvable; one line otherwise."""
    from gemma4_trace.replayer.runtimes.registry import FILE_BY_DEST, check_available, read_file_header, resolve_file

    if gguf is not None:
        user_file = FILE_BY_DEST["gguf"]
        runtime = resolve_file(runtime or user_file.runtime, {"gguf": gguf})[0].text
        read_file_header(user_file, gguf)  # malformed, or not a regular file: refused before anything runs
    elif runtime is None:
        raise TraceToolError("give --runtime RT (or --gguf FILE)")
    for rt in (runtime, baseline_runtime):
        if rt is not None and rt != AUTO:
            check_available(rt)
    if baseline_runtime == AUTO:
        resolve_baseline(runtime, baseline_runtime, gguf)  # a runtime without a baseline of its own: refused
    return runtime


def configure(
    model_dir,
    runtime: str,
    baseline_runtime,
    max_new_tokens: int,
    chat: bool,
    tolerances,
    factor: float,
    keep: bool,
    gguf=None,
) -> Config:
    """The Config of a sweep over the model in `model_dir` (None: the embedded one); the artifact
    cache as configured now (--cache-dir), plug-in runtimes found from the current folder. `gguf`:
    RUN is llama.cpp on that file; `baseline_runtime` "auto": the runtime's own baseline."""
    from gemma4_trace.hf.model import embedded_model_dir
    from gemma4_trace.replayer.runtimes.registry import FILE_BY_DEST

    baseline_runtime, weights_from = resolve_baseline(runtime, baseline_runtime, gguf)
    gguf_input, weights_input = FILE_BY_DEST["gguf"], FILE_BY_DEST["weights_from"]
    shown_run = runtime if gguf is None else f"{gguf_input.runtime} {gguf_input.option} {Path(gguf).name}"
    shown_base = baseline_runtime
    if weights_from is not None:
        source = f"the {weights_from[1:]} conversion" if weights_from.startswith(":") else Path(weights_from).name
        shown_base = f"{weights_input.runtime} {weights_input.option} {source}"
    settings = make_settings(
        model_hash(model_dir or embedded_model_dir()), shown_run, shown_base, max_new_tokens, tolerances, factor
    )
    settings["chat"] = chat
    for name, path in (("gguf_sha256", gguf), ("baseline_gguf_sha256", weights_from)):
        if path is not None and not path.startswith(":"):  # a file's records are reused only for that file
            settings[name] = sha256_file(path)
    return Config(
        model_dir=str(Path(model_dir).resolve()) if model_dir else None,
        runtime=runtime,
        baseline_runtime=baseline_runtime,
        max_new_tokens=max_new_tokens,
        tolerances=str(Path(tolerances).resolve()) if tolerances and Path(tolerances).is_file() else tolerances,
        baseline_factor=factor,
        chat=chat,
        keep_traces=keep,
        cache=str(cache_dir().resolve()),
        caching=artifacts.caching(),
        settings=settings,
        sys_path=[os.getcwd()],
        gguf=str(Path(gguf).resolve()) if gguf is not None else None,
        baseline_weights_from=weights_from,
    )


def unsupported(prompts: list[dict], runtimes) -> list[dict]:
    """The prompts a runtime of the sweep cannot run, known from its registry row before anything
    runs (an image for a text decoder): [{id, line, reason}]. A plug-in's limits are not known: its
    failures are recorded as the prompts run."""
    from gemma4_trace.replayer.runtimes.registry import parse_runtime

    text_only = [rt for rt in runtimes if rt is not None and getattr(parse_runtime(rt).spec, "text_only", False)]
    if not text_only:
        return []
    why = f"--runtime {text_only[0]} runs a text decoder; the prompt has an image"
    return [{"id": s["id"], "line": s["line"], "reason": why} for s in prompts if "image" in s]
