"""`--runtime litert*`: REF's checkpoint exported by litert-torch and run by ai-edge-litert, float32
or quantized by litert-quantizer (with the dequantized baselines); LiteRT-LM's engine on the
.litertlm bundle, the tool's or the user's (`--litertlm FILE`), tokens only; and transformers' own
forward converted whole (litert-convert). `--tflite PATH`: the user's own litert-torch export (a
folder, or a .litertlm bundle's TFLite sections) run per layer by `--runtime litert` (user_files.py)."""

from __future__ import annotations

from pathlib import Path

from gemma4_trace.hf import sites as H
from gemma4_trace.traces.inputs import open_regular

from ..captures import ROPE, TOKENS_ONLY, Capture, CaptureMap
from ..spec import Baseline, Export, FileInput, RuntimeSpec

ORDER = 60
RT = "gemma4_trace.replayer.runtimes.litert"
# replayer/runtimes/litert/graph.py and runtime.py: litert-torch's export, its tensors by name (torch
# module paths, fused ops' parts joined by ';') and by the operators that make them
_VL = "*Gemma4VisionEncoderLayer_{layer}"  # an encoder layer's scope in vision_encoder.tflite
_AL = "*Gemma4AudioLayer_{layer}/*"  # a conformer layer's scope in audio_encoder.tflite
LITERT = CaptureMap(
    "litert-torch's Gemma 4 export (tensor names: module scopes; graph.py reads the operators)",
    (
        Capture("embeddings", "embeddings", via="the embedder's output, the model's input"),
        Capture("*language_model", "per_layer_inputs", via="the scope's last (1, n, layers, ple) tensor"),
        *(Capture("*rotary_emb*", k, via=k.split("_")[1].upper()) for k in ROPE),  # the layer type: its readers'
        Capture("*Gemma4TextDecoderLayer_{layer}/*", "mask", via="ADD"),  # the operand added before the SOFTMAX
        Capture("*Gemma4TextDecoderLayer_{layer}/*", "q", via="ADD"),  # the RoPE sum that writes no cache
        Capture("kv_cache_k_*", "k", via="the rows the step wrote", layer_from=("the j-th layer writing K/V",)),
        Capture("kv_cache_v_*", "v", via="the rows the step wrote", layer_from=("the j-th layer writing K/V",)),
        Capture("*Gemma4TextDecoderLayer_{layer}/*Linear_o_proj*", "attn_out", via="its last (1, n, hidden)"),
        Capture("*Gemma4TextDecoderLayer_{layer}", "layer_out", via="the scope's last (1, n, hidden)"),
        Capture("Gemma4RMSNorm_norm", "final_hidden", via="the scope's last (1, n, hidden)"),
        Capture("logits", "logits"),
        # the vision tower: vision_encoder.tflite and vision_adapter.tflite (export.py), read by graph.py's
        # vision_taps, each image's real patches kept (replayer/runtimes/litert/runtime.py)
        Capture("*VisionPatchEmbedder_patch_embedder", "vision.patch_embeddings", via="its last (1, n, hidden)"),
        Capture(f"{_VL}/*Gemma4RMSNorm_q_norm", "vision.q", via="CONCATENATION"),  # its 2D RoPE's halves joined
        Capture(f"{_VL}/*Gemma4RMSNorm_k_norm", "vision.k", via="CONCATENATION"),
        Capture(f"{_VL}/*Gemma4RMSNorm_v_norm", "vision.v"),
        Capture(f"{_VL}/*Linear_o_proj*", "vision.attn_out", via="its last (1, n, hidden)"),
        Capture(f"{_VL}/*VisionMLP_mlp*", "vision.mlp_out", via="the scope's last (1, n, hidden)"),
        Capture(_VL, "vision.layer_out", via="the scope's last (1, n, hidden)"),
        Capture("features", "vision.pooled", via="the encoder's output, the rows its mask keeps"),
        Capture("mm_embedding", "vision.soft_tokens", via="the adapter's output, the rows the encoder's mask keeps"),
        # the audio tower: audio_encoder.tflite and audio_adapter.tflite (audio.py: audio_taps, the rows of each
        # clip's real subsampled frames); each row the scope's last (1, n, hidden)
        Capture(
            "*Gemma4AudioSubSampleConvProjection_subsample_conv_projection*", "audio.subsampled", via="FULLY_CONNECTED"
        ),
        Capture(f"{_AL}Gemma4AudioFeedForward_feed_forward1*", "audio.ff1_out", via="ADD"),
        Capture(f"{_AL}Gemma4AudioAttention_self_attn*", "audio.attn_out", via="post's clamp (MINIMUM)"),
        Capture(f"{_AL}Gemma4AudioLightConv1d_lconv1d*", "audio.lconv_out", via="ADD"),
        Capture(f"{_AL}Gemma4AudioFeedForward_feed_forward2*", "audio.ff2_out", via="ADD"),
        Capture(f"{_AL}Gemma4RMSNorm_norm_out", "audio.layer_out", via="its output"),
        # the adapter's output first: the encoder's name pattern matches it too
        Capture(
            "audio_adapter_*_features_output", "audio.soft_tokens", via="the adapter's output, at the encoder's mask"
        ),
        Capture("audio_*_features_output", "audio.output_proj", via="the encoder's output, the rows its mask keeps"),
    ),
)

