"""`--runtime llama.cpp` on audio prompts (the parent's half; the child's is mtmd_audio.py): each clip
through llama.cpp's mtmd with the project's mmproj conversion of the audio tower
(gguf_mmproj_audio.py), its sites captured, its soft tokens decoded at the prompt's audio token slots.

`--audio-features` says what the tower is fed:
- `hf` (the default): HF's log-mel features from REF (`input_features`, the clip's valid frames),
  written over mtmd's own in the graph (mtmd_audio.py). mtmd is handed a silent clip of the length
  that makes as many frames; the tower alone is compared.
- `native`: the clip's waveform (`--audio FILE`, the file REF was recorded from; the trace holds
  only HF's features), from which mtmd computes its own features: the real deployment. The file is
  read as `trace record --audio` reads it (hf/audio.py: mono, resampled to the feature
  extractor's rate), and refused unless HF's feature extractor makes REF's features of it. mtmd's
  features are read off the graph and their difference from REF's is part of the runtime's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError, one_line

from ...api import report
from ...artifacts import artifact_folder, code_digest, model_hash
from . import gguf_mmproj_audio as GA

AUDIO_FEATURES = ("hf", "native")
MMPROJ_CODE = "runtimes/llamacpp/gguf_mmproj_audio.py"
SAME_CLIP = 1e-4  # rel-L2 of HF's features of --audio FILE against REF's: the clip REF was recorded from
MAX_AUDIO_BYTES = 512 << 20


@dataclass
class AudioFile:
    """`--audio FILE` (a companion file input, llamacpp/spec.py): the path, then its samples."""

    path: Path
    samples: np.ndarray | None = None
    notes: list = field(default_factory=list)


def read_audio(path) -> AudioFile:
    """Before the model loads: a regular file of at most MAX_AUDIO_BYTES (hf/files.py)."""
    from gemma4_trace.hf.files import check_input_file

    check_input_file(str(path), "audio", MAX_AUDIO_BYTES)
    return AudioFile(Path(path))


def check_audio(loaded, header: AudioFile, allow_config_mismatch: bool) -> list[str]:
    """The clip decoded as `trace record --audio` decodes it, at the model's feature extractor's rate."""
    from gemma4_trace.hf.audio import audio_rate, load_clip

    clip = load_clip(str(header.path), audio_rate(loaded))
    header.samples = clip.samples
    return [clip.note] if clip.note else []


def audio_artifact(loaded):
    """The artifact-cache entry holding `loaded`'s audio (and vision) tower as an F32 mmproj GGUF."""
    GA.check_supported(loaded)
    key = {"model": model_hash(loaded.model_dir), "code": code_digest(MMPROJ_CODE), "file": GA.MMPROJ_NAME}

    def build(folder: Path) -> None:
        from . import gguf_writer as GW

        GA.write(GW.with_weights(loaded), folder / GA.MMPROJ_NAME)

    return artifact_folder("gguf", key, build, what=f"writing {loaded.name}'s audio tower as an mmproj GGUF (F32)")


def name_note(mode: str, audio: AudioFile | None) -> str:
    """What the runtime's name says of its audio tower."""
    fed = "HF's log-mel features (REF's)" if mode == "hf" else f"llama.cpp's own log-mel of {audio.path.name}"
    return f"audio: mtmd gemma4a, its sites found by position in the graph, fed {fed}"


def rel_l2(ref: np.ndarray, run: np.ndarray) -> float:
    ref, run = ref.astype(np.float64), run.astype(np.float64)
    return float(np.linalg.norm(run - ref) / max(np.linalg.norm(ref), 1e-30))


def _hf_features(loaded, samples) -> np.ndarray:
    fe = loaded.processor.feature_extractor
    out = fe([samples], sampling_rate=fe.sampling_rate, return_tensors="np")
    return np.asarray(out["input_features"][0])[np.asarray(out["input_features_mask"][0]).astype(bool)]


