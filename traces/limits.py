"""What a trace or a model config may make the tool read or allocate (numbers only: no torch, no h5py).

A trace is untrusted input (docs/robustness.md, "Threat model"): every size it declares
is checked against these limits before anything of that size is read or allocated. The
caps sit far above every Gemma 4 model (35-62 layers, hidden <= 5376, vocab 262,144,
contexts <= 256K) and far below what would exhaust a machine.

Before a model, a static runtime or a generation cache is allocated, its bytes are
estimated from the config and compared with the memory available (`MemAvailable` of
/proc/meminfo, or GEMMA4_TRACE_MEMORY_LIMIT); a run that cannot fit is refused with one
line giving the estimate and the limit, instead of allocating until the kernel kills it.
"""

from __future__ import annotations

import math
import os

from .errors import TraceToolError
from .schema import KINDS

MAX_LAYERS = 512
MAX_HEADS = 1024
MAX_HEAD_DIM = 8192
MAX_HIDDEN = 1 << 17
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 20  # prompt + max_new_tokens: 4x Gemma 4's longest context
ROW_SLACK = 4  # a row may be this many times wider than the config says (a runtime bug stays a `shape` divergence)
MAX_CHUNK_BYTES = 64 << 20  # one chunk is decompressed whole; the writer makes 1 MiB chunks
MAX_ATTR_BYTES = 16 << 20  # one attribute (the prompt text of a MAX_POSITIONS prompt fits)
MAX_ATTRS = 64  # attributes on one object (the root holds 13)
MAX_EXTRA_INPUTS = 64
# all datasets together may declare at most this many times the file's size (gzip's best ratio is
# about 1000:1; a real trace declares 1-10x its size, masks included), or MIN_DECLARED whatever the file
EXPANSION = 64
MIN_DECLARED = 256 << 20
MEMORY_ENV = "GEMMA4_TRACE_MEMORY_LIMIT"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def memory_limit() -> int | None:
    """Bytes the tool may allocate: GEMMA4_TRACE_MEMORY_LIMIT (e.g. 4G) if set, else MemAvailable."""
    text = os.environ.get(MEMORY_ENV, "").strip()
    if text:
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:].upper(), 1)
        try:
            return int(float(text[:-1] if scale > 1 else text) * scale)
        except ValueError:
            raise TraceToolError(f"{MEMORY_ENV}={text!r}: expected bytes such as 8G or 512M") from None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None  # unknown (not Linux): no refusal


def check_fits(nbytes: int, what: str) -> None:
    """Refuse, as one line, an allocation the machine's available memory cannot hold."""
    limit = memory_limit()
    if limit is not None and nbytes > limit:
        raise TraceToolError(
            f"{what} needs about {fmt_bytes(nbytes)} of memory, more than the {fmt_bytes(limit)} available "
            f"({'set by ' + MEMORY_ENV if os.environ.get(MEMORY_ENV) else 'MemAvailable'}); "
            "use a shorter run or a machine with more memory"
        )


def _get(cfg, key: str, default=0):
    """A config value from a dict or an HF config object; non-numbers count as the default."""
    try:
        v = cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    except Exception:  # noqa: BLE001 - HF configs raise on per-layer fields read globally (head_dim)
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return default
    return max(0, int(v)) if v == v and abs(v) != float("inf") else default


def text_config(cfg):
    """The text part of a config (a dict from config.json or an HF config)."""
    sub = cfg.get("text_config") if isinstance(cfg, dict) else getattr(cfg, "text_config", None)
    return sub if isinstance(sub, dict) or (sub is not None and not isinstance(cfg, dict)) else cfg


