"""The runtime plug-in API: what `trace replay --runtime MODULE:FACTORY` expects.

A plug-in module exposes a factory

    def factory(loaded: gemma4_trace.hf.model.LoadedModel, max_seq: int) -> runtime

and the runtime it returns has

    name: str                                                    # recorded as provenance "runtime"
    prefill(input_ids, extra_inputs, probe) -> logits            # input_ids (T,) long tensor,
                                                                 # extra_inputs {name: tensor}, logits (vocab,)
    decode(token_id: int, position: int, probe) -> logits        # one token at `position`, logits (vocab,)
                                                                 # (or TokenOnly(token): no logits exposed)

`max_seq` is the static length to build for; the driver guarantees prompt + max_new_tokens
<= max_seq and never reads a `max_seq` back from the runtime. The runtime reports
canonical tensors (traces.schema.KINDS, except logits and token, which the driver writes)
through `probe.tensor(kind, value, layer=None, positions=None)` (positions: the absolute
positions of the rows reported, when a runtime has only some of a step's rows) or `report()`;
`probe` may be None, and then nothing may be computed for it. The driver makes one runtime per
replay; a plug-in's exception becomes one line naming its file:line and the step's last
report (`--debug` prints the chain). See docs/runtime-api.md.

Optional members, read by the driver through `Capabilities.of(rt)` (the `Runtime` base below
declares them; a plug-in need not subclass it):

    supports_isolation: bool = False      # continues with the tensors the probe returns (--isolate)
    supports_prefill_chunk: bool = False  # has a settable `prefill_chunk` (--prefill-chunk)
    prepare(input_ids, extra_inputs) -> None  # builds or loads what it runs (an export, a lowering,
                                          # a file; a calibration on the prompt), once, after
                                          # prefill_chunk is set and before the first step
    close() -> None                       # called once when the replay ends, however it ends

Nothing is built as a side effect of reading a member (`name` included): the driver calls
prepare() once, and a failure there is reported as the runtime's, in the phase "preparing".
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from dataclasses import dataclass

from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.rows import row_count

REQUIRED_METHODS = ("prefill", "decode")
DRIVER_KINDS = ("logits", "token")  # written by the replay driver, never by a runtime


class Runtime:
    """Base of the built-in runtimes: the contract's optional members with their defaults. A
    runtime is a context manager: leaving the block closes it."""

    name = "runtime"
    supports_isolation = False
    supports_prefill_chunk = False

    def prepare(self, input_ids, extra_inputs) -> None:
        """Build or load what the runtime runs, once, before the first step (nothing by default)."""

    def close(self) -> None:
        """Release what the runtime holds beyond memory (a child process, a temporary folder)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Capabilities:
    """What a runtime object says it can do (the contract's optional members, read once)."""

    isolation: bool
    prefill_chunk: bool

    @staticmethod
    def of(rt) -> Capabilities:
        return Capabilities(
            getattr(rt, "supports_isolation", False) is True, getattr(rt, "supports_prefill_chunk", False) is True
        )


def close_runtime(rt) -> None:
    """rt.close() where the runtime has one (a plug-in may not)."""
    close = getattr(rt, "close", None)
    if callable(close):
        close()


@dataclass(frozen=True)
class TokenOnly:
    """What a runtime that exposes no logits returns from prefill/decode: the token it chose (an
    engine that takes text and gives text, as LiteRT-LM's). The step then holds no logits; the
    diff compares the tokens and lists the logits as not compared."""

    token: int


class ReportError(TraceToolError):
    """A report the probe refuses (unknown kind, wrong rows, ...): the driver adds where the plug-in made it."""


