"""`--runtime onnx`: the static runtime's step graphs exported to ONNX, run by onnxruntime
(replayer/runtimes/onnx.py); `--onnx PATH [--onnx-map MAP]`: the user's own ONNX graph, its tensors
named by a map, run by the same engine (onnx_user.py, onnx_file.py, onnx_map.py)."""

from __future__ import annotations

from . import captures as C
from .spec import Export, FileInput, RuntimeSpec

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

RT = "gemma4_trace.replayer.runtimes"
FILES = (
    FileInput(
        "--onnx",
        "onnx",
        "an ONNX graph",
        "run your ONNX graph in onnxruntime (--runtime onnx): a folder of prefill.onnx and decode.onnx "
        "(trace export-onnx), or one .onnx file with past_key_values.N / present.N caches (mobius, "
        "onnxruntime-genai, optimum); its tensors named by --onnx-map (extra [onnx])",
        f"{RT}.onnx_file:read_graph",
        f"{RT}.onnx_user:run_file",
        extra="onnx",
        needs=("onnxruntime", "onnx"),
        weightless=False,  # the step graphs' host prepares the prefill inputs (and towers) from REF's weights
        float32_only=True,
    ),
    FileInput(
        "--onnx-map",
        "onnx",
        "a name map",
        "with --onnx: a TOML map naming which tensor of the graph is which kind and how its inputs are "
        "fed (docs/runtime-onnx.md), or a built-in's name: export, mobius",
        f"{RT}.onnx_map:read_map",
        f"{RT}.onnx_map:check_map",
        extra="onnx",
        needs=("onnxruntime", "onnx"),
        companion=True,
    ),
)
