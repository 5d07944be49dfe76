"""`--runtime onnx`: the static runtime's step graphs exported to ONNX, run by onnxruntime
(replayer/runtimes/onnx.py)."""

from __future__ import annotations

from . import captures as C
from .spec import Export, RuntimeSpec

ORDER = 20

RUNTIMES = (
    RuntimeSpec(
        "onnx",
        "gemma4_trace.replayer.runtimes.onnx:create",
        "the static runtime's steps exported to ONNX, run by onnxruntime (CPU)",
        "float32",
        extra="onnx",
        needs=("onnxruntime", "onnx", "onnxscript"),
        float32_only=True,
        export=Export(
            "export-onnx",
            "gemma4_trace.replayer.runtimes.onnx:export_command",
            "folder for prefill.onnx and decode.onnx",
            "exporting the ONNX graphs",
        ),
        artifacts="prefill/decode .onnx",
        doc="docs/runtime-onnx.md",
        capture_map=C.STEP_GRAPH_TOWERS,  # an image (audio) prompt runs vision.onnx (audio.onnx) too
    ),
)
