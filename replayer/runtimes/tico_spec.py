"""TICO's own static Gemma 4 runtime (replayer/runtimes/tico.py), float and fake-quant."""

from __future__ import annotations

from gemma4_trace.traces import schema as S

from .captures import Capture, CaptureMap
from .spec import RuntimeSpec

ORDER = 10
RT = "gemma4_trace.replayer.runtimes.tico"
# its vision step (made at the first image prompt's prefill): the wrapped tower, its encoder layers
_VM = "vision_prefill.vision_model"
_LAYER = f"{_VM}.wrapped_model.encoder.wrapped.layers.{{layer}}"
_ATTN = f"{_LAYER}.wrapped.self_attn.wrapped"
VISION = (
    Capture(f"{_VM}.wrapped_model.patch_embedder_export", "vision.patch_embeddings"),
    Capture(f"{_ATTN}._apply_multidimensional_rope", "vision.q", via="its result for obs_q_x1"),
    Capture(f"{_ATTN}._apply_multidimensional_rope", "vision.k", via="its result for obs_k_x1"),
    Capture(f"{_ATTN}.v_norm", "vision.v"),
    Capture(f"{_ATTN}.o_proj", "vision.attn_out"),
    Capture(f"{_LAYER}.wrapped.mlp", "vision.mlp_out"),
    Capture(_LAYER, "vision.layer_out"),
    Capture(_VM, "vision.pooled", via="last_hidden_state (standardized, padding stripped)"),
    Capture("vision_prefill.vision_projection", "vision.soft_tokens"),
)
# replayer/runtimes/tico.py: attributes of TICO's StaticGemma4Runtime, hooked
TICO = CaptureMap(
    "TICO's StaticGemma4Runtime (attribute paths of its modules)",
    (
        Capture("mm_fusion", "embeddings"),  # prefill
        Capture("token_embedding", "embeddings"),  # decode
        Capture("ple_projection", "per_layer_inputs"),
        *(
            Capture("build_*_masks_and_rope", k, via=f"rope[{t!r}][{0 if '_cos_' in k else 1}]")
            for t in S.LAYER_TYPE_SHORT
            for k in S.rope_kinds(t)
        ),
        Capture("prefill_layers.{layer}.wrapped.self_attn.wrapped._fq", "mask", via="obs_attn_mask"),
        Capture("prefill_layers.{layer}.wrapped.self_attn.wrapped._fq", "q", via="obs_q_rot"),
        Capture("*_layers.{layer}", "k", via="output[1]"),  # (h, k, v): what each layer's export module returns
        Capture("*_layers.{layer}", "v", via="output[2]"),
        Capture("prefill_layers.{layer}.wrapped.self_attn.wrapped.o_proj", "attn_out"),
        Capture("*_layers.{layer}", "layer_out", via="output[0]"),
        Capture("lm_head.norm", "final_hidden", via="applied to the last layer's output rows"),
        Capture("prefill() / decode_one()", "logits"),
        *VISION,
    ),
)

_TICO = dict(extra="tico", needs=("tico",), doc="docs/runtime-tico.md", capture_map=TICO)

RUNTIMES = (
    RuntimeSpec("tico", f"{RT}:create", "TICO's own static Gemma 4 runtime (its PTQ wrappers)", "float", **_TICO),
    RuntimeSpec(
        "tico-quant",
        f"{RT}:create",
        "the same in TICO's fake-quant mode (int16), calibrated on REF's prompt",
        "quantized (simulated)",
        **_TICO,
    ),
)
