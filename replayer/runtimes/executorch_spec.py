"""`--runtime executorch*`: the static runtime's step graphs lowered to ExecuTorch's XNNPACK
backend, float32 or PT2E int8 (replayer/runtimes/executorch.py); `--pte PATH`: the user's own programs in
the tool's layout, run by the same engine (executorch_user.py, executorch_file.py)."""

from __future__ import annotations

from . import captures as C
from .spec import Baseline, Export, FileInput, RuntimeSpec

ORDER = 40
RT = "gemma4_trace.replayer.runtimes.executorch"
_EXPORT = Export(
    "export-pte",
    f"{RT}:export_command",
    "folder for the .pte files",
    "lowering the programs",
    prefill_chunk=True,
    calibrate=True,
)
_EXECUTORCH = dict(
    extra="executorch",
    needs=("executorch",),
    float32_only=True,
    cpu_only=True,
    doc="docs/runtime-executorch.md",
    capture_map=C.STEP_GRAPH_TOWERS,  # vision.pte and audio.pte for an image or audio prompt (int8: quantized on them)
)

RUNTIMES = (
    RuntimeSpec(
        "executorch",
        f"{RT}:create",
        "the static runtime's steps lowered to ExecuTorch's XNNPACK backend, run by `executorch.runtime`",
        "float32",
        profile="executorch-f32",
        export=_EXPORT,
        artifacts=".pte programs",
        **_EXECUTORCH,
    ),
    RuntimeSpec(
        "executorch-int8",
        f"{RT}:create",
        "the same, PT2E int8 (XNNPACKQuantizer) calibrated on REF's prompt, XNNPACK's int8 kernels",
        "quantized",
        export=_EXPORT,
        artifacts=".pte programs",
        baseline=Baseline("executorch-int8-reference"),
        **_EXECUTORCH,
    ),
    RuntimeSpec(
        "executorch-int8-reference",
        f"{RT}:create",
        "that converted PT2E int8 program run by PyTorch before lowering (its `--baseline`)",
        "quantized (simulated)",
        artifacts="converted .pt2 programs",
        **_EXECUTORCH,
    ),
)

FILES = (
    FileInput(
        "--pte",
        "executorch",
        "ExecuTorch programs",
        "run your ExecuTorch programs (--runtime executorch): a folder of prefill.pte and decode.pte in the "
        "tool's layout (trace export-pte); a .pte keeps no output names, so one of another layout is refused "
        "(docs/runtime-executorch.md; extra [executorch])",
        f"{RT}_file:read_pte",
        f"{RT}_user:run_file",
        extra="executorch",
        needs=("executorch",),
        weightless=False,  # the host prepares the prefill inputs (and towers) from REF's weights
        float32_only=True,
    ),
)
