"""Minimal repro: mlx-vlm 0.7.10's Gemma 4 (`mlx_vlm/models/gemma4/gemma4.py`, Model.get_input_embeddings)
scatters every subsampled frame of every clip, padding frames included, into the audio-token slots,
where HF's Gemma4Model keeps the valid frames only (`audio_features[audio_mask_from_encoder]`). A
prompt with two clips of different lengths, the shorter first, gets the first clip's padding frames
(zeros) in the second clip's slots, and the second clip's last frames are lost.

Needs mlx (on Linux `mlx[cpu]`), mlx-vlm 0.7.10, numpy, torch, transformers 5.24:

    python docs/upstream/mlx_vlm_gemma4_audio_padding_repro.py [MODEL_DIR]

MODEL_DIR: a Gemma 4 checkpoint with an audio tower (default: this repository's 2-layer
hf/tiny_audio_model; the real ones: gemma-4-E2B-it, gemma-4-E4B-it). It is loaded by HF and by
mlx-vlm (from a temporary copy whose config.json gets `text_config.global_head_dim`, which mlx-vlm
reads where transformers 5.24 writes `per_layer_config`: a separate finding). Two synthetic clips
(1.0 s, then 2.0 s: the first is padded in the batch) go through HF's processor; the soft tokens
at each clip's audio-token slots are compared: expected, mlx-vlm's equal HF's (float32 rounding);
observed, the second clip's are not. Exit 1 while the bug holds.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def fixed_copy(model_dir: Path, into: Path) -> Path:
    """A folder mlx-vlm loads: config.json with global_head_dim from per_layer_config, links to the weights."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg["text_config"]
    dims = {v["head_dim"] for v in (text.get("per_layer_config") or {}).values() if "head_dim" in v}
    if dims and "global_head_dim" not in text:
        text["global_head_dim"] = dims.pop()
    (into / "config.json").write_text(json.dumps(cfg))
    for f in model_dir.glob("*.safetensors*"):
        (into / f.name).symlink_to(f.resolve())
    return into


def main(model_dir: Path) -> int:
    import mlx.core as mx
    import torch
    from mlx_vlm.utils import load_model
    from transformers import AutoFeatureExtractor, Gemma4ForConditionalGeneration

    extractor = AutoFeatureExtractor.from_pretrained(model_dir)
    hf = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    rate = extractor.sampling_rate
    rng = np.random.default_rng(0)
    t = np.arange(2 * rate) / rate
    long = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    clips = [long[:rate], long]  # the shorter first: the batch pads it
    batch = extractor(clips, sampling_rate=rate, return_tensors="pt", return_attention_mask=True)
    feats, mask = batch["input_features"], batch["input_features_mask"].bool()
    print(f"clips: mel frames {mask.sum(-1).tolist()} (padded to {mask.shape[1]})")

    with torch.no_grad():  # HF: Gemma4Model.forward keeps audio_features[attention_mask] (the valid frames)
        out = hf.model.get_audio_features(feats, mask, return_dict=True)
        expected = out.pooler_output[out.attention_mask].numpy()
    valid = out.attention_mask.sum(-1).tolist()
    c = hf.config  # the prompt: each clip's audio tokens, one per valid frame (as the processor counts them)
    boa, eoa = c.boa_token_id, getattr(c, "eoa_token_id", None) or c.eoa_token_index
    ids = np.array([2] + sum(([boa] + [c.audio_token_id] * n + [eoa] for n in valid), []))

    with tempfile.TemporaryDirectory() as tmp:
        vlm = load_model(fixed_copy(model_dir, Path(tmp)), lazy=True)
        got = vlm.get_input_embeddings(
            input_ids=mx.array(ids[None]),
            input_features=mx.array(feats.numpy()),
            input_features_mask=mx.array(mask.numpy()),
        ).inputs_embeds
        observed = np.array(got[0])[ids == hf.config.audio_token_id]

    bad = 0
    for c, (start, n) in enumerate(zip(np.cumsum([0, *valid[:-1]]), valid)):
        x, y = expected[start : start + n], observed[start : start + n]
        rel = float(np.linalg.norm(x - y) / np.linalg.norm(x))
        zero = int((np.abs(y).max(axis=-1) == 0).sum())
        print(f"clip {c}: {n} soft tokens; mlx-vlm's vs HF's rel-L2 {rel:.2e}; rows of zeros {zero}")
        bad += rel > 1e-4
    print("BUG: mlx-vlm merges the padding frames" if bad else "fixed: mlx-vlm merges the valid frames only")
    return 1 if bad else 0


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[2] / "hf" / "tiny_audio_model"
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else default))
