"""Minimal repro: litert-torch 0.10.0 sizes Gemma 4's vision adapter (embed_vision) by the patch width.

`export_hf --export_vision_encoder` converts LiteRTExportableModuleForGemma4VisionAdapter with the
sample inputs its get_sample_inputs returns: soft tokens of width `pixel_values.shape[-1]` (the
processor's patch width, 3 * patch_size^2), where embed_vision takes the vision tower's hidden size.
This script asks the module for its sample, as the export does, and runs the module on it.

    python litert_torch_vision_adapter_repro.py [MODEL_DIR]

MODEL_DIR: a Gemma 4 save_pretrained folder with its processor (default: this repository's tiny model,
hf/tiny_model). Needs torch, transformers 5.24 and litert-torch 0.10.0; nothing else. Exits 1 while
the sample's width is not the tower's hidden size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from litert_torch.generative.export_hf.model_ext.gemma4 import vision_exportable
from transformers import AutoImageProcessor, AutoModelForImageTextToText

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    model_dir = Path(sys.argv[1]) if sys.argv[1:] else ROOT / "hf" / "tiny_model"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    vision = model.config.vision_config
    adapter = vision_exportable.LiteRTExportableModuleForGemma4VisionAdapter(model, None, None).eval()
    samples = adapter.get_sample_inputs(model.config, image_processor=AutoImageProcessor.from_pretrained(model_dir))
    (name, (inputs, _)), *_ = samples.items()
    width = inputs["soft_tokens"].shape[-1]
    print(
        f"{name}: sample soft_tokens width {width} (3 * patch_size^2 = {3 * vision.patch_size**2}); "
        f"embed_vision takes vision_config.hidden_size = {vision.hidden_size}"
    )
    try:
        with torch.no_grad():
            adapter(**inputs)
    except RuntimeError as e:
        print(f"the adapter fails on its own sample: {' '.join(str(e).split())[:120]}")
        return 1
    if width != vision.hidden_size:
        return 1
    print("the sample has the tower's width (the two are equal for this model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
