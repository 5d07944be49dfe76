"""Where in the audio a divergence of the audio tower sits: its clip, its frame within the clip and the
time of that frame, and the conformer block of its kind (the text sentence's `clip 1, audio layer 0,
block lconv, frame 17 (0.68 s)`, which diff/report.py writes; the JSON's `clip`, `frame`, `time_s`, `block`).

One row of the audio tower is one subsampled frame, clip after clip (the tower's table gives each
clip's frames): `audio_ms_per_token` of the processor long (40 ms: 4 log-mel frames of a 10 ms hop),
read from the trace's model config where it says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.layers import TowerInfo
from gemma4_trace.traces.rows import item_of

AUDIO = "audio"
DEFAULT_FRAME_MS = 40.0  # the processor's audio_ms_per_token (Gemma 4): 4 mel frames of hop 160 at 16 kHz
# the conformer block each per-layer audio kind is the output of
BLOCKS = {"ff1_out": "ff1", "attn_out": "attn", "lconv_out": "lconv", "ff2_out": "ff2", "layer_out": "layer output"}


def frame_ms(config) -> float:
    """Milliseconds of audio one subsampled frame holds: the config's audio_ms_per_token (top level or
    audio_config) when it is a sane number, else 40."""
    for where in (config, (config or {}).get("audio_config") if isinstance(config, dict) else None):
        v = where.get("audio_ms_per_token") if isinstance(where, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= 10_000:
            return float(v)
    return DEFAULT_FRAME_MS


@dataclass
class AudioPlace:
    """An audio row for people: clip (from 1, as the sentence shows it), frame within the clip (from 0),
    its start in seconds, and the block its kind is the output of."""

    clip: int
    frame: int
    time_s: float
    block: str
    ms: float = DEFAULT_FRAME_MS  # one frame's length (not in the JSON: time_s says it)

    def to_json(self) -> dict:
        return {"clip": self.clip, "frame": self.frame, "time_s": self.time_s, "block": self.block}


def audio_place(kind: str, info: TowerInfo, row: int, ms: float = DEFAULT_FRAME_MS) -> AudioPlace | None:
    """The place of row `row` of an audio kind (None for a kind of another tower)."""
    spec = S.KIND_BY_NAME.get(kind)
    if spec is None or spec.tower != AUDIO:
        return None
    clip, within = item_of(spec, info, int(row))
    return AudioPlace(clip + 1, within, round(within * ms / 1000.0, 6), BLOCKS.get(spec.name, spec.name), ms)
