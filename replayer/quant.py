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

import ctypes
import functools
import logging
import mmap
import sys
import threading
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
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


class QuantizedWeight(torch.Tensor):
    """A weight held once: its integers (int8 storage, int4 values too) and one float32 scale
    per output row and group, dequantized whenever a torch function uses it (F.linear, an
    expert's slice, ...), so a quantized runtime holds no float copy of its weights.

    The values a use sees are quantize_weight's, bit for bit: torchao's dequantization of a
    symmetric scheme is float32(q) * scale (its zero point is 0), and so is this one.
    """

    @staticmethod
    def __new__(cls, q: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=q.device)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype):
        self.q = q  # (rows, groups, group) int8, rows = prod(shape[:-1]), the last group zero-padded
        self.scale = scale  # (rows, groups, 1) float32

    def __repr__(self) -> str:
        return f"QuantizedWeight(shape={tuple(self.shape)}, dtype={self.dtype}, groups={self.q.shape[1]})"

    def _values(self, q: torch.Tensor, scale: torch.Tensor, lead: tuple, out: torch.Tensor | None = None):
        # float32(q) * scale, as torchao's dequantization, in two vectorized in-place passes
        x = torch.empty(q.shape, dtype=torch.float32, device=q.device) if out is None else out.view(q.shape)
        x.copy_(q).mul_(scale)
        k = self.shape[-1]
        x = x.flatten(-2)
        if x.shape[-1] != k:
            x = x[..., :k]
        return x.reshape(*lead, k).to(self.dtype)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float values; `out` (float32, q's size): where to write them."""
        return self._values(self.q, self.scale, tuple(self.shape[:-1]), out)

    def _rows(self, index) -> torch.Tensor:
        """self[index] for an index on the first dimension: only those rows dequantized."""
        lead, (_, groups, group) = tuple(self.shape[:-1]), self.q.shape
        q = self.q.view(*lead, groups, group)[index]
        scale = self.scale.view(*lead, groups, 1)[index]
        return self._values(q, scale, tuple(q.shape[:-2]))

    def _scratch(self) -> torch.Tensor:
        """A float32 buffer of q's size, reused by every weight of that size in this thread: F.linear's
        weight lives only during the call (the output is a new tensor), so no page is touched twice."""
        pool = _SCRATCH.__dict__.setdefault("pool", {})
        key = (tuple(self.q.shape), self.q.device)
        buf = pool.get(key)
        if buf is None:
            buf = pool[key] = torch.empty(self.q.shape, dtype=torch.float32, device=self.q.device)
        return buf

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.__getitem__ and type(args[0]) is cls and _first_dim_index(args[1]):
            return args[0]._rows(args[1])
        if func is F.linear and len(args) >= 2 and type(args[1]) is cls and not isinstance(args[0], cls):
            w = args[1]
            return func(args[0], w.dequantize(w._scratch()), *args[2:], **kwargs)
        args, kwargs = pytree.tree_map_only(cls, cls.dequantize, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, cls.dequantize, (args, kwargs or {}))
        return func(*args, **kwargs)


_SCRATCH = threading.local()
_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.element_size,
}


def _first_dim_index(index) -> bool:
    if isinstance(index, int):
        return True
    return (
        isinstance(index, torch.Tensor)
        and index.dim() <= 1
        and not index.is_floating_point()
        and index.dtype != torch.bool
    )