class WriterProbe:
    """A probe that streams the runtime's tensors into a TraceWriter's open step.

    Values are torch tensors in the model dtype; they are stored as float32 (bool and
    int kept) with the source dtype recorded.
    """

    def __init__(self, writer, runtime_name: str):
        self.w = writer
        self.runtime_name = runtime_name
        self.seen: set[tuple[str, int | None]] = set()
        self.last: tuple[str, int | None] | None = None  # the step's last report: what a crash came after
        self.limits: dict[str, int] | None = None  # values a row of each kind may hold (the header's, once)

    def tensor(self, kind: str, value, layer: int | None = None, positions=None, tower: str = S.TEXT) -> None:
        """Report one kind's rows for the open step. `tower`: an encoder tower's kind ("vision",
        "audio"), reported in the prefill, image after image (one call each, or one for all)."""
        if tower not in S.TOWER_BY_NAME:
            raise ReportError(
                f"runtime {self.runtime_name} reported {kind!r} of unknown tower {tower!r} "
                f"(towers: {', '.join(t.name for t in S.TOWERS)})"
            )
        key = S.kind_key(kind, tower)
        spec = S.KIND_BY_NAME.get(key)
        if spec is None or spec.tower != tower or key in DRIVER_KINDS:
            names = S.KIND_NAMES if tower == S.TEXT else [k.name for k in S.TOWER_BY_NAME[tower].kinds]
            allowed = ", ".join(k for k in names if k not in DRIVER_KINDS)
            where = "" if tower == S.TEXT else f" of the {tower} tower"
            raise ReportError(f"runtime {self.runtime_name} reported unknown kind {kind!r}{where} (known: {allowed})")
        try:
            S.Site(tower, kind, layer)
        except ValueError:
            raise ReportError(
                f"runtime {self.runtime_name} reported {key!r} with layer={layer}; {key} is {S.layer_rule(key)}"
            ) from None
        kind = key
        key = (kind, layer)
        if key in self.seen and not spec.encoder:  # an encoder's rows may come image by image
            raise ReportError(f"runtime {self.runtime_name} reported {kind!r} layer {layer} twice in one step")
        self.seen.add(key)
        source = str(getattr(value, "dtype", "float32")).removeprefix("torch.")
        self._check_size(kind, layer, value)  # before any copy: an expanded view can claim terabytes
        if hasattr(value, "detach"):
            value = value.detach()
            value = (value.float() if value.is_floating_point() else value).cpu().numpy()
        complex_tensor = hasattr(value, "is_complex") and value.is_complex()
        if (
            complex_tensor
            or isinstance(value, (str, bytes))
            or getattr(getattr(value, "dtype", None), "kind", "f") in "cOSUV"
        ):
            raise ReportError(
                f"runtime {self.runtime_name} reported {kind!r} layer {layer} as "
                f"{getattr(value, 'dtype', type(value).__name__)}; expected real numbers"
            )
        try:
            self.w.add(spec.name, value, layer=layer, source_dtype=source, positions=positions, tower=tower)
        except (ValueError, TypeError) as e:
            raise ReportError(f"runtime {self.runtime_name}: {one_line(e, 200)}") from None
        self.last = key

    def _check_size(self, kind: str, layer, value) -> None:
        spec = S.KIND_BY_NAME[kind]
        try:
            import numpy as np

            shape = tuple(int(d) for d in (value.shape if hasattr(value, "shape") else np.shape(value)))
        except (TypeError, ValueError):
            raise ReportError(
                f"runtime {self.runtime_name} reported {kind!r} as {type(value).__name__}, not a tensor"
            ) from None
        rows = row_count(spec, self.w.step_rows, 1, self.w.towers)
        if rows is None:  # an encoder tower the trace does not record: the writer says so
            return
        if self.limits is None:  # the trace's header is written before the first report
            self.limits = LIM.row_limits(self.w.model_config, self.w.layers, self.w.towers)
        limit = self.limits[kind] * rows
        n = 1
        for d in shape:
            n *= d
        if n > limit:
            raise ReportError(
                f"runtime {self.runtime_name} reported {kind!r} layer {layer} of shape {shape}: "
                f"{n} values, more than {rows} row(s) of {kind} may hold ({limit})"
            )

    def next_step(self) -> None:
        self.seen.clear()
        self.last = None


_HERE = os.path.dirname(os.path.abspath(__file__))
_DRIVER_FILES = {os.path.join(_HERE, f) for f in ("api.py", "core.py", "replay.py")}  # no plug-in's frames


def report(probe, kind: str, value, layer: int | None = None, positions=None, tower: str = S.TEXT):
    """Report `value` when a probe is on and return the tensor to continue with: `value`, or the
    probe's rows (REF's under --isolate). With probe None nothing runs.

        x = report(probe, "layer_out", x_rows, layer=i)
        p = report(probe, "layer_out", patch_rows, layer=i, tower="vision")
    """
    if probe is None:
        return value
    more = {} if positions is None else {"positions": positions}
    if tower != S.TEXT:  # a probe of the text tower alone (one whose tensor() takes no `tower`) is never asked
        if not takes_towers(probe):
            return value
        more["tower"] = tower
    got = probe.tensor(kind, value, layer, **more)
    return value if got is None else got


def takes_towers(probe) -> bool:
    """Does the probe's tensor() take a `tower` (or any keyword)? A text-only probe does not."""
    import inspect

    try:
        params = inspect.signature(probe.tensor).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "tower" or p.kind == p.VAR_KEYWORD for p in params)


