"""`trace replay`: run a runtime on a reference trace's inputs and write a candidate trace.

Everything that can be refused without a model is refused first (the runtime's name and extra,
its limits against REF: an image, a bfloat16 REF, a GPU; the output path; a user's file and its
header); then the model loads, the runtime is made from its registry row (or the plug-in's
factory, or the family that runs the user's file) and the replay core (core.py) prepares it and
runs the steps.

    replay_trace("REF.h5", "RUN.h5", ReplayOptions(runtime="onnx", max_seq=64))
    replay_trace("REF.h5", "RUN.h5", runtime="llama.cpp", gguf="model.gguf")  # the same, as keywords
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gemma4_trace.hf.model import load_for_reference
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.selection import ALWAYS_KEPT

from .core import MODES, default_max_seq, make_runtime, phase, read_reference, replay_loaded
from .runtimes.registry import (
    DEFAULT,
    FILE_BY_DEST,
    check_available,
    check_capture,
    check_companion,
    check_inputs,
    companion_files,
    file_runtime,
    parse_runtime,
    read_file_header,
    resolve_file,
)


@dataclass
class ReplayOptions:
    """What a replay takes besides REF and the output path (`trace replay`'s options).

    `runtime`: --runtime's text or a RuntimeChoice (runtimes/registry.py). `progress(done,
    total)`, when given, is called after each step. `isolate`: every layer is fed REF's input
    (replayer/isolate.py); the trace's mode is "isolated". `prefill_chunk`: rows per static
    prefill step (resolve_prefill_chunk). `selection` (traces.selection.Selection): what to keep;
    default what REF kept. `device`: where the model (and the static runtime) live, cpu or cuda.
    `make(loaded, max_seq)`: builds the runtime instead of the registry (a precision recipe's,
    analysis/recipe.py). `files`: the user's files by their option's keyword ({"gguf": PATH},
    {"weights_from": PATH}, {"litertlm": PATH}: the registry's file inputs), each checked against
    REF's config first, a difference refused unless `allow_config_mismatch`."""

    model_dir: object = None
    runtime: object = DEFAULT
    max_seq: int | None = None
    mode: str = "teacher-forced"
    force: bool = False
    progress: Callable[[int, int], None] | None = None
    isolate: bool = False
    prefill_chunk: int | None = None
    selection: object = None
    device: str = "cpu"
    make: Callable | None = None
    files: dict = field(default_factory=dict)
    allow_config_mismatch: bool = False
    audio_features: str = "hf"  # --audio-features: "hf" (REF's log-mel features) or "native" (llama.cpp's own)

    @classmethod
    def of(cls, **given) -> ReplayOptions:
        """The options from keywords, a file input's by its own keyword (gguf=PATH)."""
        files = {dest: given.pop(dest) for dest in list(given) if dest in FILE_BY_DEST}
        return cls(**given, files={**given.pop("files", {}), **files})


def replay_trace(reference, output, options: ReplayOptions | None = None, **given) -> str:
    """Replay REF's inputs through a runtime and write the candidate trace; return a summary line.
    `options` (ReplayOptions), or its fields as keywords."""
    if options is not None and given:
        raise TypeError("replay_trace takes ReplayOptions or keywords, not both")
    opts = options if options is not None else ReplayOptions.of(**given)
    choice, user_file, header, ref, max_seq, selection, companions = _check(reference, output, opts)
    phase(opts.progress, "loading the model")
    # a runtime that never computes with HF's weights (llama.cpp) gets the model built without them
    # (a bf16 checkpoint would take 4 bytes per parameter in float32), loaded only to convert a GGUF
    if user_file is not None:
        weightless = user_file.weightless
    else:
        weightless = opts.make is None and choice.spec is not None and choice.spec.weightless
    loaded = load_for_reference(ref.provenance, opts.model_dir, device=opts.device, weights=not weightless)
    limit = getattr(loaded.text_config, "max_position_embeddings", None)
    if limit is not None and max_seq > limit:
        raise TraceToolError(f"--max-seq {max_seq} exceeds the model's {limit} positions (max_position_embeddings)")
    loaded.single_use = True  # this replay is the model's only user
    allow = opts.allow_config_mismatch
    choice = choice.with_files((fi.dest, h, check_companion(fi, loaded, h, allow)) for fi, h in companions)
    phase(opts.progress, f"preparing the {choice.text} runtime")  # an export or a lowering, where it has one
    if user_file is not None:
        base = lambda: make_runtime(choice, loaded, max_seq)  # noqa: E731 - the row's own runtime, if the file wants it
        rt = file_runtime(user_file, loaded, max_seq, header, allow, base, choice=choice)
    elif opts.make is not None:
        rt = opts.make(loaded, max_seq)
    else:
        rt = make_runtime(choice, loaded, max_seq)
    outcome = replay_loaded(
        loaded,
        ref,
        rt,
        output,
        reference_path=reference,
        mode=opts.mode,
        force=opts.force,
        selection=selection,
        progress=opts.progress,
        isolate=opts.isolate,
        prefill_chunk=opts.prefill_chunk,
        max_seq=max_seq,
        plugin=choice.foreign_code,
    )
    return (
        f"wrote {output}: {outcome.name} runtime, {outcome.mode}, {len(outcome.tokens)} steps, max_seq {max_seq}, "
        f"{outcome.agreement(ref.tokens)} ({outcome.seconds:.1f} s)"
    )


def _audio_features(choice, opts: ReplayOptions, extra) -> object:
    """--audio-features checked (native: llama.cpp on an audio REF, with the clip's waveform)."""
    mode, clip = opts.audio_features, opts.files.get("audio")
    if mode not in ("hf", "native"):
        raise TraceToolError(f"--audio-features must be hf or native, got {str(mode)[:40]!r}")
    if mode == "native":
        if choice.spec is None or not choice.spec.native_audio_features:
            why = "computes no audio features of its own (--audio-features native)"
            raise TraceToolError(f"--runtime {choice.text} {why}")
        if "input_features" not in (extra or {}):
            raise TraceToolError("--audio-features native: REF has no audio (no input_features)")
        if clip is None:
            raise TraceToolError(
                "--audio-features native needs the clip's waveform: REF holds only HF's log-mel features; "
                "give --audio FILE (the clip REF was recorded from)"
            )
    elif clip is not None:
        raise TraceToolError("--audio FILE is the waveform for --audio-features native (hf feeds REF's features)")
    return replace(choice, audio_features=mode)


def _check(reference, output, opts: ReplayOptions):
    """Everything refused before the model loads; (the runtime choice, the user's file input and
    its header, REF's inputs, max_seq, the selection to keep)."""
    if opts.mode not in MODES:
        raise TraceToolError(f"mode must be one of {MODES}, got {opts.mode!r}")
    if opts.isolate and opts.mode != "teacher-forced":
        raise TraceToolError("--isolate feeds REF's tokens and tensors; it cannot be combined with --free-running")
    choice = check_available(parse_runtime(opts.runtime), opts.isolate)
    check_output_path(output, opts.force, inputs=(reference,))  # fail before loading anything; never over REF
    choice, user_file = resolve_file(choice, opts.files, isolate=opts.isolate, recipe=opts.make)
    header = None
    if user_file is not None:
        choice = check_available(choice, opts.isolate)
        header = read_file_header(user_file, opts.files[user_file.dest])  # malformed: refused before the model loads
    companions = [(fi, read_file_header(fi, opts.files[fi.dest])) for fi in companion_files(choice, opts.files)]
    ref = read_reference(reference)
    check_inputs(choice, dtype=ref.dtype, extra=ref.extra, device=opts.device, config=ref.model_config)
    choice = _audio_features(choice, opts, ref.extra)
    if user_file is not None and user_file.float32_only and ref.dtype != "float32":
        raise TraceToolError(
            f"{opts.files[user_file.dest]}: {user_file.what} replays against float32 references; "
            f"REF was recorded in {ref.dtype}"
        )
    T, n_new = len(ref.prompt_ids), ref.max_new_tokens
    max_seq = default_max_seq(T, n_new) if opts.max_seq is None else opts.max_seq
    if T + n_new > max_seq:
        raise TraceToolError(
            f"prompt ({T} tokens) + max_new_tokens ({n_new}) = {T + n_new} exceeds --max-seq {max_seq}"
        )
    selection = opts.selection
    if selection is not None and selection.kinds is not None:  # --kinds asked: refuse what the runtime cannot capture
        check_capture(choice, [k for k in selection.kinds if k not in ALWAYS_KEPT])
    selection = ref.selection if selection is None else selection
    if selection is not None:
        selection.check(len(ref.layer_types()), n_new, {t.name: t.layers for t in ref.towers})
        if not opts.isolate:  # an isolated replay feeds every layer REF's input: the static runtime, whole
            choice = choice.with_capture(selection.kinds)
    return choice, user_file, header, ref, max_seq, selection, companions
