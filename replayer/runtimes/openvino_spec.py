"""`--runtime openvino*`: the static runtime's step graphs as OpenVINO IR on the CPU plugin, float32
or NNCF-compressed, and the compressed IR folded back to float32 as its baseline
(replayer/runtimes/openvino.py)."""

from __future__ import annotations

from . import captures as C
from .spec import Baseline, Export, RuntimeSpec

ORDER = 70
RT = "gemma4_trace.replayer.runtimes.openvino"
_OPENVINO = dict(
    extra="openvino",
    float32_only=True,
    cpu_only=True,
    export=Export(
        "export-openvino",
        f"{RT}:export_command",
        "folder for prefill.xml/.bin and decode.xml/.bin",
        "converting the OpenVINO IR",
    ),
    doc="docs/runtime-openvino.md",
    capture_map=C.STEP_GRAPH_TOWERS,  # vision.xml, audio.xml for an image, audio prompt, compressed as the steps are
)
_QUANT = {"openvino-int8": "INT8_ASYM", "openvino-int4": "INT4_SYM in groups of 32"}

RUNTIMES = (
    RuntimeSpec(
        "openvino",
        f"{RT}:create",
        "the static runtime's steps converted to OpenVINO IR, compiled for OpenVINO's CPU plugin (f32)",
        "float32",
        needs=("openvino",),
        profile="openvino-f32",
        artifacts="prefill/decode IR (.xml, .bin)",
        **_OPENVINO,
    ),
    *(
        RuntimeSpec(
            name,
            f"{RT}:create",
            f"the same IR with NNCF weight compression {scheme}, the CPU plugin's compressed-weight kernels",
            "quantized weights, activations dynamically int8 in those kernels",
            needs=("openvino", "nncf"),
            artifacts="compressed IR",
            baseline=Baseline(f"{name}-dq"),
            **_OPENVINO,
        )
        for name, scheme in _QUANT.items()
    ),
    *(
        RuntimeSpec(
            f"{name}-dq",
            f"{RT}:create",
            f"{name}'s IR with its weight decompression folded into float32 weights (its `--baseline`)",
            "quantized weights, float32 kernels",
            needs=("openvino", "nncf"),
            artifacts="folded IR",
            **_OPENVINO,
        )
        for name in _QUANT
    ),
)
