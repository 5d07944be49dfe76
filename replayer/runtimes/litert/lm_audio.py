"""`--runtime litert-lm` on an audio prompt (lm.py runs the replay): LiteRT-LM takes a clip only as an
audio file (or its bytes) through its Conversation API, and computes the clip's log-mel features
itself, from the waveform. REF holds HF's features alone, not the waveform they came from: the replay
takes the clip REF was recorded from as `--audio FILE` (`--audio-features native`, as llama.cpp's
own front end), refused in one line unless HF's feature extractor makes REF's features of it.

- the bundle: litert-torch's `export_hf --task multimodal_lm --export_audio_encoder=True`, float32
  (its audio encoder at its own sample of 816 mel frames, `audio_204`, which LiteRT-LM pads a clip
  to), the adapter's sample output_proj_dims wide where litert-torch's 1536 fails (audio.py's
  adapter_note, said on stderr and in the runtime's name), kept in the artifact cache;
- the clip: the samples `trace record --audio` fed HF's feature extractor (hf/audio.py: mono, at the
  extractor's rate), written as a float32 WAV file, handed to LiteRT-LM where REF's <|audio> ...
  <audio|> run stands (engine.py's LiteRTLMEngine: its conversation's template puts LiteRT-LM's audio
  placeholder there, and LiteRT-LM writes its own run of soft tokens).
"""

from __future__ import annotations

import json
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

from gemma4_trace.traces.errors import TraceToolError, one_line

SAME_CLIP = 1e-4  # rel-L2 of HF's features of --audio FILE against REF's: the clip REF was recorded from
WHY_NO_CLIP = (
    "--runtime litert-lm takes an audio prompt as the clip's waveform (LiteRT-LM computes its own log-mel "
    "features) and REF holds only HF's features: give --audio-features native --audio FILE (the clip REF was "
    "recorded from)"
)


def clip_files(loaded, extra: dict, clip, folder: Path) -> list[str]:
    """REF's clip as a WAV file in `folder` (one clip: --audio FILE's), refused in one line unless
    `clip` (registry's header of --audio: its samples at the feature extractor's rate) is the clip
    REF was recorded from."""
    if clip is None or getattr(clip, "samples", None) is None:
        raise TraceToolError(WHY_NO_CLIP)
    if "pixel_values" in extra:
        raise TraceToolError("--runtime litert-lm replays a prompt with images or with audio, not both")
    feats = np.asarray(extra["input_features"], np.float32)
    mask = np.asarray(extra.get("input_features_mask", np.ones(feats.shape[:2]))).astype(bool)
    if feats.ndim != 3 or len(feats) != 1:
        raise TraceToolError(f"--audio FILE is one clip; REF's input_features {tuple(feats.shape)} are not one clip's")
    fe = loaded.processor.feature_extractor
    out = fe([clip.samples], sampling_rate=fe.sampling_rate, return_tensors="np")
    mine = np.asarray(out["input_features"][0])[np.asarray(out["input_features_mask"][0]).astype(bool)]
    valid = feats[0][mask[0]]
    err = _rel_l2(valid, mine) if mine.shape == valid.shape else None
    if err is None or err > SAME_CLIP:
        raise TraceToolError(
            f"--audio {one_line(clip.path, 80)} is not the clip REF was recorded from: HF's features of it are "
            f"{mine.shape[0]} frames, REF's {valid.shape[0]}" + (f", rel-L2 {err:.1e}" if err is not None else "")
        )
    import soundfile as sf

    path = folder / "clip0.wav"
    sf.write(str(path), np.asarray(clip.samples, np.float32), int(fe.sampling_rate), subtype="FLOAT")
    return [str(path)]


def _rel_l2(ref, run) -> float:
    ref, run = np.asarray(ref, np.float64), np.asarray(run, np.float64)
    return float(np.linalg.norm(run - ref) / max(np.linalg.norm(ref), 1e-30))


def audio_runs(loaded, ids: list[int], count: int) -> list[tuple[int, int]]:
    """Each clip's <|audio> ... <audio|> positions in REF's prompt, one run a clip."""
    boa, eoa = int(loaded.config.boa_token_id), int(loaded.config.eoa_token_index)
    runs = []
    for a, t in enumerate(ids):
        if t == boa:
            b = next((j for j in range(a + 1, len(ids)) if ids[j] == eoa), None)
            if b is None:
                raise TraceToolError(f"REF's prompt opens a clip at position {a} and never closes it")
            runs.append((a, b))
    if len(runs) != count:
        raise TraceToolError(f"REF's prompt has {len(runs)} audio runs for {count} clips")
    return runs


def lm_audio_exported(loaded, S: int):
    """The artifact holding BUNDLE with litert-torch's audio sections (prefill and cache S, float32)."""
    from ...artifacts import artifact_folder, code_digest, staged_checkpoint
    from . import audio as A
    from . import export as E

    E.check_checkpoint(loaded.model_dir)
    width = int(loaded.config.audio_config.output_proj_dims) if A.adapter_note(loaded.config.audio_config) else None
    key = {
        **E.export_key(loaded, S, S),
        "graph": "litert-lm audio",
        "adapter_width": width,
        "code": code_digest("runtimes/litert/lm_audio.py"),
        "litert-lm-builder": version("litert-lm-builder"),
    }

    def build(folder: Path) -> None:
        work = folder / "work"
        work.mkdir()
        staged = staged_checkpoint(loaded.model_dir, folder / "checkpoint")
        E.run_tool(
            [sys.executable, "-m", __name__, "export", str(staged), str(work), str(int(S)), json.dumps(width)],
            "litert-torch's Gemma 4 export with its audio encoder (export_hf --export_audio_encoder)",
            cwd=work,
        )
        if not (work / E.BUNDLE).is_file():
            raise TraceToolError(f"litert-torch's audio export wrote no {E.BUNDLE}")
        (work / E.BUNDLE).rename(folder / E.BUNDLE)
        shutil.rmtree(work)
        shutil.rmtree(folder / "checkpoint")

    return artifact_folder(
        "litert", key, build, what=f"exporting {loaded.name} with litert-torch for LiteRT-LM (cache {S}, audio encoder)"
    )


def _export(model: str, out: str, S: str, width: str) -> None:
    """The child's work: export_hf with the audio encoder, float32, the adapter's sample `width` wide
    where it is given (lm_audio_exported)."""
    import torch
    from litert_torch.generative.export_hf import export as X
    from litert_torch.generative.export_hf.model_ext.gemma4 import audio_exportable as AE

    from . import audio as A
    from . import export as E

    w, rows = json.loads(width), A.rows_of(A.UPSTREAM_FRAMES)
    if w:
        sample = {f"audio_adapter_{rows}": ({"features": torch.zeros(1, rows, w), "mask": torch.ones(1, rows) > 0}, {})}
        AE.LiteRTExportableModuleForGemma4AudioAdapter.get_sample_inputs = lambda self, cfg, **kw: sample
    X.export(
        model, out, task="multimodal_lm", prefill_lengths=[int(S)], cache_length=int(S), quantization_recipe="none",
        externalize_embedder=True, k_ts_idx=E.K_AXIS, v_ts_idx=E.V_AXIS, keep_temporary_files=True,
        export_vision_encoder=False, export_audio_encoder=True, audio_encoder_quantization_recipe="none",
    )  # fmt: skip


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "export":
        _export(*args)
