"""`trace replay`: run a runtime on a reference trace's inputs and write a candidate trace."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from gemma4_trace.hf.model import load_for_reference, provenance
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.header import Provenance, TraceHeader
from gemma4_trace.traces.layers import layer_infos_from_config
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.writer import TraceWriter

from .api import (
    ReportError,
    WriterProbe,
    as_logits,
    check_runtime_inputs,
    failure_site,
    make_runtime,
    plugin_roots,
    progress_words,
)
from .isolate import IsolatingProbe, check_supports_isolation
from .runtime import resolve_prefill_chunk

# the modes a replay can run in (the trace format's modes, less the recorder's "reference")
MODES = tuple(m for m in S.MODES if m not in ("reference", "isolated"))


@dataclass
class Reference:
    """What a replay takes from the reference trace (read once; the file is closed after)."""

    provenance: dict
    prompt_ids: list[int]
    extra: dict  # processor outputs besides ids, numpy arrays
    max_new_tokens: int
    eos: list[int]
    prompt_text: str
    chat: bool
    tokens: list[int]  # the reference's generated tokens, one per step
    n_steps: int
    selection: object = None  # a selective reference's Selection (traces/selection.py), else None


def read_reference(path) -> Reference:
    with TraceReader(path) as r:
        return Reference(
            provenance=dict(r.provenance),
            prompt_ids=[int(x) for x in r.prompt_ids],
            extra=r.extra_inputs(),
            max_new_tokens=r.max_new_tokens,
            eos=list(r.eos_token_ids),
            prompt_text=r.prompt_text,
            chat=r.chat_template_applied,
            tokens=[int(t) for t in r.tokens()],
            n_steps=r.n_steps,
            selection=r.selection,
        )


def json_layers(prov: dict) -> list:
    """The layer types of the model a trace's provenance names (no model load)."""
    import json

    cfg = json.loads(prov["model_config"])
    return list(cfg.get("text_config", cfg)["layer_types"])


