"""`trace replay`: run a runtime on a reference trace's inputs and write a candidate trace.

Everything that can be refused without a model is refused first (the runtime's name and extra,
its limits against REF: an image, a bfloat16 REF, a GPU; the output path; a GGUF's header); then
the model loads, the runtime is made from its registry row (or the plug-in's factory) and the
replay core (core.py) runs the steps.
"""

from __future__ import annotations

from collections.abc import Callable

from gemma4_trace.hf.model import load_for_reference
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.selection import ALWAYS_KEPT

from .api import Capabilities, close_runtime
from .core import MODES, default_max_seq, make_runtime, read_reference, replay_loaded
from .ops import resolve_prefill_chunk
from .runtimes.registry import check_available, check_capture, check_inputs, parse_runtime


def replay_trace(
    reference,
    output,
    *,
    model_dir=None,
    runtime="static",
    max_seq: int | None = None,
    mode: str = "teacher-forced",
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    isolate: bool = False,
    prefill_chunk: int | None = None,
    selection=None,
    device: str = "cpu",
    make=None,
    gguf=None,
    weights_from=None,
    allow_config_mismatch: bool = False,
    litertlm=None,
) -> str:
    """Replay REF's inputs through a runtime and write the candidate trace; return a summary line.

    `runtime`: --runtime's text or a RuntimeChoice (runtimes/registry.py). `progress(done,
    total)`, when given, is called after each step. `isolate`: every layer is fed REF's input
    (replayer/isolate.py); the trace's mode is "isolated". `prefill_chunk`: rows per static
    prefill step (resolve_prefill_chunk). `selection` (traces.selection.Selection): what to keep;
    default what REF kept. `device`: where the model (and the static runtime) live, cpu or cuda.
    `make(loaded, max_seq)`: builds the runtime instead of the registry (a precision recipe's,
    analysis/recipe.py). `gguf`: a user's GGUF file run by llama.cpp; `weights_from`: a GGUF
    whose dequantized weights the static runtime runs on; either is checked against REF's config
    first, differences refused unless `allow_config_mismatch` (runtimes/llamacpp/gguf_reader.py).
    `litertlm`: a user's .litertlm bundle run by `--runtime litert-lm` (runtimes/litert/lm.py).
    """
    choice, header, ref, max_seq, selection = _check(
        reference, output, runtime, mode, force, isolate, max_seq, selection, device, make, gguf, weights_from
    )
    if litertlm is not None and choice.name != "litert-lm":
        raise TraceToolError(f"--litertlm FILE is run by --runtime litert-lm, not {choice.name}")
    _phase(progress, "loading the model")
    # a runtime that never computes with HF's weights (llama.cpp) gets the model built without them
    # (a bf16 checkpoint would take 4 bytes per parameter in float32), loaded only to convert a GGUF
    weightless = gguf is not None or (
        weights_from is None and make is None and choice.spec is not None and choice.spec.weightless
    )
    loaded = load_for_reference(ref.provenance, model_dir, device=device, weights=not weightless)
    limit = getattr(loaded.text_config, "max_position_embeddings", None)
    if limit is not None and max_seq > limit:
        raise TraceToolError(f"--max-seq {max_seq} exceeds the model's {limit} positions (max_position_embeddings)")
    loaded.single_use = True  # this replay is the model's only user
    _phase(progress, f"preparing the {choice.text} runtime")  # an export or a lowering, where the runtime has one
    rt = _make(choice, loaded, max_seq, make, header, allow_config_mismatch, weights_from is not None, litertlm)
    try:
        if Capabilities.of(rt).prefill_chunk and not isolate:
            rt.prefill_chunk = resolve_prefill_chunk(prefill_chunk, max_seq)
        getattr(rt, "name", None)  # a runtime that builds when first asked (the LiteRT ones) builds in this phase
    except BaseException:
        close_runtime(rt)
        raise
    _phase(progress, "running the steps")
    outcome = replay_loaded(
        loaded,
        ref,
        rt,
        output,
        reference_path=reference,
        mode=mode,
        force=force,
        selection=selection,
        progress=progress,
        isolate=isolate,
        prefill_chunk=prefill_chunk,
        max_seq=max_seq,
        plugin=choice.foreign_code,
    )
    return (
        f"wrote {output}: {outcome.name} runtime, {outcome.mode}, {len(outcome.tokens)} steps, max_seq {max_seq}, "
        f"{outcome.agreement(ref.tokens)} ({outcome.seconds:.1f} s)"
    )


def _check(reference, output, runtime, mode, force, isolate, max_seq, selection, device, make, gguf, weights_from):
    """Everything refused before the model loads; (the runtime choice, a GGUF's header, REF's
    inputs, max_seq, the selection to keep)."""
    if mode not in MODES:
        raise TraceToolError(f"mode must be one of {MODES}, got {mode!r}")
    if isolate and mode != "teacher-forced":
        raise TraceToolError("--isolate feeds REF's tokens and tensors; it cannot be combined with --free-running")
    choice = check_available(parse_runtime(runtime), isolate)
    check_output_path(output, force, inputs=(reference,))  # fail before loading anything; never over REF
    header = None
    if gguf is not None or weights_from is not None:
        from .runtimes.llamacpp.gguf_reader import check_gguf_options, read_header

        choice = parse_runtime(check_gguf_options(choice.text, gguf, weights_from, isolate, make))
        header = read_header(gguf if gguf is not None else weights_from)  # malformed: refused before the model loads
    ref = read_reference(reference)
    check_inputs(choice, dtype=ref.dtype, extra=ref.extra, device=device)
    if header is not None and ref.dtype != "float32":
        raise TraceToolError(
            f"{header.path}: a GGUF replays against float32 references; REF was recorded in {ref.dtype}"
        )
    T, n_new = len(ref.prompt_ids), ref.max_new_tokens
    max_seq = default_max_seq(T, n_new) if max_seq is None else max_seq
    if T + n_new > max_seq:
        raise TraceToolError(
            f"prompt ({T} tokens) + max_new_tokens ({n_new}) = {T + n_new} exceeds --max-seq {max_seq}"
        )
    if selection is not None and selection.kinds is not None:  # --kinds asked: refuse what the runtime cannot capture
        check_capture(choice, [k for k in selection.kinds if k not in ALWAYS_KEPT])
    selection = ref.selection if selection is None else selection
    if selection is not None:
        selection.check(len(ref.layer_types()), n_new)
        if not isolate:  # an isolated replay feeds every layer REF's input: the static runtime, whole
            choice = choice.with_capture(selection.kinds)
    return choice, header, ref, max_seq, selection


def _make(choice, loaded, max_seq: int, make, header, allow_config_mismatch: bool, weights_from: bool, litertlm):
    """The runtime object: a GGUF's (--gguf / --weights-from), a .litertlm's, a recipe's (`make`) or
    the registry's."""
    if litertlm is not None:
        from .runtimes.litert.lm import LiteRTLM

        return LiteRTLM(loaded, max_seq, litertlm)
    if header is not None:
        from .runtimes.llamacpp.runtime import gguf_runtime

        return gguf_runtime(loaded, max_seq, header, allow_config_mismatch, weights_from, _static)
    if make is not None:
        return make(loaded, max_seq)
    return make_runtime(choice, loaded, max_seq)


def _static(loaded, max_seq: int):
    return make_runtime(parse_runtime("static"), loaded, max_seq)


def _phase(progress, what: str) -> None:
    """Tell a progress display (gemma4_trace/progress.py) which phase starts, if it listens."""
    if hasattr(progress, "phase"):
        progress.phase(what)