def progress_words(last: tuple[str, int | None] | None) -> str:
    """What a runtime had reported in the step when it failed (a probe's or a child's `last`):
    "after layer 4 q", "before reporting anything"."""
    if last is None:
        return "before reporting anything"
    kind, layer = last
    return f"after {kind}" if layer is None else f"after layer {layer} {kind}"


def plugin_roots(spec: str, rt=None) -> list[str]:
    """The source files and folders that are the plug-in's own code: its factory's module, and
    its runtime class's module (a module in a package: the whole top-level package, unless the
    package is ours, as for the built-in extras)."""
    roots = []
    for name in (spec.partition(":")[0], type(rt).__module__ if rt is not None else None):
        module = sys.modules.get(name or "")
        top = sys.modules.get((name or "").split(".")[0])
        if module is None:
            continue
        if top is not None and top is not module and top.__name__ != "gemma4_trace" and getattr(top, "__path__", None):
            roots += [os.path.join(os.path.abspath(p), "") for p in top.__path__]  # a folder: its files
        elif getattr(module, "__file__", None):
            roots.append(os.path.abspath(module.__file__))
    return roots


def failure_site(e: BaseException, roots: list[str], inside_only: bool = False) -> str:
    """' at FILE:LINE' of the innermost frame of `e`'s traceback inside the plug-in's code (roots),
    else (unless inside_only) of the innermost frame outside the driver; the path relative to the
    current folder when it is below it."""
    inside = innermost = None
    if isinstance(e, SyntaxError) and e.filename:  # raised while compiling: no frame of the plug-in's own
        inside = (os.path.abspath(e.filename), e.lineno or 0)
    tb = e.__traceback__
    while tb is not None:
        site = (os.path.abspath(tb.tb_frame.f_code.co_filename), tb.tb_lineno)
        if site[0] not in _DRIVER_FILES:  # the frame that called the plug-in is no origin
            innermost = site
        if any(site[0] == r or (r.endswith(os.sep) and site[0].startswith(r)) for r in roots):
            inside = site
        tb = tb.tb_next
    site = inside or (None if inside_only else innermost)
    if site is None:
        return ""
    rel = os.path.relpath(site[0])
    return f" at {site[0] if rel.startswith('..') else rel}:{site[1]}"


def debug_traceback(e: BaseException) -> str:
    """The full traceback of `e` with its chain (what --debug prints)."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def as_logits(value, vocab: int, name: str, what: str):
    """A runtime's logits as a 1-D real tensor of `vocab` values, or a one-line error saying what came back."""
    import torch

    n = getattr(value, "numel", lambda: None)() if hasattr(value, "numel") else None
    if n is not None and n != vocab:  # checked before any copy (an expanded view can be huge)
        raise TraceToolError(
            f"runtime {name} returned logits of shape {tuple(value.shape)} from {what}; expected ({vocab},)"
        )
    try:
        t = torch.as_tensor(value).detach().reshape(-1) if value is not None else None
    except (TypeError, ValueError, RuntimeError, OverflowError):
        t = None
    if t is None or t.is_complex() or t.dtype == torch.bool or t.shape[0] != vocab:
        got = (
            "None"
            if value is None
            else (f"a {type(value).__name__}" if t is None else f"{t.dtype} of shape {tuple(t.shape)}")
        )
        raise TraceToolError(
            f"runtime {name} returned logits as {got} from {what}; expected real numbers of shape ({vocab},)"
        )
    return t


def load_factory(spec: str):
    """Import MODULE:FACTORY (only now, when named) and return the factory callable."""
    module_name, sep, attr = spec.partition(":")
    # like `python -m`: a module in the current folder is found without installing it
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # an import error of any kind inside the plug-in is the user's input
        raise TraceToolError(
            f"cannot import runtime plug-in module {module_name!r}"
            f"{failure_site(e, plugin_roots(spec))}: {type(e).__name__}: {one_line(e, 200)}"
        ) from e
    finally:
        if added:
            sys.path.remove(cwd)
    factory = getattr(module, attr, None)
    if factory is None:
        raise TraceToolError(f"runtime plug-in module {module_name!r} has no {attr!r} (the factory named in --runtime)")
    if not callable(factory):
        raise TraceToolError(
            f"runtime plug-in {module_name}:{attr} is not callable; it must be factory(loaded, max_seq)"
        )
    return factory


def check_runtime(rt, where: str):
    """Raise TraceToolError naming what a runtime object lacks."""
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(rt, m, None))]
    name = getattr(rt, "name", None)
    if not isinstance(name, str) or not name:
        missing.insert(0, "name (a non-empty str)")
    if missing:
        raise TraceToolError(f"runtime plug-in {where} returned {type(rt).__name__}, which lacks {', '.join(missing)}")
    return rt
