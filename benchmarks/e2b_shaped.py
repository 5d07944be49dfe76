"""An E2B-shaped random Gemma 4 for benchmarks: E2B widths, fewer layers, a smaller vocabulary.

E2B widths: hidden 1536, 8 query heads, 1 KV head, head_dim 256 (sliding) / 512 (full),
per-layer inputs of 256, MLP 6144 (double-wide on KV-reusing layers), window 512.
"""

from __future__ import annotations

from pathlib import Path

S, F = "sliding_attention", "full_attention"

E2B_TEXT = dict(
    vocab_size=16384,
    vocab_size_per_layer_input=16384,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=10,
    layer_types=[S, S, S, S, F, S, S, S, S, F],
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    hidden_size_per_layer_input=256,
    num_kv_shared_layers=5,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    initializer_range=0.02,
)


def build(out_dir: str | Path, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
    """Write the random E2B-shaped checkpoint (text-only) to out_dir, once."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**E2B_TEXT, **overrides})).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = [1]
    model.save_pretrained(out, safe_serialization=True)
    return out
