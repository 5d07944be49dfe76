"""`--runtime ctranslate2`: REF's checkpoint converted by CTranslate2's own converter and run by its
C++ engine, logits only (replayer/runtimes/ctranslate2.py)."""

from __future__ import annotations

from .captures import Capture, CaptureMap
from .spec import Decoders, RuntimeSpec

ORDER = 90

# replayer/runtimes/ctranslate2.py: Generator.forward_batch over the step's whole prefix, its last row
CTRANSLATE2 = CaptureMap(
    "CTranslate2's Generator.forward_batch (logits over a sequence)",
    (Capture("forward_batch(prefix)", "logits", via="its last row"),),
)

RUNTIMES = (
    RuntimeSpec(
        "ctranslate2",
        "gemma4_trace.replayer.runtimes.ctranslate2:create",
        "REF's checkpoint converted by CTranslate2's own converter, run by its C++ engine (CPU), each step's "
        "logits from forward_batch over the whole prefix",
        "float32",
        extra="ctranslate2",
        needs=("ctranslate2",),
        text_only=True,
        float32_only=True,
        cpu_only=True,
        weightless=True,
        decoders=Decoders("dense Gemma 4 text decoders"),
        capture_map=CTRANSLATE2,
        artifacts="converted model.bin",
        doc="docs/runtime-ctranslate2.md",
    ),
)
