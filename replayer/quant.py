"""Quantized static runtimes: `--runtime static-w8 | static-w4g32 | static-w8a8`.

The static runtime with its Linear weights replaced by quantize-dequantize copies made
with torchao's affine primitives (the optional `quant` extra), and for `-a8` a dynamic
int8 quantize-dequantize of every quantized Linear's input. This simulates the numerics
of a quantized port (int weights times float scales, accumulation in the model dtype)
without int kernels, so it runs on any CPU and every canonical tensor stays comparable.

What is quantized: in every decoder layer q/k/v/o, gate/up/down, the PLE gate and
projection and the MoE experts; the model's per-layer-input projection. What is not, as
in common int8/int4 recipes: embeddings, the (tied) LM head, norms, the MoE router.
Activations (-a8) are quantized at the input of every quantized F.linear; the MoE
experts' einsum path (decode) and per-expert slices take float activations.

    rt = quantize_(StaticGemma4Runtime(loaded, max_seq), "static-w8")
    rt = quantize_(SomeBuggyRuntime(loaded, max_seq), "static-w4g32")   # a bug on top
    rt = quantize_(StaticGemma4Runtime(loaded, max_seq), "static-w8", {"layer.1": "float"})  # a recipe

A recipe maps units (weight_units: `layer.N`, `layer.N.qkv|o|mlp|ple`, `ple_model_proj`) to a
precision ("float" or a SCHEMES name); `trace precision` writes one, `trace replay --recipe`
runs it (analysis/recipe.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gemma4_trace.traces.errors import TraceToolError, install_hint


@dataclass(frozen=True)
class Scheme:
    weight_bits: int  # symmetric signed integers: int8 -128..127, int4 -8..7
    group: int | None  # inputs sharing one scale; None: one scale per output channel
    act_int8: bool  # dynamic per-token symmetric int8 at each quantized Linear's input

    def describe(self) -> str:
        g = "per output channel" if self.group is None else f"groups of {self.group}"
        a = ", dynamic int8 activations per token" if self.act_int8 else ""
        return f"int{self.weight_bits} weights ({g}){a}"


SCHEMES = {
    "static-w8": Scheme(8, None, False),
    "static-w4g32": Scheme(4, 32, False),
    "static-w8a8": Scheme(8, None, True),
}
LAYER_WEIGHTS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "ple_gate",
    "ple_proj",
    "experts_gate_up",
    "experts_down",
)
MODEL_WEIGHTS = ("ple_model_proj",)


@functools.cache
def _ao():
    """torchao's quant primitives, imported on first use; silence its CUDA-library warnings."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        from torchao.quantization import quant_primitives as qp
    except ImportError:
        raise TraceToolError(f"the quantized runtimes need torchao: {install_hint('quant')}") from None
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)
    return qp


def _fake_quant(x: torch.Tensor, block: tuple, qmin: int, qmax: int, eps=None) -> torch.Tensor:
    qp = _ao()
    s, z = qp.choose_qparams_affine(x, qp.MappingType.SYMMETRIC, block, torch.int8, qmin, qmax, eps)
    q = qp.quantize_affine(x, block, s, z, torch.int8, qmin, qmax)
    return qp.dequantize_affine(q, block, s, z, torch.int8, qmin, qmax, output_dtype=x.dtype)


