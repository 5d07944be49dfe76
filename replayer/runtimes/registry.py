"""The built-in runtimes: one `RuntimeSpec` row each, and `--runtime TEXT` parsed once.

Everything that asks "which runtimes exist" or "does this one support X" reads this table: the
`--runtime` help, the README's runtime table (tests/test_registry.py checks that they agree),
the early refusals (an unknown name, a missing extra, `--isolate`, an image for a text-only
runtime, a bfloat16 REF for a float32-only one, `--device cuda` for a CPU-only one) and the
replay driver. A row names its factory as "module:function" and nothing here imports torch, so
the command line reads the table before anything heavy loads. A built-in factory is

    create(loaded: LoadedModel, max_seq: int, choice: RuntimeChoice) -> runtime

(the plug-in contract, docs/runtime-api.md, plus the parsed choice). Adding a runtime: its
module under replayer/runtimes/, its row here, its pyproject extra, its docs page.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass, field, replace

from gemma4_trace.traces.errors import TraceToolError, install_hint

from . import captures as C

RT = "gemma4_trace.replayer.runtimes"  # where the adapters live
# llama.cpp's own type names of the GGUF files a replay can run (replayer/runtimes/llamacpp/gguf_writer.py
# maps them to llama_ftype values); F32 is what the project's writer converts to
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M")


@dataclass(frozen=True)
class RuntimeSpec:
    """What one built-in runtime is, needs and can do."""

    name: str  # the --runtime name ("llama.cpp"; with `types`, "llama.cpp:Q8_0" too)
    # (third_party below: an adapter to another project's engine, whose failures are one line naming
    # the adapter's code, as a plug-in's are; the project's own runtimes' failures are its bugs)
    factory: str  # "module:function", imported only when the runtime is made
    what: str  # what runs (the README table's second column)
    precision: str
    extra: str | None = None  # the pip extra that installs what it needs
    needs: tuple[str, ...] = ()  # importable modules it needs (checked with importlib.util.find_spec)
    tools: tuple[tuple[str, str], ...] = ()  # (program on PATH it needs, how to install it)
    types: tuple[str, ...] = ()  # ":TYPE" suffixes it takes; the first is the default
    isolation: bool = False  # continues with the tensors the probe returns (--isolate)
    text_only: bool = False  # takes token ids only: an image prompt is refused before the model loads
    float32_only: bool = False  # a bfloat16 REF is refused before the model loads
    cpu_only: bool = False  # --device cuda is refused before the model loads
    weightless: bool = False  # never computes with HF's weights: the model is built without them
    profile: str | None = None  # its float tolerance profile (diff/profiles/NAME.toml), where its kernels need one
    export: str | None = None  # the command that writes its artifacts
    artifacts: str = ""  # what it builds (kept in the artifact cache)
    doc: str | None = None  # its docs page
    recipe: bool = False  # a quantized runtime a precision recipe (trace precision) can vary
    baseline: str | None = None  # the runtime whose trace is its natural --baseline
    third_party: bool = True  # False: the project's own runtime (static and its quantized variants)
    # what its adapter reads from its engine, as which kinds (captures.py): what it captures is derived from it
    capture_map: C.CaptureMap = field(kw_only=True)

    @property
    def not_captured(self) -> tuple[str, ...]:
        """The canonical kinds it cannot expose (absent, never zeros): those its capture map lacks."""
        return self.capture_map.not_captured()

    def kinds_text(self) -> str:
        return self.capture_map.text()


_QUANT = dict(extra="quant", needs=("torchao",), isolation=True, recipe=True, third_party=False, capture_map=C.PROBE)
_EXECUTORCH = dict(extra="executorch", needs=("executorch",), float32_only=True, cpu_only=True, export="export-pte")
_EXECUTORCH["capture_map"] = C.STEP_GRAPH

RUNTIMES: tuple[RuntimeSpec, ...] = (
    RuntimeSpec(
        "static",
        "gemma4_trace.replayer.runtime:create",
        "the project's static-shape PyTorch Gemma 4 (fixed max_seq, preallocated KV, chunked prefill)",
        "REF's dtype (float32 or bfloat16)",
        isolation=True,
        third_party=False,
        capture_map=C.PROBE,
    ),
    *(
        RuntimeSpec(
            name,
            "gemma4_trace.replayer.quant:create",
            f"the static runtime with quantize-dequantized Linear weights ({scheme})",
            "quantized (simulated)",
            doc="docs/quantized.md",
            **_QUANT,
        )
        for name, scheme in (
            ("static-w8", "int8"),
            ("static-w4g32", "int4 in groups of 32"),
            ("static-w8a8", "int8 weights and dynamic int8 activations"),
        )
    ),
    RuntimeSpec(
        "tico",
        f"{RT}.tico:create",
        "TICO's own static Gemma 4 runtime (its PTQ wrappers)",
        "float",
        extra="tico",
        needs=("tico",),
        doc="docs/runtime-tico.md",
        capture_map=C.TICO,
    ),
    RuntimeSpec(
        "tico-quant",
        f"{RT}.tico:create",
        "the same in TICO's fake-quant mode (int16), calibrated on REF's prompt",
        "quantized (simulated)",
        extra="tico",
        needs=("tico",),
        doc="docs/runtime-tico.md",
        capture_map=C.TICO,
    ),
    RuntimeSpec(
        "onnx",
        f"{RT}.onnx:create",
        "the static runtime's steps exported to ONNX, run by onnxruntime (CPU)",
        "float32",
        extra="onnx",
        needs=("onnxruntime", "onnx", "onnxscript"),
        float32_only=True,
        export="export-onnx",
        artifacts="prefill/decode .onnx",
        doc="docs/runtime-onnx.md",
        capture_map=C.STEP_GRAPH,
    ),
    RuntimeSpec(
        "llama.cpp",
        f"{RT}.llamacpp.runtime:create",
        "llama.cpp on the project's GGUF conversion, TYPE `F32` (default) ... `Q3_K_M`",
        "float (F32, F16, BF16) or quantized (llama.cpp's kernels)",
        extra="llamacpp",
        needs=("llama_cpp", "gguf"),
        types=GGUF_TYPES,
        text_only=True,
        float32_only=True,
        weightless=True,
        capture_map=C.LLAMACPP,
        profile="llamacpp-f32",
        export="export-gguf",
        artifacts=".gguf files",
        doc="docs/runtime-llamacpp.md",
        recipe=True,
        baseline="static --weights-from",
    ),
    RuntimeSpec(
        "executorch",
        f"{RT}.executorch:create",
        "the static runtime's steps lowered to ExecuTorch's XNNPACK backend, run by `executorch.runtime`",
        "float32",
        profile="executorch-f32",
        artifacts=".pte programs",
        doc="docs/runtime-executorch.md",
        **_EXECUTORCH,
    ),
    RuntimeSpec(
        "executorch-int8",
        f"{RT}.executorch:create",
        "the same, PT2E int8 (XNNPACKQuantizer) calibrated on REF's prompt, XNNPACK's int8 kernels",
        "quantized",
        artifacts=".pte programs",
        doc="docs/runtime-executorch.md",
        baseline="executorch-int8-reference",
        **_EXECUTORCH,
    ),
    RuntimeSpec(
        "executorch-int8-reference",
        f"{RT}.executorch:create",
        "that converted PT2E int8 program run by PyTorch before lowering (its `--baseline`)",
        "quantized (simulated)",
        artifacts="converted .pt2 programs",
        doc="docs/runtime-executorch.md",
        **_EXECUTORCH,
    ),
    RuntimeSpec(
        "mobius",
        f"{RT}.mobius:create",
        "mobius-onnx's own ONNX Gemma 4 text decoder (not traced from PyTorch), run by onnxruntime (CPU)",
        "float32",
        extra="mobius",
        needs=("mobius", "onnxruntime", "onnx_ir"),
        text_only=True,
        float32_only=True,
        capture_map=C.MOBIUS,
        artifacts="model.onnx",
        doc="docs/runtime-mobius.md",
    ),
)
_LITERT = dict(
    extra="litert",
    needs=("litert_torch", "ai_edge_litert", "litert_quantizer"),
    text_only=True,
    float32_only=True,
    cpu_only=True,
    weightless=True,
    export="export-litert",
    doc="docs/runtime-litert.md",
    capture_map=C.LITERT,
)
_LITERT_QUANT = {
    "litert-int8": "litert-quantizer's `dynamic_wi8_afp32` (int8 weights, dynamic int8 activations)",
    "litert-wi8": "litert-quantizer's `weight_only_wi8_afp32` (int8 weights, float activations)",
    "litert-int4": "litert-quantizer's `dynamic_wi4_afp32` (int4 weights, dynamic int8 activations)",
}
RUNTIMES += (
    RuntimeSpec(
        "litert",
        f"{RT}.litert.runtime:create",
        "REF's checkpoint exported by litert-torch's Gemma 4 path, run by ai-edge-litert (XNNPACK, CPU)",
        "float32",
        profile="litert-f32",
        artifacts=".tflite files, .litertlm",
        **_LITERT,
    ),
    *(
        RuntimeSpec(
            name,
            f"{RT}.litert.runtime:create",
            f"the same, model.tflite quantized with {recipe}",
            "quantized",
            artifacts="quantized model.tflite",
            baseline=f"{name}-dq",
            **_LITERT,
        )
        for name, recipe in _LITERT_QUANT.items()
    ),
    *(
        RuntimeSpec(
            f"{name}-dq",
            f"{RT}.litert.runtime:create",
            f"the float model.tflite with {name}'s quantized weights dequantized into it (its `--baseline`)",
            "quantized weights, float32 kernels",
            artifacts="model.tflite",
            **_LITERT,
        )
        for name in _LITERT_QUANT
    ),
    RuntimeSpec(
        "litert-lm",
        f"{RT}.litert.lm:create",
        "LiteRT-LM's engine (CPU, greedy) on the .litertlm litert-torch exports from REF's checkpoint, or "
        "`--litertlm FILE`; text in and out",
        "float32 (or the file's)",
        extra="litert",
        needs=("litert_lm", "litert_torch"),
        text_only=True,
        float32_only=True,
        cpu_only=True,
        weightless=True,
        capture_map=C.TOKENS_ONLY,
        artifacts=".litertlm",
        doc="docs/runtime-litert.md",
    ),
    RuntimeSpec(
        "litert-convert",
        f"{RT}.litert.convert:create",
        "transformers' own Gemma 4 forward converted by `litert_torch.convert`, run by ai-edge-litert "
        "(whole sequence per step)",
        "float32",
        artifacts="converted .tflite",
        **{**_LITERT, "export": None, "capture_map": C.HF_FORWARD},
    ),
)
_OPENVINO = dict(
    extra="openvino",
    float32_only=True,
    cpu_only=True,
    export="export-openvino",
    doc="docs/runtime-openvino.md",
    capture_map=C.STEP_GRAPH,
)
_OPENVINO_QUANT = {"openvino-int8": "INT8_ASYM", "openvino-int4": "INT4_SYM in groups of 32"}
RUNTIMES += (
    RuntimeSpec(
        "openvino",
        f"{RT}.openvino:create",
        "the static runtime's steps converted to OpenVINO IR, compiled for OpenVINO's CPU plugin (f32)",
        "float32",
        needs=("openvino",),
        profile="openvino-f32",
        artifacts="prefill/decode IR (.xml, .bin)",
        **_OPENVINO,
    ),
    *(
        RuntimeSpec(
            name,
            f"{RT}.openvino:create",
            f"the same IR with NNCF weight compression {scheme}, the CPU plugin's compressed-weight kernels",
            "quantized weights, activations dynamically int8 in those kernels",
            needs=("openvino", "nncf"),
            artifacts="compressed IR",
            baseline=f"{name}-dq",
            **_OPENVINO,
        )
        for name, scheme in _OPENVINO_QUANT.items()
    ),
    *(
        RuntimeSpec(
            f"{name}-dq",
            f"{RT}.openvino:create",
            f"{name}'s IR with its weight decompression folded into float32 weights (its `--baseline`)",
            "quantized weights, float32 kernels",
            needs=("openvino", "nncf"),
            artifacts="folded IR",
            **_OPENVINO,
        )
        for name in _OPENVINO_QUANT
    ),
)
_MLX = dict(
    extra="mlx",
    needs=("mlx", "mlx_lm"),
    text_only=True,
    float32_only=True,
    cpu_only=True,
    weightless=True,
    capture_map=C.MLX,
    tools=(("g++", "MLX compiles its CPU kernels with it; install it (Debian/Ubuntu: apt install g++)"),),
    doc="docs/runtime-mlx.md",
)
RUNTIMES += (
    RuntimeSpec(
        "mlx",
        f"{RT}.mlx:create",
        "REF's checkpoint loaded by mlx-lm, run through its own Gemma 4 modules and caches (MLX, CPU)",
        "float32",
        profile="mlx-f32",
        **_MLX,
    ),
    *(
        RuntimeSpec(
            f"mlx-q{bits}",
            f"{RT}.mlx:create",
            f"the same, quantized by mlx-lm's quantize_model ({bits}-bit affine, group size 64)",
            "quantized",
            baseline=f"mlx-q{bits}-dq",
            **_MLX,
        )
        for bits in (8, 4)
    ),
    *(
        RuntimeSpec(
            f"mlx-q{bits}-dq",
            f"{RT}.mlx:create",
            f"mlx-q{bits}'s weights dequantized into float32 layers (its `--baseline`)",
            "quantized weights, float32 kernels",
            **_MLX,
        )
        for bits in (8, 4)
    ),
)
BY_NAME = {s.name: s for s in RUNTIMES}
PLUGIN = "MODULE:FACTORY"


def captures(capture: frozenset[str] | None, kind: str) -> bool:
    """Whether a runtime asked to capture `capture` (RuntimeChoice.capture: None every kind, empty
    none) exposes `kind`; logits always (they are every step's result)."""
    return capture is None or kind == "logits" or kind in capture


@dataclass(frozen=True)
class RuntimeChoice:
    """`--runtime TEXT` parsed: a built-in (its row, and its type where it takes one) or a plug-in."""

    text: str
    spec: RuntimeSpec | None = None  # None: a plug-in
    type: str | None = None  # the ":TYPE" of a runtime with types (its default when not given)
    # the kinds the replay keeps (`--kinds`, with_capture): an adapter whose capture costs by what
    # it exposes (a graph's extra outputs, an interpreter keeping every tensor, hooks) exposes only
    # these; None: every kind; empty: none (tokens and logits only, the runtime alone)
    capture: frozenset[str] | None = None

    @property
    def name(self) -> str:
        """The built-in's name, or the plug-in's MODULE:FACTORY."""
        return self.spec.name if self.spec is not None else self.text

    @property
    def plugin(self) -> bool:
        return self.spec is None

    @property
    def gguf(self) -> bool:
        """A runtime on GGUF files of a type (llama.cpp:TYPE): its precision recipes are mixed GGUF files."""
        return self.spec is not None and bool(self.spec.types)

    @property
    def foreign_code(self) -> str | None:
        """What a failure inside the runtime names (a plug-in's MODULE:FACTORY, a third-party
        adapter's name); None for the project's own runtimes, whose failures are its bugs."""
        return self.text if self.spec is None or self.spec.third_party else None

    def captures(self, kind: str) -> bool:
        """Whether the replay keeps `kind` (logits always: they are every step's result)."""
        return captures(self.capture, kind)

    def with_capture(self, kinds) -> RuntimeChoice:
        """This choice asked to capture only `kinds` (None: every kind; a Selection's kinds)."""
        return replace(self, capture=None if kinds is None else frozenset(kinds) - {"logits", "token"})

    def __str__(self) -> str:
        return self.text


def names_text() -> str:
    """Every built-in name, for help and errors: "static, static-w8, ..., llama.cpp[:TYPE], ..."."""
    return ", ".join(s.name + ("[:TYPE]" if s.types else "") for s in RUNTIMES)


def parse_runtime(text) -> RuntimeChoice:
    """`--runtime TEXT` -> a RuntimeChoice, or one line saying what is wrong with it: an unknown
    name (with the nearest built-in), an unknown type, a MODULE:FACTORY of bad syntax. Nothing is
    imported or looked up (check_available does that)."""
    if isinstance(text, RuntimeChoice):
        return text
    text = str(text)
    name, sep, rest = text.partition(":")
    spec = BY_NAME.get(text) or (BY_NAME.get(name) if sep else None)
    if spec is not None and (spec.name == text or spec.types):
        if not spec.types:
            return RuntimeChoice(text, spec)
        gguf_type = rest if sep else spec.types[0]
        if gguf_type not in spec.types:
            raise TraceToolError(f"unknown GGUF type {gguf_type!r}; expected one of {', '.join(spec.types)}")
        return RuntimeChoice(text, spec, gguf_type)
    if not sep:
        near = difflib.get_close_matches(text, list(BY_NAME), n=1)
        raise TraceToolError(
            f"--runtime {text!r} is not a runtime"
            + (f" (did you mean {near[0]!r}?)" if near else "")
            + f": expected {', '.join(BY_NAME)} or {PLUGIN} (e.g. my_pkg.rt:make_runtime)"
        )
    if not all(part.isidentifier() for part in name.split(".")) or not rest.isidentifier():
        raise TraceToolError(
            f"--runtime {text!r}: {PLUGIN} needs a dotted module name and a function name (e.g. my_pkg.rt:make_runtime)"
        )
    return RuntimeChoice(text)


def check_available(choice, isolate: bool = False) -> RuntimeChoice:
    """Refuse, before any model loads, a runtime that cannot run here: a built-in whose extra is not
    installed, --isolate where it cannot work, a plug-in whose top-level module is not found. Nothing
    is imported (a plug-in's own checks run when it is loaded)."""
    choice = parse_runtime(choice)
    spec = choice.spec
    if spec is None:
        _check_plugin_module(choice.text)
        return choice
    missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise TraceToolError(
            f"--runtime {spec.name} needs {', '.join(missing)}, which is not installed: {install_hint(spec.extra)}"
        )
    for program, how in spec.tools:
        if shutil.which(program) is None:
            raise TraceToolError(f"--runtime {spec.name} needs {program}, which is not on PATH: {how}")
    if isolate and not spec.isolation:
        raise TraceToolError(
            f"runtime {spec.name} does not support --isolate (it does not continue with the tensors "
            "the probe returns); the static runtimes do"
        )
    return choice


def check_capture(choice: RuntimeChoice, kinds) -> None:
    """Refuse, before the model loads, kinds asked of a built-in (`--kinds`) that it cannot capture."""
    if choice.spec is not None:
        choice.spec.capture_map.check(kinds, f"runtime {choice.spec.name}")


def check_inputs(choice: RuntimeChoice, *, dtype: str | None = None, extra=None, device: str | None = None) -> None:
    """Refuse, before the model loads, a REF this runtime cannot replay: an image for a text-only
    runtime, a bfloat16 REF for a float32-only one, a GPU for a CPU-only one."""
    spec = choice.spec
    if spec is None:
        return
    if spec.text_only and extra:
        raise TraceToolError(
            f"--runtime {spec.name} runs a text decoder, which takes token ids only; "
            "REF's prompt has an image: replay a text prompt"
        )
    if spec.float32_only and dtype is not None and dtype != "float32":
        raise TraceToolError(f"--runtime {spec.name} runs in float32; REF was recorded in {dtype}")
    if spec.cpu_only and device not in (None, "cpu"):
        raise TraceToolError(f"--runtime {spec.name} runs on the CPU; drop --device")


def _check_plugin_module(text: str) -> None:
    module_name = text.partition(":")[0]
    top = module_name.split(".")[0]
    cwd = os.getcwd()  # found as the replay will import it: the current folder first
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
            f"cannot import runtime plug-in module {module_name!r} (--runtime {text!r}): no module "
            f"{top!r} is installed or in the current folder"
        )


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")


