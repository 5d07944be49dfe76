"""The golden traces shipped in traces/golden/: what each covers, how to regenerate them.

Each golden is HF on the embedded tiny model (float32, CPU). HASHES lists the content hash
(`trace show --hash`) of each, so an accidental change is visible in review.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import NamedTuple

from gemma4_trace.hf.model import (
    DEMO_AUDIO,
    DEMO_AUDIO_PROMPT,
    DEMO_IMAGE,
    DEMO_IMAGE_PROMPT,
    DEMO_PROMPT,
    DEMO_WIDE_IMAGE,
)
from gemma4_trace.traces import TraceReader

# the package data folder traces/golden (the only definition of where the goldens live)
GOLDEN_DIR = Path(str(files("gemma4_trace.traces") / "golden"))
HASHES = GOLDEN_DIR / "HASHES"


class Golden(NamedTuple):
    prompt: str
    images: list
    max_new_tokens: int
    audios: list = []  # clips: recorded with the embedded model's audio variant (hf/model.py)


# name: what each golden covers
GOLDENS = {
    "short": Golden(DEMO_PROMPT, [], 3),  # a short text prompt, a few decode steps
    "window": Golden(DEMO_PROMPT, [], 24),  # 13 + 24 positions: crosses the sliding window (8) several times
    "image": Golden(DEMO_IMAGE_PROMPT, [DEMO_IMAGE], 16),  # image + text, bidirectional vision mask, ends at EOS
    # two images of different sizes (64 soft tokens, padded; 70, the whole budget): padding and rows image after image
    "two_images": Golden("Describe the images.", [DEMO_IMAGE, DEMO_WIDE_IMAGE], 8),
    "eos": Golden(DEMO_PROMPT, [], 64),  # decodes until the model's end-of-turn token
    # a 3 s espeak-ng speech clip at 22.05 kHz (resampled): 77 frames, 7 chunks of the local attention
    "audio": Golden(DEMO_AUDIO_PROMPT, [], 6, [DEMO_AUDIO]),
}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.h5"


def regenerate(names=None) -> list[str]:
    """Re-record the goldens `names` (None: every one) with the installed transformers and rewrite HASHES."""
    from .record import record_trace

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, g in GOLDENS.items():
        if names is not None and name not in names:
            continue
        lines.append(
            record_trace(
                output=golden_path(name),
                prompt=g.prompt,
                images=[str(i) for i in g.images],
                audios=[str(a) for a in g.audios],
                max_new_tokens=g.max_new_tokens,
                force=True,
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
