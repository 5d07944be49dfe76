"""Audio clips for `trace record --audio`: read with soundfile, mixed to mono, resampled with soxr.

A clip is untrusted input. Before anything is decoded: a regular file (never a FIFO, a device or
a folder), at most MAX_AUDIO_BYTES, a header soundfile (libsndfile: WAV, FLAC, OGG, MP3, ...)
can read, some samples, at most MAX_CLIP_SECONDS (the feature extractor keeps 30 s, 750 soft
tokens), a sane rate and channel count, and at most MAX_DECODED_BYTES once decoded. After: as
many frames as the header claims (else it is truncated) and every sample finite. What is changed
to make the clip fit the feature extractor (channels mixed down, the rate converted by soxr's
high-quality resampler) is said in a note, one line per clip.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line

from .files import check_input_file

MAX_AUDIO_BYTES = 512 << 20  # a clip file at most
MAX_CLIP_SECONDS = 30.0  # the feature extractor's default max_length (480 000 samples at 16 kHz)
MAX_DECODED_BYTES = 256 << 20  # float32 samples of every channel, decoded
RATES = (1_000, 768_000)  # sample rates a clip may have, Hz
MAX_CHANNELS = 64
# libsndfile's log of a WAV whose data chunk claims more bytes than the file holds (it reads what is there)
_SHORT_DATA = re.compile(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", re.M)
_STREAMED = (0, 0xFFFFFFFF)  # the sizes a streaming writer leaves in the header: not a truncation


@dataclass(frozen=True)
class Clip:
    samples: object  # float32 numpy (n,) at the feature extractor's rate
    note: str | None  # what was done to it (mixed down, resampled), for people


def load_clip(path: str, rate: int) -> Clip:
    """The clip at `path` as mono float32 samples at `rate` Hz, or one line (TraceToolError)."""
    shown = one_line(path, 80)
    check_input_file(path, "audio", MAX_AUDIO_BYTES)
    sf = _module("soundfile")
    try:
        info = sf.info(path)
    except Exception as e:  # noqa: BLE001 - libsndfile's errors on a file it cannot parse, whatever they are
        raise TraceToolError(f"audio {shown} is not a readable audio file ({one_line(e, 120)})") from None
    short = _SHORT_DATA.search(getattr(info, "extra_info", "") or "")
    if short and int(short[1]) > int(short[2]) and int(short[1]) not in _STREAMED:
        raise TraceToolError(
            f"audio {shown} is truncated: its header claims {short[1]} bytes of samples, the file holds {short[2]}"
        )
    sr, channels, frames = int(info.samplerate), int(info.channels), int(info.frames)
    if not RATES[0] <= sr <= RATES[1]:
        raise TraceToolError(f"audio {shown} has a sample rate of {sr} Hz, outside {RATES[0]}..{RATES[1]}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise TraceToolError(f"audio {shown} has {channels} channels, outside 1..{MAX_CHANNELS}")
    if frames <= 0:
        raise TraceToolError(f"audio {shown} holds no samples (0 s)")
    seconds = frames / sr
    if seconds > MAX_CLIP_SECONDS:
        raise TraceToolError(
            f"audio {shown} is {seconds:.1f} s long, more than the {MAX_CLIP_SECONDS:.0f} s the feature "
            "extractor takes (cut it first)"
        )
    if frames * channels * 4 > MAX_DECODED_BYTES:
        raise TraceToolError(f"audio {shown}: {frames} frames x {channels} channels is more than can be decoded")
    try:
        data, _ = sf.read(path, frames=frames, dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - a damaged stream fails while decoding in libsndfile's ways
        raise TraceToolError(f"audio {shown} cannot be decoded ({one_line(e, 120)})") from None
    return _fit(data, sr, rate, frames, shown)


def _fit(data, sr: int, rate: int, frames: int, shown: str) -> Clip:
    import numpy as np

    if data.shape[0] < frames:
        raise TraceToolError(f"audio {shown} is truncated: its header claims {frames} frames, {data.shape[0]} read")
    if not np.isfinite(data).all():
        raise TraceToolError(f"audio {shown} holds NaN or infinite samples")
    done = []
    if data.shape[1] > 1:
        done.append(f"{data.shape[1]} channels mixed down to mono")
    mono = data.mean(axis=1, dtype=np.float64).astype(np.float32)
    if sr != rate:
        soxr = _module("soxr")
        mono = soxr.resample(mono, sr, rate, quality="HQ").astype(np.float32)
        done.append(f"resampled from {sr} Hz to {rate} Hz")
    if mono.size == 0:
        raise TraceToolError(f"audio {shown} is shorter than one sample at {rate} Hz")
    note = f"audio {shown}: {', '.join(done)} ({mono.size / rate:.2f} s)" if done else None
    return Clip(np.ascontiguousarray(mono), note)


def _module(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise TraceToolError(f"--audio needs {name}: {install_hint('audio')}") from None


def audio_rate(lm) -> int:
    """The sample rate the model's feature extractor takes (refused in one line where it has none)."""
    if getattr(lm.config, "audio_config", None) is None:
        raise TraceToolError(f"{lm.model_dir} has no audio tower; it cannot take --audio")
    fe = getattr(lm.processor, "feature_extractor", None)
    rate = getattr(fe, "sampling_rate", None)
    if not isinstance(rate, int) or rate <= 0:
        raise TraceToolError(f"{lm.model_dir} has no audio feature extractor; it cannot take --audio")
    return rate


def with_audio(lm, prompt: str, images, waves, chat: bool):
    """The processor's inputs for a prompt with clips (and images): the chat template rendered as
    text (clips first, then images, then the prompt), then the processor on text, images and clips."""
    p = lm.processor
    if chat:
        content = [{"type": "audio"} for _ in waves] + [{"type": "image"} for _ in images]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]
        text = p.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if text.count(p.audio_token) != len(waves):
            raise TraceToolError(f"the chat template of {lm.model_dir} places no audio token; pass --no-chat")
    else:
        text = p.audio_token * len(waves) + p.image_token * len(images) + prompt
    rate = p.feature_extractor.sampling_rate
    kw = {"images": images} if images else {}
    return p(text=text, audio=waves, sampling_rate=rate, add_special_tokens=not chat, return_tensors="pt", **kw)
