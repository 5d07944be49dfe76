"""The runtime plug-in API: what `trace replay --runtime MODULE:FACTORY` expects.

A plug-in module exposes a factory

    def factory(loaded: gemma4_trace.hf.model.LoadedModel, max_seq: int) -> runtime

and the runtime it returns has

    name: str                                                    # recorded as provenance "runtime"
    prefill(input_ids, extra_inputs, probe) -> logits            # input_ids (T,) long tensor,
                                                                 # extra_inputs {name: tensor}, logits (vocab,)
    decode(token_id: int, position: int, probe) -> logits        # one token at `position`, logits (vocab,)

`max_seq` is the static length to build for; the driver guarantees prompt + max_new_tokens
<= max_seq and never reads a `max_seq` back from the runtime. The runtime reports
canonical tensors (traces.schema.KINDS, except logits and token, which the driver writes)
through `probe.tensor(kind, value, layer=None, positions=None)` (positions: the absolute
positions of the rows reported, when a runtime has only some of a step's rows) or `report()`;
`probe` may be None, and then nothing may be computed for it. The driver makes one runtime per
replay; a plug-in's exception becomes one line naming its file:line and the step's last
report (`--debug` prints the chain). See docs/runtime-api.md.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line

REQUIRED_METHODS = ("prefill", "decode")
DRIVER_KINDS = ("logits", "token")  # written by the replay driver, never by a runtime
QUANTIZED_RUNTIMES = ("static-w8", "static-w4g32", "static-w8a8")  # built in, need torchao
# built-in names of runtimes whose code needs an optional extra (imported only when named)
EXTRA_RUNTIMES = {
    "tico": "gemma4_trace.replayer.tico_runtime:make_tico",  # gemma4-trace[tico]
    "tico-quant": "gemma4_trace.replayer.tico_runtime:make_tico_quant",
    "onnx": "gemma4_trace.replayer.onnx_runtime:make_onnx",  # gemma4-trace[onnx]
    "mobius": "gemma4_trace.replayer.mobius_runtime:make_mobius",  # gemma4-trace[mobius]
    "executorch": "gemma4_trace.replayer.executorch_runtime:make_executorch",  # gemma4-trace[executorch]
    "executorch-int8": "gemma4_trace.replayer.executorch_runtime:make_executorch_int8",
    "executorch-int8-reference": "gemma4_trace.replayer.executorch_runtime:make_executorch_int8_reference",
}
# llama.cpp[:TYPE] (gemma4-trace[llamacpp]): matched before MODULE:FACTORY, whose colon it shares
LLAMACPP_RUNTIME = "llama.cpp"


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

    def tensor(self, kind: str, value, layer: int | None = None, positions=None) -> None:
        spec = S.KIND_BY_NAME.get(kind)
        if spec is None or kind in DRIVER_KINDS:
            allowed = ", ".join(k for k in S.KIND_NAMES if k not in DRIVER_KINDS)
            raise ReportError(f"runtime {self.runtime_name} reported unknown kind {kind!r} (known: {allowed})")
        if (layer is None) == spec.per_layer:
            raise ReportError(
                f"runtime {self.runtime_name} reported {kind!r} with layer={layer}; "
                f"{kind} is {'per layer' if spec.per_layer else 'global (layer=None)'}"
            )
        key = (kind, layer)
        if key in self.seen:
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
            self.w.add(kind, value, layer=layer, source_dtype=source, positions=positions)
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
        rows = 1 if spec.index == "step" else self.w.step_rows
        limit = LIM.row_limits(self.w.model_config, self.w.layers)[kind] * rows
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


_DRIVER_FILES = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay.py")}


def report(probe, kind: str, value, layer: int | None = None, positions=None):
    """Report `value` when a probe is on and return the tensor to continue with: `value`, or the
    probe's rows (REF's under --isolate). With probe None nothing runs.

        x = report(probe, "layer_out", x_rows, layer=i)
    """
    if probe is None:
        return value
    got = (
        probe.tensor(kind, value, layer) if positions is None else probe.tensor(kind, value, layer, positions=positions)
    )
    return value if got is None else got


def progress_words(probe) -> str:
    """What a runtime had reported in the step when it failed: "after layer 4 q"."""
    last = getattr(probe, "last", None)
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
    if not sep or not module_name or not attr:
        raise TraceToolError(
            f"--runtime {spec!r}: expected 'static', {', '.join(QUANTIZED_RUNTIMES + tuple(EXTRA_RUNTIMES))}, "
            f"{LLAMACPP_RUNTIME}[:TYPE] or MODULE:FACTORY (e.g. my_pkg.rt:make_runtime)"
        )
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


# what a built-in runtime needs installed (module names: importlib.util.find_spec) and how to get it
_NEEDS = {
    "static-w8": ("torchao",),
    "static-w4g32": ("torchao",),
    "static-w8a8": ("torchao",),
    "tico": ("tico",),
    "tico-quant": ("tico",),
    "onnx": ("onnxruntime", "onnx", "onnxscript"),
    "mobius": ("mobius", "onnxruntime", "onnx_ir"),
    "executorch": ("executorch",),
    "executorch-int8": ("executorch", "torchao"),
    "executorch-int8-reference": ("executorch", "torchao"),
    LLAMACPP_RUNTIME: ("llama_cpp", "gguf"),
}
_EXTRA_OF = {
    "torchao": "quant",
    "tico": "tico",
    "onnxruntime": "onnx",
    "onnx": "onnx",
    "onnxscript": "onnx",
    "llama_cpp": "llamacpp",
    "gguf": "llamacpp",
    "mobius": "mobius",
    "onnx_ir": "mobius",
    "executorch": "executorch",
}
_NO_ISOLATION = (
    "tico",
    "tico-quant",
    "onnx",
    "mobius",
    "executorch",
    "executorch-int8",
    "executorch-int8-reference",
    LLAMACPP_RUNTIME,
)  # built-ins that do not continue with the probe's tensors

_TEXT_ONLY = ("mobius",)  # built-ins whose graphs take token ids only (no image inputs)


def check_runtime_inputs(spec: str, extra: dict) -> None:
    """Refuse, before the model loads or any graph is built, REF's image inputs for a built-in
    that takes token ids only (a runtime factory is given the model, never REF's inputs)."""
    if spec in _TEXT_ONLY and extra:
        raise TraceToolError(
            f"--runtime {spec} runs a text decoder, which takes token ids only; "
            "REF's prompt has an image: replay a text prompt"
        )


def check_runtime_name(spec: str, isolate: bool = False) -> None:
    """Refuse, before any model loads, a --runtime that cannot work: an unknown name (a typo,
    with the nearest built-in), a MODULE:FACTORY of bad syntax or whose top-level module is not
    found, a built-in whose extra is not installed, --isolate with a built-in that does not
    support it. Nothing is imported (a plug-in's own checks run when it is loaded)."""
    import difflib
    import importlib.util

    names = ("static", *QUANTIZED_RUNTIMES, *EXTRA_RUNTIMES, LLAMACPP_RUNTIME)
    if spec == LLAMACPP_RUNTIME or spec.startswith(LLAMACPP_RUNTIME + ":"):
        from .gguf_writer import check_type  # numpy only

        if ":" in spec:
            check_type(spec.partition(":")[2])
        spec = LLAMACPP_RUNTIME
    if spec in names:
        missing = [m for m in _NEEDS.get(spec, ()) if importlib.util.find_spec(m) is None]
        if missing:
            extra = _EXTRA_OF.get(missing[0], "")
            raise TraceToolError(
                f"--runtime {spec} needs {', '.join(missing)}, which is not installed"
                + (f": {install_hint(extra)}" if extra else "")
            )
        if isolate and spec in _NO_ISOLATION:
            raise TraceToolError(
                f"runtime {spec} does not support --isolate (it does not continue with the tensors "
                "the probe returns); the static runtimes do"
            )
        return
    module_name, sep, attr = spec.partition(":")
    if not sep:
        near = difflib.get_close_matches(spec, names, n=1)
        raise TraceToolError(
            f"--runtime {spec!r} is not a runtime"
            + (f" (did you mean {near[0]!r}?)" if near else "")
            + f": expected {', '.join(names)} or MODULE:FACTORY (e.g. my_pkg.rt:make_runtime)"
        )
    if not all(part.isidentifier() for part in module_name.split(".")) or not attr.isidentifier():
        raise TraceToolError(
            f"--runtime {spec!r}: MODULE:FACTORY needs a dotted module name and a function name "
            "(e.g. my_pkg.rt:make_runtime)"
        )
    top = module_name.split(".")[0]
    cwd = os.getcwd()  # found like load_factory finds it: the current folder first
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        if added:
            sys.path.remove(cwd)
    if not found:
        raise TraceToolError(
            f"cannot import runtime plug-in module {module_name!r} (--runtime {spec!r}): no module "
            f"{top!r} is installed or in the current folder"
        )


def check_runtime(rt, where: str):
    """Raise TraceToolError naming what a runtime object lacks."""
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(rt, m, None))]
    name = getattr(rt, "name", None)
    if not isinstance(name, str) or not name:
        missing.insert(0, "name (a non-empty str)")
    if missing:
        raise TraceToolError(f"runtime plug-in {where} returned {type(rt).__name__}, which lacks {', '.join(missing)}")
    return rt


