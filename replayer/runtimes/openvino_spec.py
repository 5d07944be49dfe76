"""`--runtime openvino*`: the static runtime's step graphs as OpenVINO IR on the CPU plugin, float32
or NNCF-compressed, and the compressed IR folded back to float32 as its baseline
(replayer/runtimes/openvino.py); `--ir PATH [--ir-map MAP]`: the user's own IR, its tensors named by a
map, run by the same engine (openvino_user.py, openvino_file.py; the map's format is onnx_map.py's)."""

from __future__ import annotations

from . import captures as C
from .spec import Baseline, Export, FileInput, RuntimeSpec

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

FILES = (
    FileInput(
        "--ir",
        "openvino",
        "an OpenVINO IR",
        "run your OpenVINO IR on the CPU plugin (--runtime openvino): a folder of prefill.xml and decode.xml "
        "(trace export-openvino), or one .xml (its .bin beside it) with past_key_values.N / present.N caches; "
        "its tensors named by --ir-map (extra [openvino])",
        f"{RT}_file:read_ir",
        f"{RT}_user:run_file",
        extra="openvino",
        needs=("openvino",),
        weightless=False,  # the step graphs' host prepares the prefill inputs (and towers) from REF's weights
        float32_only=True,
    ),
    FileInput(
        "--ir-map",
        "openvino",
        "a name map",
        "with --ir: a TOML map naming which tensor of the IR is which kind and how its inputs are fed "
        "(docs/runtime-openvino.md), or a built-in's name: export, mobius",
        f"{RT}_user:read_map",
        "gemma4_trace.replayer.runtimes.onnx_map:check_map",
        extra="openvino",
        needs=("openvino",),
        companion=True,
    ),
)
