"""Minimal repro: litert-torch 0.10.0 gives Gemma 4's audio adapter (embed_audio) a sample 1536 wide.

`export_hf --task multimodal_lm --export_audio_encoder=True` converts
LiteRTExportableModuleForGemma4AudioAdapter with the sample inputs its get_sample_inputs returns:
features of shape (1, 204, 1536), whatever the model; embed_audio takes the audio tower's
output_proj_dims. Its encoder's sample is fixed the same way: (1, 816, 128) mel frames (`audio_204`),
whatever `input_sec` says. This script asks both modules for their samples, as the export does, and
runs the adapter on its own.

    python litert_torch_gemma4_audio_adapter_repro.py [MODEL_DIR]

MODEL_DIR: a Gemma 4 save_pretrained folder with an audio tower (default: this repository's tiny audio
model, hf/tiny_audio_model: output_proj_dims 48). Needs torch, transformers 5.24 and litert-torch
0.10.0; nothing else. Exits 1 while the adapter's sample is not output_proj_dims wide.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from litert_torch.generative.export_hf.model_ext.gemma4 import audio_exportable
from transformers import AutoFeatureExtractor, AutoModelForImageTextToText

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    model_dir = Path(sys.argv[1]) if sys.argv[1:] else ROOT / "hf" / "tiny_audio_model"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    audio = model.config.audio_config
    encoder = audio_exportable.LiteRTExportableModuleForGemma4AudioEncoder(model, None)
    fe = AutoFeatureExtractor.from_pretrained(model_dir)
    (ename, (einputs, _)), *_ = encoder.get_sample_inputs(model.config, feature_extractor=fe).items()
    print(f"{ename}: encoder sample src_inputs {tuple(einputs['src_inputs'].shape)} (fixed: input_sec is not read)")
    adapter = audio_exportable.LiteRTExportableModuleForGemma4AudioAdapter(model, None, None).eval()
    (name, (inputs, _)), *_ = adapter.get_sample_inputs(model.config).items()
    width = inputs["features"].shape[-1]
    print(f"{name}: sample features width {width}; embed_audio takes audio_config.output_proj_dims = "
          f"{audio.output_proj_dims}")  # fmt: skip
    try:
        with torch.no_grad():
            adapter(**inputs)
    except RuntimeError as e:
        print(f"the adapter fails on its own sample: {' '.join(str(e).split())[:120]}")
        return 1
    if width != audio.output_proj_dims:
        return 1
    print("the sample has the tower's width (the two are equal for this model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
