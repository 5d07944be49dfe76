"""An E2B-shaped random Gemma 4 for benchmarks: E2B widths, fewer layers, a smaller vocabulary.

E2B widths: hidden 1536, 8 query heads, 1 KV head, head_dim 256 (sliding) / 512 (full),
per-layer inputs of 256, MLP 6144 (double-wide on KV-reusing layers), window 512.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.make_e2b_random import E2B_TEXT as E2B_FULL

S, F = "sliding_attention", "full_attention"

# E2B's widths (benchmarks/make_e2b_random.py holds every E2B dimension); 10 layers, 5 of
# them reusing K/V, a 16k vocabulary and the default init so that a build stays small
E2B_TEXT = {
    k: v for k, v in E2B_FULL.items() if k not in ("max_position_embeddings", "rope_parameters", "tie_word_embeddings")
}
E2B_TEXT.update(
    vocab_size=16384,
    vocab_size_per_layer_input=16384,
    num_hidden_layers=10,
    layer_types=[S, S, S, S, F, S, S, S, S, F],
    num_kv_shared_layers=5,
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
