"""The golden traces shipped in traces/golden/: what each covers, how to regenerate them.

Each golden is HF on the embedded tiny model (float32, CPU). HASHES lists the content hash
(`trace show --hash`) of each, so an accidental change is visible in review.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from gemma4_trace.hf.model import DEMO_IMAGE, DEMO_IMAGE_PROMPT, DEMO_PROMPT, DEMO_WIDE_IMAGE
from gemma4_trace.traces import TraceReader

# the package data folder traces/golden (the only definition of where the goldens live)
GOLDEN_DIR = Path(str(files("gemma4_trace.traces") / "golden"))
HASHES = GOLDEN_DIR / "HASHES"

# name: (prompt, images, max_new_tokens) -- what each golden covers
GOLDENS = {
    "short": (DEMO_PROMPT, [], 3),  # a short text prompt, a few decode steps
    "window": (DEMO_PROMPT, [], 24),  # 13 + 24 positions: crosses the sliding window (8) several times
    "image": (DEMO_IMAGE_PROMPT, [DEMO_IMAGE], 16),  # image + text, bidirectional vision mask, ends at EOS
    # two images of different sizes (64 soft tokens, padded; 70, the whole budget): padding and rows image after image
    "two_images": ("Describe the images.", [DEMO_IMAGE, DEMO_WIDE_IMAGE], 8),
    "eos": (DEMO_PROMPT, [], 64),  # decodes until the model's end-of-turn token
}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.h5"


def regenerate() -> list[str]:
    """Re-record every golden with the installed transformers and rewrite HASHES."""
    from .record import record_trace

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, (prompt, images, n) in GOLDENS.items():
        lines.append(
            record_trace(
                output=golden_path(name), prompt=prompt, images=[str(i) for i in images], max_new_tokens=n, force=True
            )
        )
    HASHES.write_text("".join(f"{h}  {name}\n" for name, h in content_hashes().items()))
    return lines


def content_hashes() -> dict[str, str]:
    out = {}
    for name in GOLDENS:
        with TraceReader(golden_path(name)) as r:
            out[name] = r.content_hash()
    return out


def recorded_hashes() -> dict[str, str]:
    pairs = (line.split() for line in HASHES.read_text().splitlines() if line.strip())
    return {name: h for h, name in pairs}
