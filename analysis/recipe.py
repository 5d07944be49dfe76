"""Precision recipes: which quantizable units of a quantized static runtime run at which precision.

A recipe is a TOML file (written by `trace precision`, read by `trace replay --recipe`):

    runtime = "static-w4g32"          # the scheme every other unit gets

    [units]
    "layer.1" = "float"               # a whole decoder layer
    "layer.3.mlp" = "static-w8"       # a module group: qkv, o, mlp, ple
    "ple_model_proj" = "float"        # the model's per-layer-input projection

A module unit's entry wins over its layer's. Precisions: "float" or a quantized runtime's
name (replayer/quant.py SCHEMES). Unit names and precisions are validated on read and on write.

For llama.cpp, `runtime = "llama.cpp:Q4_K_M"` (a quantized GGUF type) and the precisions are
"float" or GGUF type names ("Q8_0", ...): the units' tensors come from that type's file
(replayer/runtimes/llamacpp/gguf_mixed.py); `trace precision` also writes the recipe as
llama-quantize options.

A recipe is untrusted input: it is bounded before it is parsed (size, dotted-key depth), as a
tolerances file is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.replayer.runtimes.registry import (
    RUNTIMES,
    parse_runtime,
    quantized_names,
    recipe_runtime,
    typed_recipe_choice,
)
from gemma4_trace.traces.atomic import atomic_output
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import read_toml

UNIT_RE = re.compile(r"^(layer\.(0|[1-9][0-9]{0,5})(\.(qkv|o|mlp|ple))?|ple_model_proj)$")
SCHEME_NAMES = tuple(n for n in quantized_names() if ":" not in n)  # the quantized static runtimes (torch-free)
PRECISIONS = ("float", *SCHEME_NAMES)
MAX_RECIPE_BYTES = 1 << 20
MAX_UNITS = 100_000  # a unit per layer and module group of a very deep model, and then some
TYPED_NAMES = " or ".join(
    f"{s.name}:TYPE with TYPE one of {', '.join(s.types[1:])}" for s in RUNTIMES if s.recipe and s.types
)


def unit_types(choice) -> tuple:
    """The types a unit of a recipe over NAME:TYPE may take: all but the first, the float the
    runtime converts to (llama.cpp: F16 ... Q3_K_M, not F32)."""
    return choice.spec.types[1:]


def precisions_of(runtime: str) -> tuple:
    """The precisions a recipe over `runtime` may give a unit."""
    typed = typed_recipe_choice(runtime)
    return ("float", *unit_types(typed)) if typed is not None else PRECISIONS


@dataclass
class Recipe:
    runtime: str
    units: dict = field(default_factory=dict)  # unit -> precision

    def check(self) -> Recipe:
        typed = typed_recipe_choice(self.runtime) if isinstance(self.runtime, str) else None
        if not (self.runtime in SCHEME_NAMES or (typed is not None and typed.type in unit_types(typed))):
            raise TraceToolError(
                f"recipe runtime {one_line(repr(self.runtime), 100)} is not a quantized runtime "
                f"({', '.join(SCHEME_NAMES)}, or {TYPED_NAMES})"
            )
        known = precisions_of(self.runtime)
        for unit, precision in self.units.items():
            if not isinstance(unit, str) or not UNIT_RE.match(unit):
                raise TraceToolError(
                    f"recipe unit {one_line(repr(unit), 100)}: "
                    "expected layer.N, layer.N.qkv|o|mlp|ple or ple_model_proj"
                )
            if precision not in known:
                raise TraceToolError(
                    f"recipe unit {unit}: unknown precision {one_line(repr(precision), 100)}; known: {', '.join(known)}"
                )
        return self

    def to_toml(self, comments: list[str] = ()) -> str:
        self.check()
        lines = [f"# {one_line(c)}" for c in comments if c] + [f"runtime = {json.dumps(self.runtime)}", "", "[units]"]
        lines += [
            f"{json.dumps(u)} = {json.dumps(p)}" for u, p in sorted(self.units.items(), key=lambda kv: _unit_key(kv[0]))
        ]
        return "\n".join(lines) + "\n"


def _unit_key(unit: str):
    parts = unit.split(".")
    return (int(parts[1]), parts[2] if len(parts) > 2 else "") if parts[0] == "layer" else (1 << 30, unit)


def load_recipe(path) -> Recipe:
    """A recipe file, read bounded (traces/inputs.py: a regular file of at most MAX_RECIPE_BYTES,
    keys of bounded depth) and checked."""
    p = Path(path)
    data = read_toml(p, "recipe", MAX_RECIPE_BYTES)
    unknown = set(data) - {"runtime", "units"}
    if unknown:
        raise TraceToolError(
            f"recipe {p}: unknown key {one_line(sorted(unknown)[0], 100)!r} (expected runtime and [units])"
        )
    units = data.get("units", {})
    if not isinstance(data.get("runtime"), str) or not isinstance(units, dict):
        raise TraceToolError(f'recipe {p}: expected runtime = "static-..." and a [units] table')
    if len(units) > MAX_UNITS:
        raise TraceToolError(f"recipe {p}: {len(units)} units, more than the {MAX_UNITS} allowed")
    return Recipe(data["runtime"], dict(units)).check()


def write_recipe(recipe: Recipe, path, force: bool = False, comments: list[str] = ()) -> None:
    text = recipe.to_toml(comments)
    with atomic_output(path, force) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def recipe_factory(runtime: str, recipe: Recipe):
    """`make(loaded, max_seq)` for `trace replay --recipe` (replayer/replay.py): the quantized static
    runtime `runtime`, or llama.cpp:TYPE on the recipe's mixed-precision GGUF, with the recipe's
    units at their precisions."""
    if runtime != recipe.runtime:
        raise TraceToolError(f"the recipe is for --runtime {recipe.runtime}, not {runtime}")

    def make(loaded, max_seq: int):
        return recipe_runtime(parse_runtime(runtime), loaded, max_seq, recipe.units)

    return make


def write_quantize_options(runner, recipe: Recipe, recipe_path, force: bool = False) -> Path:
    """llama.cpp: the recipe as llama-quantize options, beside the recipe (NAME.llama-quantize.txt)."""
    from gemma4_trace.replayer.runtimes.llamacpp.gguf_mixed import resolve

    cfg = resolve(runner.mixed, recipe.units, runner.gguf_type)
    path = Path(recipe_path).with_suffix(".llama-quantize.txt")
    name = one_line(Path(recipe_path).name)  # a newline or ESC in the name stays inside the comment
    lines = [
        f"# {name} ({recipe.runtime}) as llama-quantize options: each --tensor-type is a regex",
        "# searched in the tensor names, the first match wins. Use (options without these comment lines):",
        f"# llama-quantize OPTIONS model-f32.gguf model-mixed.gguf {runner.gguf_type}",
        *runner.mixed.quantize_options(cfg),
    ]
    with atomic_output(path, force) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def weight_bytes(rt, scheme_name: str, recipe: dict | None) -> int:
    """Bytes of the quantizable weights under a recipe: b-bit integers plus one float32 scale
    per output row and group for a quantized unit; the model dtype's size for a float one."""
    from gemma4_trace.replayer.quant import SCHEMES, resolve_precision, weight_units

    total = 0
    for layer_unit, module_unit, owner, name in weight_units(rt):
        w = owner._buffers[name]
        precision = resolve_precision(recipe, scheme_name, layer_unit, module_unit)
        if precision == "float":
            total += w.numel() * w.element_size()
            continue
        s = SCHEMES[precision]
        k = w.shape[-1]
        groups = 1 if s.group is None else -(-k // s.group)
        total += w.numel() * s.weight_bits // 8 + (w.numel() // k) * groups * 4
    return total
