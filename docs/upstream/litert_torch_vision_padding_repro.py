"""Minimal repro: litert-torch 0.10.0's Gemma 4 vision encoder attends to the padding patches.

litert-torch's export path (`export_hf --export_vision_encoder`) loads the model inside its Gemma 4
patch context, which swaps transformers' Gemma4VisionEncoder for LiteRTGemma4VisionEncoder, and
exports LiteRTExportableModuleForGemma4VisionEncoder. That module is run here in PyTorch, as the
converter is given it, against transformers' own vision tower on two images of the processor's patch
budget: one with padding patches (position (-1, -1)), one without.

    python litert_torch_vision_padding_repro.py [MODEL_DIR] [IMAGE_WITH_PADDING] [IMAGE_WITHOUT]

MODEL_DIR: a Gemma 4 save_pretrained folder with its processor (default: this repository's tiny model,
hf/tiny_model, and its two example images). Needs torch, transformers 5.24, litert-torch 0.10.0 and
Pillow; nothing else. Prints the relative L2 difference of the pooled features per image and exits 1
while the bug is there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from litert_torch.generative.export_hf.model_ext import patches
from litert_torch.generative.export_hf.model_ext.gemma4 import vision_exportable
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

ROOT = Path(__file__).resolve().parents[2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> int:
    args = sys.argv[1:]
    model_dir = Path(args[0]) if args else ROOT / "hf" / "tiny_model"
    images = [Path(a) for a in args[1:3]] or [model_dir / "example.png", model_dir / "example_wide.png"]
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with patches.get_patch_context("gemma4"):  # what litert-torch's load_model does for Gemma 4
        lrt = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    lrt.set_attn_implementation("eager")  # as export_vision_encoder_models
    encoder = vision_exportable.LiteRTExportableModuleForGemma4VisionEncoder(lrt, None).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    failed = False
    for path in images:
        inputs = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        pixels, positions = inputs["pixel_values"], inputs["image_position_ids"]
        padding = int((positions == -1).all(dim=-1).sum())
        with torch.no_grad():
            want = hf.model.vision_tower(pixels, positions).last_hidden_state  # padding stripped
            out = encoder(pixels, positions.int())
        got = out["features"][out["mask"]]
        err = rel(got, want.reshape(got.shape))
        print(f"{path.name}: {padding} padding patches of {positions.shape[1]}: pooled features rel-L2 {err:.1e}")
        failed |= padding > 0 and err > 1e-4
    if failed:
        print("the patched encoder attends to the padding patches (its attention mask is all zeros)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
