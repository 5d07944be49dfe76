"""Memory estimates of an HF Gemma 4 model and of its generate() while recording (numbers only:
no torch), and the config sizes this tool accepts; traces/limits.py compares an estimate with
the memory available (`check_fits`)."""

from __future__ import annotations

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.limits import MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_VOCAB, text_config


def _get(cfg, key: str, default=0):
    """A config value from a dict or an HF config object; non-numbers count as the default."""
    try:
        v = cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    except Exception:  # noqa: BLE001 - HF configs raise on per-layer fields read globally (head_dim)
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return default
    return max(0, int(v)) if v == v and abs(v) != float("inf") else default


def config_dims(cfg) -> dict:
    """The sizes the estimates use, from a config dict or an HF config (0 where absent)."""
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
        V=_get(t, "vocab_size", 0),
        H=hidden,
        L=_get(t, "num_hidden_layers", 0),
        heads=heads,
        kv=_get(t, "num_key_value_heads", heads) or heads,
        hd=max(_get(t, "head_dim", 0), _get(t, "global_head_dim", 0), layer_hd) or (hidden // heads if heads else 0),
        I=_get(t, "intermediate_size", 0),
        ple=_get(t, "hidden_size_per_layer_input", 0),
        Vple=_get(t, "vocab_size_per_layer_input", 0) or _get(t, "vocab_size", 0),
        E=_get(t, "num_experts", 0),
        Imoe=_get(t, "moe_intermediate_size", 0),
    )


def model_bytes(cfg, dtype_bytes: int) -> int:
    """A lower estimate of a Gemma 4 model's weights (text decoder only) from its config."""
    d = config_dims(cfg)
    attention = d["H"] * d["hd"] * (2 * d["heads"] + 2 * d["kv"])
    mlp = 3 * d["H"] * d["I"] + 3 * d["E"] * d["H"] * d["Imoe"]
    params = d["V"] * d["H"] + d["Vple"] * d["L"] * d["ple"] + d["L"] * (attention + mlp)
    return params * dtype_bytes


def generation_bytes(cfg, prompt_len: int, positions: int, dtype_bytes: int) -> int:
    """HF generate() while recording: a KV cache for `positions`, the prefill's attention scores
    and activations over the prompt (the recorder keeps one step's tensors)."""
    d = config_dims(cfg)
    caches = d["L"] * 2 * d["kv"] * int(positions) * d["hd"] * dtype_bytes
    scores = 3 * d["heads"] * prompt_len * prompt_len * max(dtype_bytes, 4)
    activations = prompt_len * (4 * d["H"] + 3 * d["I"] + d["L"] * d["ple"]) * max(dtype_bytes, 4)
    recorded = prompt_len * d["L"] * (prompt_len + (d["heads"] + 2 * d["kv"]) * d["hd"] * 4 + 2 * d["H"] * 4)
    return caches + scores + activations + recorded


def check_config(cfg, where: str) -> None:
    """Refuse a config whose sizes no Gemma 4 has (before anything is built from it)."""
    d = config_dims(cfg)
    for key, value, cap in (
        ("num_hidden_layers", d["L"], MAX_LAYERS),
        ("hidden_size", d["H"], MAX_HIDDEN),
        ("vocab_size", d["V"], MAX_VOCAB),
        ("num_attention_heads", d["heads"], MAX_HEADS),
        ("head_dim", d["hd"], MAX_HEAD_DIM),
    ):
        if value > cap:
            raise TraceToolError(f"{where}: {key} is {value}, more than this tool accepts ({cap})")
