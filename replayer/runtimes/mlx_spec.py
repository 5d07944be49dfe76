"""`--runtime mlx*`: REF's checkpoint loaded by mlx-lm and run through its own Gemma 4 modules,
float32 or quantized by mlx-lm, and the quantized weights dequantized as its baseline; an image
prompt's vision tower run by mlx-vlm's own Gemma 4 vision model, an audio prompt's audio tower by
mlx-vlm's own Gemma 4 audio encoder (replayer/runtimes/mlx.py, mlx_vision.py, mlx_audio.py)."""

from __future__ import annotations

from .captures import Capture, CaptureMap
from .spec import Baseline, FileInput, RuntimeSpec

ORDER = 80
RT = "gemma4_trace.replayer.runtimes.mlx"
# replayer/runtimes/mlx.py: mlx-lm's text model, module paths below it (the modules wrapped); an
# image prompt's vision tower: mlx-vlm's Gemma 4 model, paths below it (vision_tower, embed_vision);
# an audio prompt's audio tower: the same model's audio_tower and embed_audio (mlx_audio.py)
VISION_LAYER = "vision_tower.encoder.layers.{layer}"
AUDIO_LAYER = "audio_tower.layers.{layer}"  # mlx-vlm's ConformerBlock
MLX = CaptureMap(
    "mlx-lm's Gemma 4 text model and mlx-vlm's Gemma 4 vision and audio towers (module paths)",
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
        Capture("audio_tower.subsample_conv_projection", "audio.subsampled", via="its output's frames (frames, mask)"),
        Capture(f"{AUDIO_LAYER}.feed_forward1", "audio.ff1_out", via="its output: the half-step residual added"),
        Capture(f"{AUDIO_LAYER}.self_attn", "audio.attn_out", via="its output: post's, before norm_post_attn"),
        Capture(f"{AUDIO_LAYER}.lconv1d", "audio.lconv_out"),
        Capture(f"{AUDIO_LAYER}.feed_forward2", "audio.ff2_out"),
        Capture(AUDIO_LAYER, "audio.layer_out"),
        Capture("audio_tower.output_proj", "audio.output_proj"),
        Capture("embed_audio", "audio.soft_tokens"),
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
    image_needs=("mlx_vlm",),  # an image prompt's vision tower, an audio prompt's audio tower: mlx-vlm's Gemma 4
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
        "tower and a clip's audio tower through mlx-vlm's (MLX, CPU)",
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

FOLDER = "gemma4_trace.replayer.runtimes.mlx_folder"
_FOLDER = dict(extra="mlx", needs=("mlx", "mlx_lm"), float32_only=True)
FILES = (
    FileInput(
        "--mlx-model",
        "mlx",
        "an mlx-lm folder",
        "run this mlx-lm folder (config.json, model*.safetensors; quantized or not) in mlx-lm, "
        "against REF's checkpoint (extra [mlx])",
        f"{FOLDER}:read_folder",
        f"{FOLDER}:run_folder",
        **_FOLDER,
    ),
    FileInput(
        "--mlx-model-dq",
        "mlx",
        "an mlx-lm folder",
        "that folder's quantized weights dequantized into float32 layers: --mlx-model's --baseline (extra [mlx])",
        f"{FOLDER}:read_folder",
        f"{FOLDER}:run_folder_dq",
        **_FOLDER,
    ),
)