def _dims(cfg) -> dict:
    t = text_config(cfg)
    hidden = _get(t, "hidden_size", 0)
    heads = _get(t, "num_attention_heads", 1) or 1
    try:  # per-layer head_dim (Gemma 4's full layers are wider)
        per_layer = t.get("per_layer_config") if isinstance(t, dict) else getattr(t, "per_layer_config", None)
        entries = list(per_layer.values() if isinstance(per_layer, dict) else per_layer or [])
        layer_hd = max([_get(e, "head_dim", 0) for e in entries] or [0])
    except Exception:  # noqa: BLE001 - an odd per_layer_config just gives no per-layer sizes
        layer_hd = 0
    return dict(
        V=_get(t, "vocab_size", 0), H=hidden, L=_get(t, "num_hidden_layers", 0), heads=heads,
        kv=_get(t, "num_key_value_heads", heads) or heads,
        hd=max(_get(t, "head_dim", 0), _get(t, "global_head_dim", 0), layer_hd) or (hidden // heads if heads else 0),
        I=_get(t, "intermediate_size", 0), ple=_get(t, "hidden_size_per_layer_input", 0),
        Vple=_get(t, "vocab_size_per_layer_input", 0) or _get(t, "vocab_size", 0),
        E=_get(t, "num_experts", 0), Imoe=_get(t, "moe_intermediate_size", 0),
    )


def model_bytes(cfg, dtype_bytes: int) -> int:
    """A lower estimate of a Gemma 4 model's weights (text decoder only) from its config."""
    d = _dims(cfg)
    attention = d["H"] * d["hd"] * (2 * d["heads"] + 2 * d["kv"])
    mlp = 3 * d["H"] * d["I"] + 3 * d["E"] * d["H"] * d["Imoe"]
    params = d["V"] * d["H"] + d["Vple"] * d["L"] * d["ple"] + d["L"] * (attention + mlp)
    return params * dtype_bytes


def static_runtime_bytes(cfg, max_seq: int, dtype_bytes: int) -> int:
    """What the static runtime allocates beyond the weights for `max_seq`: all layers' KV caches,
    RoPE tables, and one prefill chunk (its masks, attention scores over max_seq keys, activations)."""
    d, s = _dims(cfg), int(max_seq)
    chunk = s if s < 1024 else 256  # the runtime's default prefill chunk (rows of one prefill pass)
    caches = d["L"] * 2 * d["kv"] * s * d["hd"] * dtype_bytes
    masks = 4 * chunk * s  # a step's masks, computed from positions, and their temporaries
    rope = 4 * s * d["hd"] * (4 + dtype_bytes)
    scores = 3 * d["heads"] * chunk * s * max(dtype_bytes, 4)
    activations = chunk * (4 * d["H"] + 3 * d["I"] + d["L"] * d["ple"]) * max(dtype_bytes, 4)
    return caches + masks + rope + scores + activations


def generation_bytes(cfg, prompt_len: int, positions: int, dtype_bytes: int) -> int:
    """HF generate() while recording: a KV cache for `positions`, the prefill's attention scores
    and activations over the prompt (the recorder keeps one step's tensors)."""
    d = _dims(cfg)
    caches = d["L"] * 2 * d["kv"] * int(positions) * d["hd"] * dtype_bytes
    scores = 3 * d["heads"] * prompt_len * prompt_len * max(dtype_bytes, 4)
    activations = prompt_len * (4 * d["H"] + 3 * d["I"] + d["L"] * d["ple"]) * max(dtype_bytes, 4)
    recorded = prompt_len * d["L"] * (prompt_len + (d["heads"] + 2 * d["kv"]) * d["hd"] * 4 + 2 * d["H"] * 4)
    return caches + scores + activations + recorded


def row_limits(cfg, layers) -> dict[str, int]:
    """Values one row of each kind may hold: ROW_SLACK times what the model config and the per-layer
    metadata say. Widths need not match (a runtime reporting a wrong width is a `shape` divergence
    for the diff), but a width no config justifies is refused before anything is read or copied."""
    t = text_config(cfg) if isinstance(cfg, dict) else {}
    t = t if isinstance(t, dict) else {}

    def size(key, cap):
        v = t.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= cap else cap

    hidden = size("hidden_size", MAX_HIDDEN)
    ple = size("hidden_size_per_layer_input", hidden)
    vocab = size("vocab_size", MAX_VOCAB)
    hd = max([li.head_dim for li in layers] or [MAX_HEAD_DIM])
    heads = max([li.num_heads for li in layers] or [MAX_HEADS])
    width = {"hidden": hidden, "ple": ple, "layers": max(1, len(layers)), "heads": heads, "head_dim": hd,
             "vocab": vocab, "keys": MAX_POSITIONS // ROW_SLACK}
    per = {k.name: math.prod(width[a.width] for a in k.axes) for k in KINDS}
    return {k: ROW_SLACK * v for k, v in per.items()}


def check_config(cfg, where: str) -> None:
    """Refuse a config whose sizes no Gemma 4 has (before anything is built from it)."""
    d = _dims(cfg)
    for key, value, cap in (("num_hidden_layers", d["L"], MAX_LAYERS), ("hidden_size", d["H"], MAX_HIDDEN),
                            ("vocab_size", d["V"], MAX_VOCAB), ("num_attention_heads", d["heads"], MAX_HEADS),
                            ("head_dim", d["hd"], MAX_HEAD_DIM)):
        if value > cap:
            raise TraceToolError(f"{where}: {key} is {value}, more than this tool accepts ({cap})")
