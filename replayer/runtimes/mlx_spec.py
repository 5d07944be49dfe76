"""`--runtime mlx*`: REF's checkpoint loaded by mlx-lm and run through its own Gemma 4 modules,
float32 or quantized by mlx-lm, and the quantized weights dequantized as its baseline; an image
prompt's vision tower run by mlx-vlm's own Gemma 4 vision model (replayer/runtimes/mlx.py)."""

from __future__ import annotations

from .captures import Capture, CaptureMap
from .spec import Baseline, RuntimeSpec

ORDER = 80
RT = "gemma4_trace.replayer.runtimes.mlx"
# replayer/runtimes/mlx.py: mlx-lm's text model, module paths below it (the modules wrapped); an
# image prompt's vision tower: mlx-vlm's Gemma 4 model, paths below it (vision_tower, embed_vision)
VISION_LAYER = "vision_tower.encoder.layers.{layer}"
MLX = CaptureMap(
    "mlx-lm's Gemma 4 text model and mlx-vlm's Gemma 4 vision tower (module paths)",
    (
        Capture("vision_tower.patch_embedder.embed_patches", "vision.patch_embeddings"),
        Capture(f"{VISION_LAYER}.self_attn", "vision.q", via="its first apply_multidimensional_rope call"),
        Capture(f"{VISION_LAYER}.self_attn", "vision.k", via="its second apply_multidimensional_rope call"),
        Capture(f"{VISION_LAYER}.self_attn._v_norm", "vision.v"),
        Capture(f"{VISION_LAYER}.self_attn.o_proj", "vision.attn_out"),
        Capture(f"{VISION_LAYER}.mlp", "vision.mlp_out"),
        Capture(VISION_LAYER, "vision.layer_out"),
        Capture("vision_tower", "vision.pooled", via="its output: pooled, stripped of padding, standardized"),
        Capture("embed_vision", "vision.soft_tokens"),
        Capture("layers.0", "embeddings", via="input"),  # layer 0's input: the scaled token embeddings
        Capture("_project_per_layer_inputs", "per_layer_inputs"),
        Capture("layers.{layer}.self_attn.rope", "q", via="its last call"),
        Capture("layers.{layer}.self_attn.rope", "k", via="its first call, in a layer that owns K/V"),
        Capture("layers.{layer}.self_attn.v_norm", "v", via="in a layer that owns K/V"),
        Capture("layers.{layer}.self_attn.o_proj", "attn_out"),
        Capture("layers.{layer}", "layer_out"),
        Capture("norm", "final_hidden"),
        Capture("model(ids, cache)", "logits"),
    ),
)

_MLX = dict(
    extra="mlx",
    needs=("mlx", "mlx_lm"),
    image_needs=("mlx_vlm",),  # an image prompt's vision tower: mlx-vlm's Gemma 4
    float32_only=True,
    cpu_only=True,
    weightless=True,
    capture_map=MLX,
    tools=(("g++", "MLX compiles its CPU kernels with it; install it (Debian/Ubuntu: apt install g++)"),),
    doc="docs/runtime-mlx.md",
)

RUNTIMES = (
    RuntimeSpec(
        "mlx",
        f"{RT}:create",
        "REF's checkpoint loaded by mlx-lm, run through its own Gemma 4 modules and caches, an image's vision "
        "tower through mlx-vlm's (MLX, CPU)",
        "float32",
        profile="mlx-f32",
        **_MLX,
    ),
    *(
        RuntimeSpec(
            f"mlx-q{bits}",
            f"{RT}:create",
            f"the same, quantized by mlx-lm's quantize_model ({bits}-bit affine, group size 64)",
            "quantized",
            baseline=Baseline(f"mlx-q{bits}-dq"),
            **_MLX,
        )
        for bits in (8, 4)
    ),
    *(
        RuntimeSpec(
            f"mlx-q{bits}-dq",
            f"{RT}:create",
            f"mlx-q{bits}'s weights dequantized into float32 layers (its `--baseline`)",
            "quantized weights, float32 kernels",
            **_MLX,
        )
        for bits in (8, 4)
    ),
)