def quantize_weight(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """Quantize-dequantize a weight (..., out, in): symmetric, one scale per output row and group.

    A last group shorter than `group` (in % group != 0) keeps its own scale: the rows are
    zero-padded to a multiple of the group, which changes no group's max-abs.
    """
    k = w.shape[-1]
    rows = w.detach().reshape(-1, k).float()
    g = k if group is None else group
    pad = (-k) % g
    if pad:
        rows = F.pad(rows, (0, pad))
    out = _fake_quant(rows, (1, g), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return out[:, :k].reshape(w.shape).to(w.dtype)


def quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8 (-127..127, SmoothQuant / torchao recipe), dequantized."""
    block = (1,) * (x.dim() - 1) + (x.shape[-1],)
    return _fake_quant(x, block, -127, 127, eps=1e-5)


class _Int8LinearInputs(TorchFunctionMode):
    """While active, F.linear with one of `weights` gets its input quantized first."""

    def __init__(self, weights):
        super().__init__()
        self.ids = {id(w) for w in weights}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and id(args[1]) in self.ids:
            args = (quantize_activation(args[0]), *args[1:])
        return func(*args, **kwargs)


# quantizable units: a layer ("layer.3"), a module group of a layer ("layer.3.qkv"), or the
# model's per-layer-input projection ("ple_model_proj"); a recipe maps units to precisions
MODULE_OF = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "experts_gate_up": "mlp",
    "experts_down": "mlp",
    "ple_gate": "ple",
    "ple_proj": "ple",
}
MODULES = ("qkv", "o", "mlp", "ple")
FLOAT = "float"
PRECISIONS = (FLOAT, *SCHEMES)


def weight_units(rt) -> list[tuple[str, str, object, str]]:
    """(layer unit, module unit, owner module, buffer name) of every quantizable weight of rt."""
    out = []
    for i, L in enumerate(rt.layers):
        for name in LAYER_WEIGHTS:
            if name in L._buffers:
                out.append((f"layer.{i}", f"layer.{i}.{MODULE_OF[name]}", L, name))
    for name in MODEL_WEIGHTS:
        if name in rt._buffers:
            out.append((name, name, rt, name))
    return out


def resolve_precision(recipe: dict | None, default: str, layer_unit: str, module_unit: str) -> str:
    """A weight's precision: its module unit's entry, else its layer unit's, else the runtime's."""
    recipe = recipe or {}
    return recipe.get(module_unit, recipe.get(layer_unit, default))


def check_recipe(rt, recipe: dict) -> None:
    known = {u for lu, mu, _, _ in weight_units(rt) for u in (lu, mu)}
    for unit, precision in recipe.items():
        if unit not in known:
            raise TraceToolError(
                f"recipe unit {unit!r} is not a quantizable unit of this model "
                f"(e.g. layer.0, layer.0.qkv, layer.0.o, layer.0.mlp, layer.0.ple, ple_model_proj)"
            )
        if precision not in PRECISIONS:
            raise TraceToolError(f"recipe unit {unit}: unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")


def quantize_(rt, scheme_name: str, recipe: dict | None = None, cache: dict | None = None):
    """Turn a StaticGemma4Runtime (or a subclass) into its quantized variant, in place.

    The HF weights are not touched: the runtime's buffers are rebound to new tensors.
    `recipe` {unit: precision} (units: weight_units; precisions: PRECISIONS) overrides the
    scheme per unit, a module unit before its layer's: "float" keeps the unit unquantized.
    `cache` (a dict the caller keeps): quantized weights reused across runtimes of one model.
    """
    scheme = SCHEMES.get(scheme_name)
    if scheme is None:
        raise TraceToolError(f"unknown quantized runtime {scheme_name!r}; known: {', '.join(SCHEMES)}")
    if recipe:
        check_recipe(rt, recipe)
    act_weights = []
    with torch.no_grad():
        for layer_unit, module_unit, owner, name in weight_units(rt):
            precision = resolve_precision(recipe, scheme_name, layer_unit, module_unit)
            if precision == FLOAT:
                continue
            s = SCHEMES[precision]
            w = owner._buffers[name]
            key = (w.data_ptr(), tuple(w.shape), s.weight_bits, s.group)
            q = cache.get(key) if cache is not None else None
            if q is None:
                q = quantize_weight(w, s.weight_bits, s.group)
                if cache is not None:
                    cache[key] = q
            setattr(owner, name, q)
            if s.act_int8:
                act_weights.append(owner._buffers[name])
    base = getattr(type(rt), "name", "static")
    rt.name = scheme_name if base == "static" else f"{base}+{scheme_name.removeprefix('static-')}"
    if recipe:
        rt.name += "+recipe"
    rt.quant_scheme = scheme
    rt.quant_recipe = dict(recipe or {})
    if act_weights:
        # instance attributes shadow the class's prefill/decode: the whole call, including
        # any subclass's overrides below it, runs with int8 Linear inputs
        for method in ("prefill", "decode"):
            setattr(rt, method, _with_mode(getattr(rt, method), act_weights))
    return rt


def _with_mode(fn, weights):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _Int8LinearInputs(weights):
            return fn(*args, **kwargs)

    return wrapped


def make_quantized(loaded, max_seq: int, scheme_name: str, recipe: dict | None = None):
    """The built-in quantized runtime `scheme_name` (a key of SCHEMES), optionally per a recipe."""
    from .runtime import StaticGemma4Runtime

    return quantize_(StaticGemma4Runtime(loaded, max_seq), scheme_name, recipe)


def create(loaded, max_seq: int, choice):
    """`--runtime static-w8 | static-w4g32 | static-w8a8` (replayer/runtimes/registry.py)."""
    from .ops import check_fits

    check_fits(loaded, max_seq)
    return make_quantized(loaded, max_seq, choice.name)
