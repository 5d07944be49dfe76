"""The replay core: a runtime object, a reference's inputs, the steps, a trace (`replay_loaded`,
beside the recorder's `record_loaded`). `trace replay` (replay.py), `trace sweep` and `trace
sensitivity` / `precision` (analysis/) all replay through it.

    ref = read_reference("REF.h5")
    rt = make_runtime(parse_runtime("static-w8"), loaded, max_seq)
    outcome = replay_loaded(loaded, ref, rt, "RUN.h5", reference_path="REF.h5")

The runtime is closed when the replay ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from gemma4_trace.hf.model import provenance
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.header import Provenance, TraceHeader
from gemma4_trace.traces.layers import layer_infos_from_config
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.writer import TraceWriter

from .api import (
    Capabilities,
    ReportError,
    TokenOnly,
    WriterProbe,
    as_logits,
    check_runtime,
    close_runtime,
    failure_site,
    load_factory,
    plugin_roots,
    progress_words,
)
from .isolate import IsolatingProbe
from .ops import resolve_prefill_chunk
from .runtimes.registry import RuntimeChoice, check_available

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
    towers: tuple = ()  # the encoder towers REF records (traces.layers.TowerInfo): RUN's header holds them too

    @property
    def dtype(self) -> str:
        return str(self.provenance.get("dtype", "float32"))

    @property
    def model_config(self) -> dict:
        """The config of the model the provenance names, as a dict (no model load)."""
        return json.loads(self.provenance["model_config"])

    def layer_types(self) -> list:
        """The layer types of the model the provenance names (no model load)."""
        cfg = self.model_config
        return list(cfg.get("text_config", cfg)["layer_types"])


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
            towers=tuple(r.towers.values()),
        )


def default_max_seq(prompt_len: int, max_new_tokens: int) -> int:
    """Prompt + new tokens rounded up to a multiple of 8."""
    n = prompt_len + max_new_tokens
    return -(-n // 8) * 8


def make_runtime(choice: RuntimeChoice, loaded, max_seq: int):
    """A runtime object that follows the API: a built-in's factory (its registry row), or a
    plug-in's MODULE:FACTORY (imported now). A plug-in's or a third-party adapter's failure to
    start is one line naming where in its code it failed."""
    if choice.spec is not None:
        import importlib

        check_available(choice)
        module, _, function = choice.spec.factory.partition(":")
        factory, args, where = (
            getattr(importlib.import_module(module), function),
            (loaded, max_seq, choice),
            choice.spec.factory,
        )
    else:
        factory, args, where = load_factory(choice.text), (loaded, max_seq), choice.text
    if choice.foreign_code is None:  # the project's own runtime: a failure is a bug of ours
        return factory(*args)
    try:
        rt = factory(*args)
    except TraceToolError:
        raise
    except (Exception, SystemExit) as e:  # sys.exit() in a plug-in must not end the replay as a success
        what = f"runtime plug-in {choice.text}" if choice.plugin else f"runtime {choice.text}"
        raise TraceToolError(
            f"{what} failed to start{failure_site(e, plugin_roots(where))}: {type(e).__name__}: {one_line(e, 200)}"
        ) from e  # --debug prints the chain
    # a plug-in is checked for the contract's members; a built-in's follow it by construction
    return check_runtime(rt, choice.text) if choice.plugin else rt


def phase(progress, what: str) -> None:
    """Tell a progress display (gemma4_trace/progress.py) which phase starts, if it listens."""
    if hasattr(progress, "phase"):
        progress.phase(what)


class CheckedRuntime:
    """A runtime's prefill/decode whose failures and wrong logits become one-line errors.

    A plug-in's exception is the user's input (one line, exit 2) naming where in the plug-in's
    code it was raised and what the step had reported before (`--debug` prints the chained
    traceback); one from a built-in runtime is a bug of ours and keeps its traceback.
    """

    def __init__(self, rt, vocab: int, plugin: str | None = None):
        self.rt, self.vocab, self.plugin = rt, vocab, plugin
        self.roots = plugin_roots(plugin, rt) if plugin else []

    def prepare(self, ids, extra: dict) -> None:
        """The runtime's prepare(input_ids, extra_inputs), where it has one: what it builds or loads
        before the first step (an export, a lowering, a file; a calibration on REF's prompt)."""
        prepare = getattr(self.rt, "prepare", None)
        if callable(prepare):
            self._call("preparing", prepare, ids, extra)

    def prefill(self, ids, extra: dict, probe):
        return self._logits("prefill", self.rt.prefill, ids, extra, probe)

    def decode(self, step: int, token: int, position: int, probe):
        return self._logits(f"decode step {step}", self.rt.decode, token, position, probe)

    def _logits(self, what: str, fn, *args):
        logits = self._call(what, fn, *args)
        if isinstance(logits, TokenOnly):
            if not 0 <= int(logits.token) < self.vocab:
                raise TraceToolError(
                    f"runtime {self.rt.name} chose token {logits.token} in {what}: not in the vocabulary"
                )
            return logits
        return as_logits(logits, self.vocab, self.rt.name, what)

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
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
                f"{progress_words(getattr(args[-1], 'last', None))}: {type(e).__name__}: {one_line(e, 200)}"
            ) from e


def prompt_inputs(ref: Reference) -> tuple:
    """REF's prompt as a runtime takes it: ids (T,) long tensor, extra inputs {name: tensor}."""
    import torch

    return torch.tensor(ref.prompt_ids, dtype=torch.long), {k: torch.as_tensor(v) for k, v in ref.extra.items()}


