"""Where in the audio an audio divergence sits: each frame's error of the first divergent audio tensor,
and of every conformer layer's output, frame by frame under each clip's log-mel spectrogram (the HTML
report's "Audio" section, drawn by diff/audio_svg.py).

Computed after the diff, like the hints and the vision tower's patch map: both traces' rows of those
tensors and REF's input_features (clips, mel frames, mel bins) with their mask. Bounded: a tower of
more than MAX_ROWS frames, or inputs that do not fit its table (a trace is untrusted), give no map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.rows import item_of

from .audio_where import AUDIO, BLOCKS, frame_ms
from .result import DiffResult

MAX_ROWS = 1 << 16  # frames of the tower a map reads
MAX_BINS = 1024  # mel bins a spectrogram draws
MAX_MEL_PER_FRAME = 64  # mel frames one subsampled frame may span


@dataclass
class ClipMap:
    """One clip: REF's log-mel (valid mel frames x bins) and each strip's error per frame."""

    mel: np.ndarray  # (mel frames, bins) float, valid frames only
    mel_per_frame: float  # mel frames one subsampled frame spans (4)
    strips: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (label, rel-L2 per frame)


@dataclass
class AudioMap:
    kind: str  # the divergent audio kind's key ("audio.lconv_out")
    layer: int | None
    threshold: float  # its rel-L2 tolerance
    ms: float  # one frame's length
    clips: list[ClipMap]
    first: tuple[int, int] | None = None  # (clip, frame within it) of the first divergence


def audio_map(result: DiffResult, ref_path, run_path) -> AudioMap | None:
    """The map of the first divergence when it is in the audio tower (None otherwise, or when the
    traces cannot say where their frames sit)."""
    d = result.first_divergence
    if d is None or d.kind not in S.KIND_BY_NAME or S.KIND_BY_NAME[d.kind].tower != AUDIO:
        return None
    try:
        with TraceReader(ref_path) as ref, TraceReader(run_path) as run, np.errstate(all="ignore"):
            return _map(ref, run, S.KIND_BY_NAME[d.kind], d)
    except (TraceToolError, OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # a map is a picture of what the diff said; no picture is no error


def _errors(ref: TraceReader, run: TraceReader, kind: str, layer) -> np.ndarray | None:
    if not (ref.has(kind, layer) and run.has(kind, layer)):
        return None
    a, b = ref.read(kind, layer), run.read(kind, layer)
    if a.shape != b.shape:
        return None
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return np.sqrt(((a - b) ** 2).sum(1)) / np.maximum(np.sqrt((a**2).sum(1)), 1e-30)


def _label(kind: str, layer) -> str:
    name = S.KIND_BY_NAME[kind].name
    return f"L{layer} {BLOCKS.get(name, name)}" if layer is not None else name


def _map(ref: TraceReader, run: TraceReader, spec: S.Kind, d) -> AudioMap | None:
    info = ref.towers.get(AUDIO)
    if info is None or info.rows > MAX_ROWS or info.item_tokens != info.item_rows:
        return None  # (Gemma 4's audio: one soft token per frame)
    feats, mask = ref.extra_input("input_features"), ref.extra_input("input_features_mask")
    n = len(info.item_rows)
    if feats is None or mask is None or feats.ndim != 3 or mask.shape != feats.shape[:2] or feats.shape[0] != n:
        return None
    if feats.shape[2] > MAX_BINS or mask.dtype.kind not in "bui":
        return None
    here = _errors(ref, run, d.kind, d.layer)
    if here is None or len(here) != info.rows:
        return None
    strips = [(_label(d.kind, d.layer) + " (first divergence)", here)]
    for layer in range(info.layers):  # every layer's output, where both traces hold it
        if (spec.key, d.layer) != ("audio.layer_out", layer):
            e = _errors(ref, run, "audio.layer_out", layer)
            if e is not None and len(e) == info.rows:
                strips.append((_label("audio.layer_out", layer), e))
    clips, start = [], 0
    for i, frames in enumerate(info.item_rows):
        valid = np.asarray(mask[i]).astype(bool)
        mel = np.nan_to_num(np.asarray(feats[i], dtype=np.float64)[valid])
        per = len(mel) / frames if frames else 0.0
        if not (frames and 1 <= round(per) <= MAX_MEL_PER_FRAME):
            return None  # the mask does not fit the tower's frames
        clips.append(ClipMap(mel, per, [(label, e[start : start + frames]) for label, e in strips]))
        start += frames
    return AudioMap(d.kind, d.layer, d.threshold, frame_ms(ref.model_config), clips, item_of(spec, info, d.position))