# replayer/runtimes/litert/convert.py: HF's forward hooked where hf/sites.py says HF computes each kind
HF_FORWARD = CaptureMap(
    "transformers' Gemma 4 modules (hf/sites.py)",
    tuple(Capture(s.module or "model", s.key, via=f"{s.tensor} {s.item}") for s in H.SITES if s.tower == H.TEXT),
)

_LITERT = dict(
    extra="litert",
    needs=("litert_torch", "ai_edge_litert", "litert_quantizer"),
    text_only=False,  # the vision and audio towers: litert-torch's encoder exports (export.py, audio.py)
    float32_only=True,
    cpu_only=True,
    weightless=True,
    doc="docs/runtime-litert.md",
    capture_map=LITERT,
)
_TEXT_ONLY = {**_LITERT, "text_only": True, "capture_map": TOKENS_ONLY}  # litert-lm, litert-convert: token ids only
_EXPORT = Export(
    "export-litert",
    f"{RT}.export:export_command",
    "folder for the .tflite files (and model.litertlm)",
    "converting the LiteRT models",
    prefill_chunk=True,
)
_QUANT = {
    "litert-int8": "litert-quantizer's `dynamic_wi8_afp32` (int8 weights, dynamic int8 activations)",
    "litert-wi8": "litert-quantizer's `weight_only_wi8_afp32` (int8 weights, float activations)",
    "litert-int4": "litert-quantizer's `dynamic_wi4_afp32` (int4 weights, dynamic int8 activations)",
}

RUNTIMES = (
    RuntimeSpec(
        "litert",
        f"{RT}.runtime:create",
        "REF's checkpoint exported by litert-torch's Gemma 4 path, run by ai-edge-litert (XNNPACK, CPU)",
        "float32",
        profile="litert-f32",
        artifacts=".tflite files, .litertlm",
        export=_EXPORT,
        **_LITERT,
    ),
    *(
        RuntimeSpec(
            name,
            f"{RT}.runtime:create",
            f"the same, model.tflite quantized with {recipe}",
            "quantized",
            artifacts="quantized model.tflite",
            export=_EXPORT,
            baseline=Baseline(f"{name}-dq"),
            **_LITERT,
        )
        for name, recipe in _QUANT.items()
    ),
    *(
        RuntimeSpec(
            f"{name}-dq",
            f"{RT}.runtime:create",
            f"the float model.tflite with {name}'s quantized weights dequantized into it (its `--baseline`)",
            "quantized weights, float32 kernels",
            artifacts="model.tflite",
            export=_EXPORT,
            **_LITERT,
        )
        for name in _QUANT
    ),
    RuntimeSpec(
        "litert-lm",
        f"{RT}.lm:create",
        "LiteRT-LM's engine (CPU, greedy) on the .litertlm litert-torch exports from REF's checkpoint, or "
        "`--litertlm FILE`; text (and image and audio files) in, text out",
        "float32 (or the file's)",
        artifacts=".litertlm",
        # an image or audio prompt: its Conversation API, the image a PNG rebuilt from REF's patches, the clip
        # --audio FILE's waveform (LiteRT-LM computes its own log-mel features: --audio-features native; lm.py)
        media=("image", "audio"),
        native_audio_features=True,
        **{**_TEXT_ONLY, "needs": ("litert_lm", "litert_torch"), "text_only": False},
    ),
    RuntimeSpec(
        "litert-convert",
        f"{RT}.convert:create",
        "transformers' own Gemma 4 forward converted by `litert_torch.convert`, run by ai-edge-litert "
        "(whole sequence per step)",
        "float32",
        artifacts="converted .tflite",
        **{**_TEXT_ONLY, "capture_map": HF_FORWARD},
    ),
)


def check_bundle(path) -> Path:
    """A `--litertlm` file: a regular file (LiteRT-LM's engine reads and checks the bundle itself,
    in its child process)."""
    with open_regular(path, "--litertlm"):
        pass
    return Path(path)


FILES = (
    FileInput(
        "--tflite",
        "litert",
        "a litert-torch export",
        "run this litert-torch export per layer in ai-edge-litert (--runtime litert): a folder as "
        "litert_torch.generative.export_hf writes it (model.tflite, embedder.tflite, per_layer_embedder.tflite) "
        "or a .litertlm bundle's TFLite sections",
        f"{RT}.user_files:read_files",
        f"{RT}.user_runtime:run_files",
        extra="litert",
        needs=("ai_edge_litert", "litert_torch"),
        float32_only=True,
    ),
    FileInput(
        "--litertlm",
        "litert-lm",
        "a .litertlm bundle",
        "run this .litertlm bundle in LiteRT-LM (--runtime litert-lm)",
        f"{RT}.spec:check_bundle",
        f"{RT}.lm:run_bundle",
        extra="litert",
        needs=("litert_lm",),
    ),
)
