"""`--runtime mobius`: mobius-onnx's own ONNX Gemma 4 text decoder, run by onnxruntime
(replayer/runtimes/mobius.py)."""

from __future__ import annotations

from .captures import Capture, CaptureMap
from .spec import RuntimeSpec

ORDER = 50

# replayer/runtimes/mobius.py: the mobius graph's node names, and what each kind is there
MOBIUS = CaptureMap(
    "mobius's ONNX graph nodes (their names and op types)",
    (
        Capture("model/embed_tokens/*", "embeddings", via="Mul"),  # the scaled token embedding
        Capture("model/Mul_node_*", "per_layer_inputs", via="Mul"),  # (projection + per-layer embedding) * 2**-0.5
        Capture("model/layers.{layer}/self_attn/*", "q", via="Attention[0]"),  # after q_norm and RoPE
        Capture("model/layers.{layer}/self_attn/*", "k", via="Attention[1]"),  # where the layer writes a cache
        Capture("model/layers.{layer}/self_attn/*", "v", via="Attention[2]"),
        Capture("model/layers.{layer}/self_attn/o_proj/*", "attn_out", via="MatMul"),
        Capture("model/layers.{layer}/*", "layer_out", via="the last node of the layer's own scope"),
        Capture("model/norm/*", "final_hidden"),
        Capture("logits", "logits"),
    ),
)

RUNTIMES = (
    RuntimeSpec(
        "mobius",
        "gemma4_trace.replayer.runtimes.mobius:create",
        "mobius-onnx's own ONNX Gemma 4 text decoder (not traced from PyTorch), run by onnxruntime (CPU)",
        "float32",
        extra="mobius",
        needs=("mobius", "onnxruntime", "onnx_ir"),
        text_only=True,
        float32_only=True,
        capture_map=MOBIUS,
        artifacts="model.onnx",
        doc="docs/runtime-mobius.md",
    ),
)