def default_max_seq(prompt_len: int, max_new_tokens: int) -> int:
    """Prompt + new tokens rounded up to a multiple of 8."""
    n = prompt_len + max_new_tokens
    return -(-n // 8) * 8


def _runs_on_llamacpp(runtime: str) -> bool:
    from .llamacpp_runtime import parse_spec

    return parse_spec(runtime) is not None


def replay_trace(
    reference,
    output,
    *,
    model_dir=None,
    runtime: str = "static",
    max_seq: int | None = None,
    mode: str = "teacher-forced",
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    isolate: bool = False,
    prefill_chunk: int | None = None,
    selection=None,
    device: str = "cpu",
    recipe=None,
    gguf=None,
    weights_from=None,
    allow_config_mismatch: bool = False,
) -> str:
    """Replay REF's inputs through a runtime and write the candidate trace; return a summary line.

    `progress(done, total)`, when given, is called after each step. `isolate`: every layer
    is fed REF's input (replayer/isolate.py); the trace's mode is "isolated".
    `prefill_chunk`: rows per static prefill step (resolve_prefill_chunk); isolation prefills whole.
    `selection` (traces.selection.Selection): what to keep; default what REF kept.
    `device`: where the model (and the static runtime's caches and tables) live, cpu or cuda.
    `recipe` (replayer.recipe.Recipe): per-unit precisions for a quantized static runtime.
    `gguf`: a user's GGUF file run by llama.cpp; `weights_from`: a GGUF whose dequantized weights
    the static runtime runs on; either is checked against REF's config first, differences
    refused unless `allow_config_mismatch` (replayer/gguf_reader.py).
    """
    if mode not in MODES:
        raise TraceToolError(f"mode must be one of {MODES}, got {mode!r}")
    if isolate and mode != "teacher-forced":
        raise TraceToolError("--isolate feeds REF's tokens and tensors; it cannot be combined with --free-running")
    check_output_path(output, force, inputs=(reference,))  # fail before loading anything; never over REF
    header = None
    if gguf is not None or weights_from is not None:
        from .gguf_reader import check_gguf_options, read_header

        runtime = check_gguf_options(runtime, gguf, weights_from, isolate, recipe)
        header = read_header(gguf if gguf is not None else weights_from)  # malformed: refused before the model loads
    ref = read_reference(reference)
    check_runtime_inputs(runtime, ref.extra)  # an image for a text-only runtime: before the model loads
    T, n_new = len(ref.prompt_ids), ref.max_new_tokens
    max_seq = default_max_seq(T, n_new) if max_seq is None else max_seq
    if T + n_new > max_seq:
        raise TraceToolError(
            f"prompt ({T} tokens) + max_new_tokens ({n_new}) = {T + n_new} exceeds --max-seq {max_seq}"
        )
    selection = ref.selection if selection is None else selection
    if selection is not None:
        selection.check(len(json_layers(ref.provenance)), n_new)
    _phase(progress, "loading the model")
    # llama.cpp never computes with HF's weights: the model is built without them (a bf16 checkpoint
    # would take 4 bytes per parameter in float32), loaded only if a GGUF must be converted
    weightless = gguf is not None or (weights_from is None and recipe is None and _runs_on_llamacpp(runtime))
    loaded = load_for_reference(ref.provenance, model_dir, device=device, weights=not weightless)
    limit = getattr(loaded.text_config, "max_position_embeddings", None)
    if limit is not None and max_seq > limit:
        raise TraceToolError(f"--max-seq {max_seq} exceeds the model's {limit} positions (max_position_embeddings)")
    _phase(progress, f"preparing the {runtime} runtime")  # an export or a lowering, where the runtime has one
    if header is not None:
        from .llamacpp_runtime import make_gguf_runtime

        rt = make_gguf_runtime(runtime, loaded, max_seq, header, allow_config_mismatch, weights_from is not None)
    elif recipe is None:
        rt = make_runtime(runtime, loaded, max_seq)
    else:  # a precision recipe (replayer/recipe.py) over a quantized static runtime
        from .recipe import make_recipe_runtime

        rt = make_recipe_runtime(runtime, loaded, max_seq, recipe)
    _phase(progress, "running the steps")
    if isolate:
        check_supports_isolation(rt)
    if hasattr(rt, "prefill_chunk"):  # the static runtime and its quantized variants
        rt.prefill_chunk = None if isolate else resolve_prefill_chunk(prefill_chunk, max_seq)
    runner = _CheckedRuntime(
        rt, plugin=runtime != "static", vocab=loaded.text_config.vocab_size, roots=plugin_roots(runtime, rt)
    )
    t0 = time.perf_counter()
    recorded_mode = "isolated" if isolate else mode
    with contextlib.ExitStack() as stack:
        # the writer thread always: the static runtime leaves a core idle often enough (its small ops and
        # the probe's hand-over) that the thread's writes cost less than on the model's thread
        # (full-size E2B replay steps 17.7 / 17.9 s threaded, 20.1 / 18.3 s on the model's thread)
        w = stack.enter_context(TraceWriter(output, force=force, source_dtype=loaded.dtype, selection=selection))
        w.write_header(
            TraceHeader(
                Provenance.from_dict(provenance(loaded, runtime=rt.name, mode=recorded_mode)),
                ref.prompt_ids,
                layer_infos_from_config(loaded.text_config),
                max_new_tokens=n_new,
                eos_token_ids=ref.eos,
                prompt_text=ref.prompt_text,
                chat_template_applied=ref.chat,
                extra_inputs=ref.extra,
            )
        )
        probe = IsolatingProbe(w, rt.name, stack.enter_context(TraceReader(reference))) if isolate else None
        tokens = _run_steps(runner, ref, mode, w, progress, probe)
    seconds = time.perf_counter() - t0
    return (
        f"wrote {output}: {rt.name} runtime, {recorded_mode}, {len(tokens)} steps, max_seq {max_seq}, "
        f"{_agreement(tokens, ref.tokens, mode)} ({seconds:.1f} s)"
    )


class _CheckedRuntime:
    """A runtime's prefill/decode whose failures and wrong logits become one-line errors.

    A plug-in's exception is the user's input (one line, exit 2) naming where in the plug-in's
    code it was raised and what the step had reported before (`--debug` prints the chained
    traceback); one from the static runtime is a bug of ours and keeps its traceback.
    """

    def __init__(self, rt, plugin: bool, vocab: int, roots: list[str] = ()):
        self.rt, self.plugin, self.vocab, self.roots = rt, plugin, vocab, list(roots)

    def prefill(self, ids, extra: dict, probe):
        return self._logits("prefill", self.rt.prefill, ids, extra, probe)

    def decode(self, step: int, token: int, position: int, probe):
        return self._logits(f"decode step {step}", self.rt.decode, token, position, probe)

    def _logits(self, what: str, fn, *args):

        try:
            logits = fn(*args)
        except ReportError as e:  # the probe refused a report: say where the plug-in made it
            site = failure_site(e, self.roots, inside_only=True) if self.plugin else ""
            if not site:
                raise
            raise TraceToolError(f"{e} (reported{site})") from e
        except TraceToolError:
            raise
        except (Exception, SystemExit) as e:  # sys.exit() in a plug-in is a failure, never a silent exit 0
            if not self.plugin:
                raise
            raise TraceToolError(
                f"runtime {self.rt.name} failed in {what}{failure_site(e, self.roots)} "
                f"{progress_words(args[-1])}: {type(e).__name__}: {one_line(e, 200)}"
            ) from e
        return as_logits(logits, self.vocab, self.rt.name, what)


def _phase(progress, what: str) -> None:
    """Tell a progress display (gemma4_trace/progress.py) which phase starts, if it listens."""
    if hasattr(progress, "phase"):
        progress.phase(what)


def _run_steps(runner: _CheckedRuntime, ref: Reference, mode: str, w: TraceWriter, progress, probe=None) -> list[int]:
    """Prefill, then one decode step per token, each written as a step; return the chosen tokens.

    Teacher-forced: every reference step, fed the reference's tokens. Free-running: the
    runtime's own tokens, until an EOS id or max_new_tokens.
    """
    import torch

    T = len(ref.prompt_ids)
    n_steps = ref.n_steps if mode == "teacher-forced" else ref.max_new_tokens
    ids = torch.tensor(ref.prompt_ids, dtype=torch.long)
    extra = {k: torch.as_tensor(v) for k, v in ref.extra.items()}
    eos = set(ref.eos)
    probe = WriterProbe(w, runner.rt.name) if probe is None else probe
    tokens: list[int] = []
    for step in range(n_steps):
        probe.next_step()
        if step == 0:
            w.begin_step(range(0, T))
            logits = runner.prefill(ids, extra, probe)
        else:
            fed = ref.tokens[step - 1] if mode == "teacher-forced" else tokens[-1]
            position = T + step - 1
            w.begin_step(range(position, position + 1))
            logits = runner.decode(step, fed, position, probe)
        token = int(torch.argmax(logits))
        w.add("logits", logits.float().cpu().numpy(), source_dtype=str(logits.dtype).removeprefix("torch."))
        w.add("token", token)
        w.end_step()
        tokens.append(token)
        if progress is not None:
            progress(step + 1, n_steps)
        if mode == "free-running" and token in eos:
            break
    return tokens


def _agreement(tokens: list[int], ref_tokens: list[int], mode: str) -> str:
    if mode == "teacher-forced":
        agree = sum(a == b for a, b in zip(tokens, ref_tokens))
        return f"{agree}/{len(tokens)} tokens agree with the reference"
    same = tokens == ref_tokens[: len(tokens)] and len(tokens) == len(ref_tokens)
    return "same tokens as the reference" if same else "tokens differ from the reference"
