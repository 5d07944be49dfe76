"""What a trace or a model config may make the tool read or allocate (numbers only: no torch, no h5py).

A trace is untrusted input (docs/robustness.md, "Threat model"): every size it declares
is checked against these limits before anything of that size is read or allocated. The
caps sit far above every Gemma 4 model (35-62 layers, hidden <= 5376, vocab 262,144,
contexts <= 256K) and far below what would exhaust a machine.

`check_fits` compares an allocation's estimated bytes with the memory available
(`MemAvailable` of /proc/meminfo, or GEMMA4_TRACE_MEMORY_LIMIT); a run that cannot fit is
refused with one line giving the estimate and the limit, instead of allocating until the
kernel kills it. The estimates live next to what they estimate: the HF model and its
generate() in hf/memory.py, the static runtime in replayer/runtime.py.
"""

from __future__ import annotations

import math
import os

from .errors import TraceToolError, one_line
from .schema import KINDS, TOWER_BY_NAME

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
            value = float(text[:-1] if scale > 1 else text) * scale
            if not 0 < value < 1 << 62:  # inf, nan, a negative or absurd size: no limit anyone meant
                raise ValueError(text)
            return int(value)
        except ValueError:
            raise TraceToolError(f"{MEMORY_ENV}={one_line(text, 40)!r}: expected bytes such as 8G or 512M") from None
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


def text_config(cfg):
    """The text part of a config (a dict from config.json or an HF config)."""
    sub = cfg.get("text_config") if isinstance(cfg, dict) else getattr(cfg, "text_config", None)
    return sub if isinstance(sub, dict) or (sub is not None and not isinstance(cfg, dict)) else cfg


def step_bytes(cfg, layers, rows: int, tower_rows: dict[str, int] | None = None) -> int:
    """The most bytes one step of a replay may hand over at `rows` text rows: every kind of every
    layer at row_limits' widths (a mask `rows` keys wide), K and V twice (a step graph returns its
    caches too), 8 bytes a value; and each encoder tower's kinds at its rows (`tower_rows`: {name:
    rows}, its sizes read from `cfg`). What a child may send the parent in one message is bounded
    by it (replayer/child.py)."""
    from .layers import TowerInfo, tower_sizes

    towers = {}
    for name in tower_rows or {}:
        sizes = tower_sizes(cfg, TOWER_BY_NAME[name])
        if sizes and len(sizes) == 4:
            towers[name] = TowerInfo(name, **sizes, item_rows=(), item_tokens=())
    per = row_limits(cfg, layers, towers, keys=rows)
    n = max(1, len(layers))
    total = sum(per[k.name] * (n if k.per_layer else 1) * (2 if k.name in ("k", "v") else 1) * rows for k in KINDS)
    for name, info in towers.items():
        total += (
            sum(per[k.key] * (info.layers if k.per_layer else 1) for k in TOWER_BY_NAME[name].kinds)
            * (tower_rows[name])
        )
    return 8 * total


def row_limits(cfg, layers, towers=None, keys: int | None = None) -> dict[str, int]:
    """Values one row of each kind may hold: ROW_SLACK times what the model config, the per-layer
    metadata and the encoder tower table (`towers`: {name: TowerInfo}) say. Widths need not match (a
    runtime reporting a wrong width is a `shape` divergence for the diff), but a width no config
    justifies is refused before anything is read or copied. `keys`: a mask row's width where it is
    known (a replay's max_seq); else the largest a trace may have."""
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
    width = {
        "hidden": hidden,
        "ple": ple,
        "layers": max(1, len(layers)),
        "heads": heads,
        "head_dim": hd,
        "vocab": vocab,
        "keys": keys or MAX_POSITIONS // ROW_SLACK,
        "model_hidden": hidden,
    }
    per = {k.name: math.prod(width[a.width] for a in k.axes) for k in KINDS}
    for name, info in (towers or {}).items():
        own = width | {"hidden": info.hidden, "heads": info.heads, "head_dim": info.head_dim, "layers": info.layers}
        per |= {k.key: math.prod(own[a.width] for a in k.axes) for k in TOWER_BY_NAME[name].kinds}
    return {k: ROW_SLACK * v for k, v in per.items()}
