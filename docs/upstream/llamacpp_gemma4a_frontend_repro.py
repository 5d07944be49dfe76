"""Minimal repro: llama.cpp's Gemma 4 audio front end (mtmd-audio.cpp, mtmd_audio_preprocessor_gemma4a)
takes log(max(mel, 0.001)) where HF's Gemma4AudioFeatureExtractor takes log(mel + 0.001).

Run from a checkout with the llamacpp and audio extras (llama-cpp-python 0.3.36, gguf, soundfile, soxr):

    python docs/upstream/llamacpp_gemma4a_frontend_repro.py [CLIP.wav]

It replays the embedded audio model (hf/tiny_audio_model) on the clip with llama.cpp computing its own
features (`--audio-features native`), reads mtmd's log-mel off the audio graph, and compares it with
(a) HF's feature extractor (expected: the same features), (b) HF's steps with the floor as
llama.cpp applies it (observed: llama.cpp matches this to float32 rounding). Prints one line per
comparison; exit 1 if the difference holds (llama.cpp is nearer (b) than (a)).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(clip_path: str) -> int:
    from transformers import AutoFeatureExtractor

    from gemma4_trace.hf.audio import load_clip
    from gemma4_trace.recorder.record import record_trace
    from gemma4_trace.replayer.replay import replay_trace
    from gemma4_trace.replayer.runtimes.llamacpp import audio as AU

    model = ROOT / "hf" / "tiny_audio_model"
    fe = AutoFeatureExtractor.from_pretrained(model)
    samples = load_clip(clip_path, fe.sampling_rate).samples.astype(np.float64)
    # HF's steps (feature_extraction_gemma4.py): semicausal pad, frames of frame_length + 1 every hop
    # (the last sample dropped), periodic Hann, |rfft(512)|, HTK mel filters, then the floor
    w = np.pad(samples, (fe.frame_length // 2, 0))
    n = (len(w) - (fe.frame_length + 1)) // fe.hop_length + 1
    frames = w[np.arange(n)[:, None] * fe.hop_length + np.arange(fe.frame_length)[None]] * fe.window
    mel = np.abs(np.fft.rfft(frames, n=fe.fft_length, axis=-1)) @ fe.mel_filters
    expected = np.log(mel + fe.mel_floor)  # HF: log(mel + floor)
    floored = np.log(np.maximum(mel, fe.mel_floor))  # llama.cpp: log(max(mel, floor))

    captured = []
    orig = AU.prefill_audio

    def keep(rt, *args):
        out = orig(rt, *args)
        captured.extend(run for _, run in rt.frontend)
        return out

    AU.prefill_audio = keep
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref.h5"
        record_trace(
            model_dir=str(model), prompt="Transcribe the audio.", audios=[clip_path], max_new_tokens=1, output=ref
        )
        replay_trace(
            ref,
            Path(tmp) / "run.h5",
            model_dir=str(model),
            runtime="llama.cpp",
            audio_features="native",
            audio=clip_path,
        )
    observed = captured[0].astype(np.float64)
    k = min(len(observed), len(expected))
    a, b = rel(observed[:k], expected[:k]), rel(observed[:k], floored[:k])
    print(f"llama.cpp's log-mel vs HF's log(mel + 0.001):      rel-L2 {a:.2e}  (expected ~1e-6)")
    print(f"llama.cpp's log-mel vs HF's steps, log(max(mel, 0.001)): rel-L2 {b:.2e}")
    print(f"mel values below 10 x the floor: {float((mel < 10 * fe.mel_floor).mean()) * 100:.0f}%")
    return 1 if b < a else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "hf" / "tiny_audio_model" / "example.wav")))