def quantized_runtime(name: str) -> RuntimeSpec | None:
    """The registry row of a trace's provenance runtime name when that runtime quantizes (static-w8,
    llama.cpp:Q8_0, mlx-q4, a recipe's static-w8+recipe, a quantized plug-in's bug+w8: the static
    scheme's row), else None: a float runtime, or a name the registry does not know."""
    base, *marks = str(name).split("+")
    for m in marks:
        if _SCHEME_MARK.fullmatch(m):
            return BY_NAME.get(f"static-{m}", BY_NAME["static-w8"])
    try:
        choice = parse_runtime(base)
    except TraceToolError:
        return None
    spec = choice.spec
    if spec is None:
        return None
    if spec.types:
        return spec if choice.type not in FLOAT_GGUF_TYPES else None
    return spec if spec.precision.startswith("quantized") else None


_SCHEME_MARK = re.compile(r"w\d+(?:g\d+)?(?:a\d+)?")  # a static scheme in a derived name: bug+w8, x+w4g32


def exporter(command: str) -> RuntimeSpec:
    """The runtime whose artifacts `trace COMMAND` writes (its row's `export`)."""
    return next(s for s in RUNTIMES if s.export == command)


def check_export(command: str) -> RuntimeSpec:
    """Refuse `trace COMMAND` (an export) in one line when what its runtime needs is not installed."""
    spec = exporter(command)
    missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise TraceToolError(
            f"trace {command} needs {', '.join(missing)}, which is not installed: {install_hint(spec.extra)}"
        )
    return spec