def silent_clip(frames: int, loaded) -> np.ndarray:
    """Samples from which mtmd's gemma4a front end makes `frames` mel frames (mtmd-audio.cpp: a
    semicausal left pad of window / 2, frames of window + 1 samples every hop)."""
    fe = loaded.processor.feature_extractor
    return np.zeros((frames - 1) * int(fe.hop_length) + int(fe.frame_length) // 2 + 1, dtype=np.float32)


def prefill_audio(rt, ids: list[int], extra: dict, probe, runs: list[tuple[int, int]]):
    """The prompt with clips (`runs`: (start, length) of each clip's audio token slots): each clip
    through mtmd (its audio sites reported clip after clip), then the text tokens and each clip's
    soft tokens decoded in prompt order."""
    if "pixel_values" in extra:
        raise TraceToolError("llama.cpp replays a prompt with images or with audio, not both (not supported yet)")
    loaded, mode, audio = rt.loaded, rt.audio_features, rt.audio_file
    feats = np.asarray(extra["input_features"], dtype=np.float32)
    mask = np.asarray(extra.get("input_features_mask", np.ones(feats.shape[:2]))).astype(bool)
    if len(runs) != len(feats):
        raise TraceToolError(f"the prompt has {len(runs)} runs of audio tokens for {len(feats)} clips")
    if mode == "native" and len(feats) != 1:
        raise TraceToolError(f"--audio-features native takes one clip (--audio FILE); REF has {len(feats)}")
    rt.load_audio()
    got: dict[tuple[str, int | None], list[np.ndarray]] = {}
    soft = []
    for i, (start, slots) in enumerate(runs):
        valid = feats[i][mask[i]]
        if mode == "native":
            mine = _hf_features(loaded, audio.samples)
            if mine.shape != valid.shape or rel_l2(valid, mine) > SAME_CLIP:
                raise TraceToolError(
                    f"--audio {one_line(audio.path, 80)} is not the clip REF was recorded from: HF's features of it "
                    f"are {mine.shape[0]} frames, REF's {valid.shape[0]}"
                    + (f", rel-L2 {rel_l2(valid, mine):.1e}" if mine.shape == valid.shape else "")
                )
            samples, given = audio.samples, None
        else:
            samples, given = silent_clip(len(valid), loaded), valid
        one: dict = {}  # (kind, layer) -> array: a CLAMP read after its product replaces it
        _, embd, non_causal, mel = rt.child.call(
            "encode_audio",
            samples,
            given,
            phase=f"prefill (clip {i + 1})",
            tensor=lambda kind, layer, arr, one=one: one.__setitem__((kind, layer), arr),
        )
        if len(embd) != slots:
            raise TraceToolError(
                f"llama.cpp's mtmd made {len(embd)} soft tokens of clip {i + 1} where the trace has {slots} "
                f"({len(valid)} mel frames)"
            )
        if mel is not None:
            rt.frontend.append((valid, mel))
        for key, arr in one.items():
            got.setdefault(key, []).append(arr.reshape(-1, arr.shape[-1]))
        soft.append((start, embd, non_causal))
    order = {key: n for n, key in enumerate(S.KIND_BY_NAME)}
    for kind, layer in sorted(got, key=lambda kl: (-1 if kl[1] is None else kl[1], order[kl[0]])):
        spec = S.KIND_BY_NAME[kind]
        report(probe, spec.name, torch.from_numpy(np.concatenate(got[(kind, layer)])), layer, tower=spec.tower)
    return rt.decode_soft(ids, soft, probe)


def frontend_figures(pairs) -> list[str]:
    """Per clip: llama.cpp's log-mel against REF's input_features (rel-L2 overall, worst frame)."""
    out = []
    for i, (ref, run) in enumerate(pairs):
        if ref.shape != run.shape:
            out.append(f"clip {i + 1}: llama.cpp made {run.shape[0]} mel frames, REF has {ref.shape[0]}")
            continue
        rows = np.linalg.norm(run - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
        out.append(f"clip {i + 1}: log-mel rel-L2 {rel_l2(ref, run):.2e} (worst frame {float(rows.max()):.2e})")
    return out
