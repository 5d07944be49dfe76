"""Per-layer metadata shared by every producer of a trace."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerInfo:
    layer_type: str  # "sliding_attention" | "full_attention"
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_role: str  # "owns" (own K/V) | "stores" (own K/V, read by later layers) | "reuses"
    kv_source: int  # the layer whose K/V this layer attends to (itself unless it reuses)


def layer_infos_from_config(text_config) -> list[LayerInfo]:
    """LayerInfo for each decoder layer of a Gemma 4 text config (HF object or same-named attrs).

    head_dim and KV heads come from `per_layer_config` when the config has it (full layers
    carry `global_head_dim` there), otherwise from the top-level fields.
    """
    n = text_config.num_hidden_layers
    types = list(text_config.layer_types)
    modes = list(getattr(text_config, "kv_sharing_modes", [None] * n))
    per_layer = getattr(text_config, "per_layer_config", None)
    infos = []
    for i in range(n):
        cfg = per_layer[i] if per_layer is not None else text_config
        mode = modes[i]
        if mode == "reuse":
            # reusers read the last earlier "store" layer of the same type
            src = max(j for j in range(i) if modes[j] == "store" and types[j] == types[i])
            role = "reuses"
        else:
            src, role = i, ("stores" if mode == "store" else "owns")
        infos.append(
            LayerInfo(
                layer_type=types[i],
                head_dim=int(cfg.head_dim),
                num_heads=int(text_config.num_attention_heads),
                num_kv_heads=int(cfg.num_key_value_heads),
                kv_role=role,
                kv_source=src,
            )
        )
    return infos
