"""`--runtime keras-hub`: REF's checkpoint converted by keras-hub's own converter and run through its
own Gemma 4 layers on JAX's CPU backend, step by step through `Gemma4CausalLM.call_with_cache`
(replayer/runtimes/keras_hub.py, keras_hub_engine.py)."""

from __future__ import annotations

from .captures import Capture, CaptureMap
from .spec import RuntimeSpec

ORDER = 95

# replayer/runtimes/keras_hub_engine.py: keras-hub's Gemma4CausalLM, paths below its backbone (the
# layers and methods whose call is patched on the instance)
LAYER = "transformer_layers.{layer}"
VISION = "vision_encoder.image_encoder.encoder_blocks.{layer}"
REAL = "the real patches' rows"
KERAS_HUB = CaptureMap(
    "keras-hub's Gemma 4 (Gemma4Backbone's layers and methods, patched on the instance)",
    (
        Capture("vision_encoder.image_encoder.patch_embedder", "vision.patch_embeddings", via=REAL),
        Capture(f"{VISION}.attention._apply_rope", "vision.q", via="its first call; the real patches' rows"),
        Capture(f"{VISION}.attention._apply_rope", "vision.k", via="its second call; the real patches' rows"),
        Capture(f"{VISION}.attention.value_norm", "vision.v", via=REAL),
        Capture(f"{VISION}.attention.output_dense", "vision.attn_out", via=REAL),
        Capture(f"{VISION}.ffw_linear", "vision.mlp_out", via=REAL),
        Capture(VISION, "vision.layer_out", via=REAL),
        Capture("vision_encoder", "vision.soft_tokens", via="its output: each image's real patches' soft tokens"),
        Capture("transformer_layers.0", "embeddings", via="its input"),
        Capture(LAYER, "per_layer_inputs", via="its per_layer_input argument, every layer's"),
        Capture(f"{LAYER}._compute_attention_mask", "mask"),
        Capture(f"{LAYER}.attention._apply_rope", "q", via="its first call"),
        Capture(f"{LAYER}.attention._apply_rope", "k", via="its second call, in a layer that owns K/V"),
        Capture(f"{LAYER}.attention.value_norm", "v", via="in a layer that owns K/V"),
        Capture(f"{LAYER}.attention.output_dense", "attn_out"),
        Capture(LAYER, "layer_out", via="its output's hidden states"),
        Capture("layer_norm", "final_hidden"),
        Capture("call_with_cache(ids, cache, index)", "logits", via="its last row"),
    ),
)

RUNTIMES = (
    RuntimeSpec(
        "keras-hub",
        "gemma4_trace.replayer.runtimes.keras_hub:create",
        "REF's checkpoint converted by keras-hub's own converter, run through its own Gemma 4 layers and "
        "cache, an image's vision tower through its own vision encoder (JAX, CPU)",
        "float32",
        extra="keras",
        needs=("keras_hub", "keras", "jax"),
        float32_only=True,
        cpu_only=True,
        weightless=True,
        capture_map=KERAS_HUB,
        profile="keras-hub-f32",
        artifacts="keras-hub preset (the converted backbone)",
        doc="docs/runtime-keras-hub.md",
    ),
)
