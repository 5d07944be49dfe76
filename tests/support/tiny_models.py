"""Random tiny Gemma 4 checkpoints built in the tests, one per architecture variant.

Each is a real `save_pretrained` folder (safetensors), so the recorder and the runtime
load it exactly as a user's checkpoint. Weights are random but seeded; the init scale is
raised so greedy decoding has clear top-1 margins.
"""

from __future__ import annotations

from pathlib import Path

S, F = "sliding_attention", "full_attention"

BASE_TEXT = dict(
    vocab_size=128,
    vocab_size_per_layer_input=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=7,
    layer_types=[S, S, F, S, F, S, F],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    global_head_dim=16,
    sliding_window=4,
    hidden_size_per_layer_input=4,
    num_kv_shared_layers=3,  # layers 4 (F), 5 (S), 6 (F) reuse layers 2 (F) and 3 (S)
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    initializer_range=0.2,
)

VARIANTS: dict[str, dict] = {
    "base": {},
    "k_eq_v": dict(attention_k_eq_v=True, num_key_value_heads=2, num_global_key_value_heads=1),
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    "no_ple": dict(hidden_size_per_layer_input=0),
    "no_softcap": dict(final_logit_softcapping=None),
    "no_sharing": dict(num_kv_shared_layers=0, use_double_wide_mlp=False),
    "full_first": dict(layer_types=[F, S, S, F, S, F, F], num_kv_shared_layers=2),
}

VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=64,
)


def build(
    out_dir: str | Path, variant: str = "base", seed: int = 0, multimodal: bool = False, **text_overrides
) -> Path:
    """Write a random tiny Gemma 4 checkpoint for `variant` into out_dir and return it."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text = {**BASE_TEXT, **VARIANTS[variant], **text_overrides}
    torch.manual_seed(seed)
    if multimodal:
        cfg = Gemma4Config(
            text_config=text,
            vision_config=VISION,
            audio_config=None,
            image_token_id=120,
            boi_token_id=121,
            eoi_token_id=122,
            video_token_id=123,
            audio_token_id=124,
            boa_token_id=125,
            eoa_token_index=126,
        )
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        model = Gemma4ForCausalLM(Gemma4TextConfig(**text))
    model.generation_config.eos_token_id = [1]
    model.generation_config.pad_token_id = 0
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


# the ExecuTorch tests' model and prompt: 3 layers (sliding, full, a sliding one reusing layer 0's K/V),
# 7 tokens (past the sliding window of 4)
EXECUTORCH_PROMPT = "2,17,33,40,51,60,71"


def executorch_case(folder: Path) -> tuple[Path, Path]:
    """(the model, its REF over EXECUTORCH_PROMPT with 3 new tokens), built in `folder`."""
    from tests.support.cli import invoke

    model = build(folder / "model", num_hidden_layers=3, layer_types=[S, F, S], num_kv_shared_layers=1)
    ref = folder / "ref.h5"
    res = invoke("record", "--model", model, "--input-ids", EXECUTORCH_PROMPT, "--max-new-tokens", "3", "-o", ref)
    assert res.exit_code == 0, res.output
    return model, ref


def vision_variant(out_dir: str | Path, seed: int = 0, pooling_kernel_size: int | None = None) -> Path:
    """The embedded model with a vision tower that uses what the embedded one leaves off: standardize
    (std_bias / std_scale), clipped linears (bounds that bite) and fewer K/V heads than query heads;
    the tokenizer and processor of hf/tiny_model beside it. Everything else is the embedded model's,
    but `pooling_kernel_size` (the tower's and the processor's: k x k patches a soft token)."""
    import json
    import shutil

    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from gemma4_trace.hf.model import embedded_model_dir

    src, out = embedded_model_dir(), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    cfg["vision_config"] |= dict(standardize=True, use_clipped_linears=True, num_key_value_heads=1)
    if pooling_kernel_size is not None:
        cfg["vision_config"]["pooling_kernel_size"] = pooling_kernel_size
    config = Gemma4Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = Gemma4ForConditionalGeneration.from_pretrained(src, config=config, ignore_mismatched_sizes=True)
    g = torch.Generator().manual_seed(seed)
    tower = model.model.vision_tower
    with torch.no_grad():
        tower.std_bias.copy_(torch.randn(tower.std_bias.shape, generator=g))
        tower.std_scale.copy_(torch.rand(tower.std_scale.shape, generator=g) + 0.5)
        for layer in tower.encoder.layers:
            for attn in (layer.self_attn.k_proj, layer.self_attn.v_proj):  # resized for one K/V head
                attn.linear.weight.copy_(torch.randn(attn.linear.weight.shape, generator=g) * 0.2)
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.self_attn.o_proj):
                (
                    lin.input_min.fill_(-1.5),
                    lin.input_max.fill_(1.5),
                    lin.output_min.fill_(-2.0),
                    lin.output_max.fill_(2.0),
                )
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json", "README.md"):
            shutil.copy(f, out / f.name)
    if pooling_kernel_size is not None:
        proc = json.loads((out / "processor_config.json").read_text())
        proc["image_processor"]["pooling_kernel_size"] = pooling_kernel_size
        (out / "processor_config.json").write_text(json.dumps(proc, indent=2))
    return out