def make_runtime(spec: str, loaded, max_seq: int):
    """'static' or MODULE:FACTORY -> a runtime object that follows the API."""
    if spec == "static" or spec in QUANTIZED_RUNTIMES:  # refuse what cannot fit before allocating it
        dtype_bytes = 2 if "16" in str(getattr(loaded, "dtype", "float32")) else 4
        from .runtime import memory_estimate

        LIM.check_fits(
            memory_estimate(loaded.text_config, max_seq, dtype_bytes), f"the static runtime for max_seq {max_seq}"
        )
    if spec == "static":
        from .runtime import StaticGemma4Runtime

        return StaticGemma4Runtime(loaded, max_seq)
    if spec in QUANTIZED_RUNTIMES:  # the static runtime with quantized weights (replayer/quant.py)
        from .quant import make_quantized

        return make_quantized(loaded, max_seq, spec)
    if spec == LLAMACPP_RUNTIME or spec.startswith(LLAMACPP_RUNTIME + ":"):
        from .llamacpp_runtime import make_llamacpp, parse_spec

        return check_runtime(make_llamacpp(parse_spec(spec))(loaded, max_seq), spec)
    spec = EXTRA_RUNTIMES.get(spec, spec)
    factory = load_factory(spec)
    try:
        rt = factory(loaded, max_seq)
    except TraceToolError:
        raise
    except (Exception, SystemExit) as e:  # sys.exit() in a plug-in must not end the replay as a success
        raise TraceToolError(
            f"runtime plug-in {spec} failed to start{failure_site(e, plugin_roots(spec))}: "
            f"{type(e).__name__}: {one_line(e, 200)}"
        ) from e  # --debug prints the chain
    return check_runtime(rt, spec)
