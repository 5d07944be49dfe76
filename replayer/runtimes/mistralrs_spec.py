"""`--runtime mistralrs`: mistral.rs's own Gemma 4 (Rust, candle) through its Python binding, on a
copy of REF's checkpoint whose config.json holds the global head fields it reads; tokens only
(replayer/runtimes/mistralrs.py)."""

from __future__ import annotations

from .captures import CaptureMap
from .spec import RuntimeSpec

ORDER = 93  # (keras-hub, built beside it, may take 95 or 100)

# replayer/runtimes/mistralrs.py: its OpenAI-style chat completion gives the chosen token and top-k
# log-probabilities (not a logits vector), so the trace holds the token alone
MISTRALRS = CaptureMap("mistral.rs's OpenAI-style completion (the chosen token, and its log-probability)", ())

RUNTIMES = (
    RuntimeSpec(
        "mistralrs",
        "gemma4_trace.replayer.runtimes.mistralrs:create",
        "mistral.rs's own Gemma 4 (Rust, candle; CPU, greedy) on REF's checkpoint, its config's global head fields "
        "written back in a temporary copy; each step a new request of the step's prefix as text, one token out",
        "float32 (f32 KV cache)",
        extra="mistralrs",
        needs=("mistralrs",),
        text_only=True,
        float32_only=True,
        cpu_only=True,
        weightless=True,
        capture_map=MISTRALRS,
        doc="docs/runtime-mistralrs.md",
    ),
)