def _int_weight(w: torch.Tensor, bits: int, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (rows, groups, group) int8, scale (rows, groups, 1) float32) of a weight (..., out, in).

    torchao's symmetric affine quantization (choose_qparams_affine, quantize_affine) step for
    step, with its default eps (float32's smallest normal) and its rounding (x times the
    reciprocal of the scale, round half to even), in fewer passes over the weight;
    tests/test_quant.py checks the values against torchao's own, bit for bit.
    """
    k = w.shape[-1]
    rows = w.detach().reshape(-1, k).float()
    g = k if group is None else group
    pad = (-k) % g
    if pad:
        rows = F.pad(rows, (0, pad))
    x = rows.view(rows.shape[0], -1, g)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo, hi = torch.aminmax(x, dim=-1, keepdim=True)
    bound = torch.maximum(-torch.clamp(lo, max=0), torch.clamp(hi, min=0))
    scale = torch.clamp(bound / (float(qmax - qmin) / 2), min=torch.finfo(torch.float32).smallest_normal)
    t = x * (1.0 / scale)
    q = t.round_().clamp_(qmin, qmax).to(torch.int8)
    return q, scale


def quantize_weight(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """Quantize-dequantize a weight (..., out, in): symmetric, one scale per output row and group.

    A last group shorter than `group` (in % group != 0) keeps its own scale: the rows are
    zero-padded to a multiple of the group, which changes no group's max-abs.
    """
    return hold_quantized(w, bits, group).dequantize()


def hold_quantized(w: torch.Tensor, bits: int, group: int | None) -> QuantizedWeight:
    """w quantized (as quantize_weight) and held as integers and scales."""
    q, s = _int_weight(w, bits, group)
    return QuantizedWeight(q, s, w.shape, w.dtype)


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


def quantize_(rt, scheme_name: str, recipe: dict | None = None, cache: dict | None = None, release: bool = False):
    """Turn a StaticGemma4Runtime (or a subclass) into its quantized variant, in place.

    Each quantized weight's buffer is rebound to a QuantizedWeight (integers and scales, no
    float copy). `recipe` {unit: precision} (units: weight_units; precisions: PRECISIONS)
    overrides the scheme per unit, a module unit before its layer's: "float" keeps the unit
    unquantized. `cache` (a dict the caller keeps): quantized weights reused across runtimes of
    one model. The HF weights are not touched, unless `release`: the model serves this runtime
    only (`trace replay`), and each float weight's memory is freed once it is quantized (the HF
    module is unusable after), so the replay holds every weight once.
    """
    scheme = SCHEMES.get(scheme_name)
    if scheme is None:
        raise TraceToolError(f"unknown quantized runtime {scheme_name!r}; known: {', '.join(SCHEMES)}")
    if recipe:
        check_recipe(rt, recipe)
    units = [(owner, name, SCHEMES[p]) for p, owner, name in _plan(rt, scheme_name, recipe) if p != FLOAT]
    pending, keep = _releasable(rt, units) if release else (Counter(), set())
    act_weights = []
    with torch.no_grad():
        for owner, name, s in units:
            w = owner._buffers[name]
            held = isinstance(w, QuantizedWeight)
            if held:  # quantized twice: from the values it holds (a temporary: never a cache key)
                w = w.dequantize()
            key = None if held or cache is None else (w.data_ptr(), tuple(w.shape), s.weight_bits, s.group)
            q = cache.get(key) if key is not None else None
            if q is None:
                q = hold_quantized(w, s.weight_bits, s.group)
                if key is not None:
                    cache[key] = q
            setattr(owner, name, q)
            if release and not held:
                pending[_storage(w)] -= 1
                if not pending[_storage(w)] and _storage(w) not in keep:
                    _free(w)
            if s.act_int8:
                act_weights.append(q)
    from .runtime import StaticGemma4Runtime

    own = StaticGemma4Runtime.name  # a subclass of another name (a bug-zoo port) keeps its own, plus the scheme
    base = getattr(type(rt), "name", own)
    rt.name = scheme_name if base == own else f"{base}+{scheme_name.removeprefix(own + '-')}"
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


def _plan(rt, scheme_name: str, recipe: dict | None):
    for layer_unit, module_unit, owner, name in weight_units(rt):
        yield resolve_precision(recipe, scheme_name, layer_unit, module_unit), owner, name


def _releasable(rt, units) -> tuple[Counter, set]:
    """(how many units use each float storage, the storages the runtime keeps computing with
    as float: norms, embeddings, float units): a storage is freed after its last unit, if kept
    by nothing."""
    floats = [owner._buffers[name] for owner, name, _ in units]
    pending = Counter(_storage(w) for w in floats if not isinstance(w, QuantizedWeight))
    quantized = {(id(owner), name) for owner, name, _ in units}
    keep = {
        _storage(b)
        for m in rt.modules()
        for n, b in m._buffers.items()
        if b is not None and (id(m), n) not in quantized and not isinstance(b, QuantizedWeight)
    }
    return pending, keep


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _free(w: torch.Tensor) -> None:
    """Free a float weight's memory: a storage of its own is resized to nothing (the HF
    parameter on it is unusable after); a weight read in place from the checkpoint's file
    mapping (safetensors) has its pages dropped from this process (they read back from the file
    if touched again)."""
    storage = w.untyped_storage()
    if storage.resizable():
        storage.resize_(0)
    else:
        _drop_pages(storage.data_ptr(), storage.nbytes())


def _drop_pages(address: int, size: int) -> None:
    """madvise(MADV_DONTNEED) on the whole pages inside [address, address + size) (Linux)."""
    if sys.platform != "linux":
        return
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


def _with_mode(fn, weights):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _Int8LinearInputs(weights):
            return fn(*args, **kwargs)

    return wrapped


def make_quantized(loaded, max_seq: int, scheme_name: str, recipe: dict | None = None):
    """The built-in quantized runtime `scheme_name` (a key of SCHEMES), optionally per a recipe;
    the float weights freed as they are quantized when the model serves this runtime only
    (LoadedModel.single_use)."""
    from .runtime import StaticGemma4Runtime

    rt = StaticGemma4Runtime(loaded, max_seq)
    return quantize_(rt, scheme_name, recipe, release=getattr(loaded, "single_use", False))


def create(loaded, max_seq: int, choice):
    """`--runtime static-w8 | static-w4g32 | static-w8a8` (replayer/runtimes/registry.py)."""
    from .ops import check_fits

    check_fits(loaded, max_seq)
    return make_quantized(loaded, max_seq, choice.name)


def from_recipe(loaded, max_seq: int, choice, units: dict):
    """A precision recipe's runtime (the registry's `recipe` facet): the scheme `choice` names."""
    return make_quantized(loaded, max_seq, choice.text, units)
