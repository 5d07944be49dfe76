"""Write a random Gemma 4 checkpoint with every dimension of E2B (text decoder), never checked in.

    python benchmarks/make_e2b_random.py /tmp/e2b/bf16/e2b-random                  # bfloat16, ~10 GB
    python benchmarks/make_e2b_random.py /tmp/e2b/f32/e2b-random --dtype float32   # same values, float32
    python benchmarks/make_e2b_random.py /tmp/e2b/tiny --tiny    # E2B's structure at tiny widths: 1 MB, seconds

E2B's text decoder (google/gemma-4-e2b-it, the checkpoint transformers' Gemma4TextConfig
documents; the defaults there are the larger variant's, so every E2B value is set here):
35 layers in 7 groups of 4 sliding + 1 full, the last 20 reusing K/V, vocabulary 262,144,
hidden 1536, 8 query heads, 1 KV head, head_dim 256 (sliding) / 512 (full), MLP 6144
(double-wide on the KV-reusing layers), per-layer embeddings 35 x 256 per token, sliding
window 512, RoPE theta 1e4 (sliding) / proportional 1e6 x 0.25 (full), final soft-cap 30,
131,072 positions. About 4.63 B parameters (5.03 B counting the tied lm_head twice).

Weights are N(0, 0.02) (norm scales and layer scalars 1), drawn tensor by tensor from a seeded
generator in bfloat16 and written in safetensors shards of <= 2 GB, so building never holds
more than one shard (the per-layer embedding table, 4.7 GB in bf16, is a shard of its own).
The float32 variant holds exactly the bf16 values (a float32 REF of the same weights).
No tokenizer: give prompts with --input-ids. `--tiny` keeps every E2B structure (35 layers, the
pattern, the last 20 reusing K/V, the double-wide MLP, the soft-cap, the RoPE settings) at the
widths of TINY (hidden 64, vocabulary 512, ...): a checkpoint the benchmarks run on in seconds, to
check that they run (tests/test_benchmarks.py), not to measure E2B.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

S, F = "sliding_attention", "full_attention"

E2B_TEXT = dict(
    vocab_size=262_144,
    vocab_size_per_layer_input=262_144,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    layer_types=[S, S, S, S, F] * 7,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    hidden_size_per_layer_input=256,
    num_kv_shared_layers=20,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    max_position_embeddings=131_072,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10_000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
)
# --tiny: E2B_TEXT with these widths (every layer count and pattern, the sharing and the settings kept)
TINY = dict(
    vocab_size=512,
    vocab_size_per_layer_input=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    head_dim=16,
    global_head_dim=32,
    hidden_size_per_layer_input=8,
    sliding_window=8,
    max_position_embeddings=2048,
)
SHARD_BYTES = 2 << 30
FILL_ROWS = 1 << 24  # values drawn per randn call (64 MB of float32)


def build(out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0, tiny: bool = False) -> Path:
    """Write the checkpoint to out_dir (nothing when it holds one already); `tiny`: at TINY's widths."""
    import torch
    from safetensors.torch import save_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = Gemma4TextConfig(**{**E2B_TEXT, **(TINY if tiny else {})})
    with torch.device("meta"):  # names and shapes only: nothing allocated
        model = Gemma4ForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    target = getattr(torch, dtype)

    def tensor(i: int, name: str, shape) -> torch.Tensor:
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            return torch.ones(shape, dtype=target)
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        t = torch.empty(shape, dtype=target)
        flat = t.view(-1)
        for a in range(0, flat.numel(), FILL_ROWS):  # in blocks: never a second full-size copy
            n = min(FILL_ROWS, flat.numel() - a)
            flat[a : a + n] = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)  # float32: the bf16 values
        return t

    weight_map, shard, shard_bytes, files, total = {}, {}, 0, [], 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    for i, (name, shape) in enumerate(shapes.items()):
        t = tensor(i, name, shape)
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
        shard_bytes += nbytes
        total += nbytes
        print(f"\r{i + 1}/{len(shapes)} tensors, {total / 2**30:.1f} GiB", end="", flush=True)
    flush()
    print()
    # shard names were provisional ("model-00001"): HF also accepts them without "-of-N"
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    config.dtype = dtype
    config.save_pretrained(out)
    model.generation_config.eos_token_id = [1]
    model.generation_config.save_pretrained(out)
    n_params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    params = f"{n_params / 1e9:.2f} B" if n_params >= 1e8 else f"{n_params / 1e6:.2f} M"
    size = f"{total / 2**30:.1f} GiB" if total >= 2**28 else f"{total / 2**20:.1f} MiB"
    print(f"wrote {out}: {params} parameters, {size} in {len(files)} shards ({dtype})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="every E2B structure at tiny widths (TINY): for quick checks")
    args = ap.parse_args()
    build(args.out_dir, args.dtype, args.seed, args.tiny)


if __name__ == "__main__":
    main()