def run_steps(runner: CheckedRuntime, ref: Reference, mode: str, sink, probe, progress=None) -> list[int]:
    """Prefill, then one decode step per token, each handed to `sink` (a TraceWriter, or anything
    with its begin_step / add / end_step) as a step; return the chosen tokens. `probe` gets the
    runtime's reports (its next_step() is called before each step).

    Teacher-forced: every reference step, fed the reference's tokens. Free-running: the
    runtime's own tokens, until an EOS id or max_new_tokens.
    """
    import torch

    T = len(ref.prompt_ids)
    n_steps = ref.n_steps if mode == "teacher-forced" else ref.max_new_tokens
    ids, extra = prompt_inputs(ref)
    eos = set(ref.eos)
    tokens: list[int] = []
    for step in range(n_steps):
        probe.next_step()
        if step == 0:
            sink.begin_step(range(0, T))
            logits = runner.prefill(ids, extra, probe)
        else:
            fed = ref.tokens[step - 1] if mode == "teacher-forced" else tokens[-1]
            position = T + step - 1
            sink.begin_step(range(position, position + 1))
            logits = runner.decode(step, fed, position, probe)
        if isinstance(logits, TokenOnly):  # an engine without logits: the step holds its token alone
            token = int(logits.token)
        else:
            token = int(torch.argmax(logits))
            sink.add("logits", logits.float().cpu().numpy(), source_dtype=str(logits.dtype).removeprefix("torch."))
        sink.add("token", token)
        sink.end_step()
        tokens.append(token)
        if progress is not None:
            progress(step + 1, n_steps)
        if mode == "free-running" and token in eos:
            break
    return tokens


@dataclass
class ReplayOutcome:
    name: str  # the runtime's name, as the trace's provenance holds it
    mode: str  # as recorded: teacher-forced, free-running or isolated
    tokens: list[int]
    seconds: float

    def agreement(self, ref_tokens: list[int]) -> str:
        if self.mode != "free-running":
            agree = sum(a == b for a, b in zip(self.tokens, ref_tokens))
            return f"{agree}/{len(self.tokens)} tokens agree with the reference"
        same = self.tokens == ref_tokens[: len(self.tokens)] and len(self.tokens) == len(ref_tokens)
        return "same tokens as the reference" if same else "tokens differ from the reference"


def replay_loaded(
    loaded,
    ref: Reference,
    rt,
    output,
    *,
    reference_path,
    mode: str = "teacher-forced",
    force: bool = False,
    selection=None,
    progress: Callable[[int, int], None] | None = None,
    isolate: bool = False,
    prefill_chunk: int | None = None,
    max_seq: int,
    plugin: str | None = None,
) -> ReplayOutcome:
    """Replay REF's inputs through the runtime object `rt` (closed when this returns or fails) and
    write the candidate trace at `output`. The runtime's lifecycle: its `prefill_chunk` set (for a
    runtime that takes one: --prefill-chunk resolved, resolve_prefill_chunk; isolation prefills
    whole), then `prepare(ids, extra)` once (what it builds or loads), then the steps.
    `isolate`: every layer is fed REF's input (read from `reference_path`; the trace's mode is
    "isolated"). `plugin`: the MODULE:FACTORY a plug-in came from (its failures name its own code)."""
    with contextlib.ExitStack() as stack:
        stack.callback(close_runtime, rt)
        caps = Capabilities.of(rt)
        if isolate and not caps.isolation:
            raise TraceToolError(
                f"runtime {rt.name} does not support --isolate: it must continue with the tensor "
                "probe.tensor() returns and set supports_isolation = True (docs/runtime-api.md)"
            )
        if caps.prefill_chunk:
            rt.prefill_chunk = None if isolate else resolve_prefill_chunk(prefill_chunk, max_seq)
        runner = CheckedRuntime(rt, loaded.text_config.vocab_size, plugin)
        runner.prepare(*prompt_inputs(ref))
        phase(progress, "running the steps")
        recorded_mode = "isolated" if isolate else mode
        t0 = time.perf_counter()
        # the writer thread always: the static runtime leaves a core idle often enough (its small ops and
        # the probe's hand-over) that the thread's writes cost less than on the model's thread
        # (full-size E2B replay steps 17.7 / 17.9 s threaded, 20.1 / 18.3 s on the model's thread)
        w = stack.enter_context(TraceWriter(output, force=force, source_dtype=loaded.dtype, selection=selection))
        w.write_header(
            TraceHeader(
                Provenance.from_dict(provenance(loaded, runtime=rt.name, mode=recorded_mode)),
                ref.prompt_ids,
                layer_infos_from_config(loaded.text_config),
                max_new_tokens=ref.max_new_tokens,
                eos_token_ids=ref.eos,
                prompt_text=ref.prompt_text,
                chat_template_applied=ref.chat,
                extra_inputs=ref.extra,
                towers=ref.towers,
                max_seq=max_seq,
            )
        )
        if isolate:
            probe = IsolatingProbe(w, rt.name, stack.enter_context(TraceReader(reference_path)))
        else:
            probe = WriterProbe(w, rt.name)
        tokens = run_steps(runner, ref, mode, w, probe, progress)
    return ReplayOutcome(rt.name, recorded_mode, tokens, time.perf_counter() - t0)
