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


@dataclass(frozen=True)
class TowerInfo:
    """An encoder tower as a trace records it (schema version 2): its sizes, read from its own
    sub-config, and how many rows (patches or frames) and soft tokens each image or clip gave."""

    name: str  # an encoder tower of traces.schema.TOWERS: "vision" | "audio"
    layers: int
    hidden: int
    heads: int
    head_dim: int
    item_rows: tuple[int, ...]  # rows of each image / clip, in prompt order
    item_tokens: tuple[int, ...]  # soft tokens of each image / clip (what it adds to the text tower)

    def __post_init__(self) -> None:
        object.__setattr__(self, "item_rows", tuple(int(x) for x in self.item_rows))
        object.__setattr__(self, "item_tokens", tuple(int(x) for x in self.item_tokens))

    @property
    def rows(self) -> int:
        return sum(self.item_rows)

    @property
    def tokens(self) -> int:
        return sum(self.item_tokens)


def tower_sizes(config, tower) -> dict[str, int] | None:
    """{layers, hidden, heads, head_dim} of an encoder tower from its sub-config (a dict from
    config.json or an HF config; `tower` a traces.schema.Tower); None when the config has none.
    Values that are not positive integers are left out (the caller says what is missing)."""
    sub = config.get(tower.config) if isinstance(config, dict) else getattr(config, tower.config, None)
    if sub is None:
        return None

    def get(key):
        v = sub.get(key) if isinstance(sub, dict) else getattr(sub, key, None)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

    out = {"layers": get("num_hidden_layers"), "hidden": get("hidden_size"), "heads": get("num_attention_heads")}
    head_dim = get("head_dim")
    if head_dim is None and out["hidden"] and out["heads"] and out["hidden"] % out["heads"] == 0:
        head_dim = out["hidden"] // out["heads"]
    out["head_dim"] = head_dim
    return {k: v for k, v in out.items() if v is not None}