def quantized_names() -> list[str]:
    """The runtimes a precision recipe can vary, as --runtime takes them (llama.cpp:TYPE, quantized types)."""
    out = []
    for s in RUNTIMES:
        if s.recipe:
            out += [f"{s.name}:{t}" for t in s.types if t.startswith("Q")] if s.types else [s.name]
    return out


def help_text() -> str:
    """The `--runtime` help of `trace replay`."""
    return f"{names_text()}, or {PLUGIN} of a plug-in runtime (see the README's runtime table)"


def markdown_table() -> str:
    """The README's table of built-in runtimes (tests/test_registry.py keeps the README equal to it)."""
    lines = [
        "| `--runtime` | what runs | precision | kinds captured | `--isolate` | extra; built artifacts (cached) |",
        "|---|---|---|---|---|---|",
    ]
    for s in RUNTIMES:
        name = f"`{s.name}[:TYPE]`" if s.types else f"`{s.name}`"
        what = s.what + (f", {s.doc}" if s.doc else "")
        extra = "none" if s.extra is None else f"`{s.extra}`" + (f"; {s.artifacts}" if s.artifacts else "")
        lines.append(
            f"| {name} | {what} | {s.precision} | {s.kinds_text()} | {'yes' if s.isolation else 'no'} | {extra} |"
        )
    lines.append(
        f"| `{PLUGIN}` | your runtime (plug-in), docs/runtime-api.md | yours | what it reports | "
        "when it continues with the tensors the probe returns | yours |"
    )
    return "\n".join(lines)
