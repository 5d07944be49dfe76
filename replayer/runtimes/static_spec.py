"""The project's own runtimes: the static runtime (replayer/runtime.py) and its quantized variants
(replayer/quant.py), captured by the probe calls the static runtime makes."""

from __future__ import annotations

from . import captures as C
from .spec import RuntimeSpec

ORDER = 0  # the registry's rows, family by family in this order (the README's table)

_QUANT = dict(
    extra="quant",
    needs=("torchao",),
    isolation=True,
    recipe="gemma4_trace.replayer.quant:from_recipe",
    third_party=False,
    capture_map=C.PROBE,
)

RUNTIMES = (
    RuntimeSpec(
        "static",
        "gemma4_trace.replayer.runtime:create",
        "the project's static-shape PyTorch Gemma 4 (fixed max_seq, preallocated KV, chunked prefill)",
        "REF's dtype (float32 or bfloat16)",
        isolation=True,
        third_party=False,
        capture_map=C.PROBE,
    ),
    *(
        RuntimeSpec(
            name,
            "gemma4_trace.replayer.quant:create",
            f"the static runtime with quantize-dequantized Linear weights ({scheme})",
            "quantized (simulated)",
            doc="docs/quantized.md",
            **_QUANT,
        )
        for name, scheme in (
            ("static-w8", "int8"),
            ("static-w4g32", "int4 in groups of 32"),
            ("static-w8a8", "int8 weights and dynamic int8 activations"),
        )
    ),
)
