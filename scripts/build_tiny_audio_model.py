#!/usr/bin/env python
"""Build the embedded tiny audio checkpoint (hf/tiny_audio_model) from the tiny model (hf/tiny_model).

The text and vision weights, the tokenizer and the processor are the tiny model's, unchanged; this
adds a small Gemma 4 audio tower (a conformer: 2 layers, hidden 32, 2 heads, chunk 12, left context
13, logit cap 50, causal depthwise conv of width 5; output_proj_dims 48, projected by embed_audio
into the text tower's 64) with seeded random weights, norms and per-dim scales perturbed so that
a port that drops one shows it. The tower is untrained: an audio prompt's tokens are not words.
The chat template gains the audio placeholder. The speech clip `example.wav` is espeak-ng's
(22.05 kHz mono, so a recording resamples it) when espeak-ng is installed; else the checked-in one
is kept.

Usage: python scripts/build_tiny_audio_model.py [--src hf/tiny_model] [--out hf/tiny_audio_model]

Deterministic: two runs write bit-identical weights (fixed seed, one thread).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import torch

from gemma4_trace.hf.model import DEMO_AUDIO_TEXT, embedded_audio_model_dir, embedded_model_dir

SEED = 4321
AUDIO_CONFIG = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    # transformers 5.24 sizes input_proj_linear from subsampling_conv_channels[0] where it means the
    # feature size (128): they must agree (docs/upstream/transformers-gemma4-audio-proj-size.md)
    subsampling_conv_channels=[128, 8],
    output_proj_dims=48,
    conv_kernel_size=5,
)
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "generation_config.json",
    "example.png",
)


def build(src: Path, out: Path) -> None:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    cfg = json.loads((src / "config.json").read_text())
    cfg["audio_config"] = dict(AUDIO_CONFIG)
    for key in ("transformers_version", "architectures"):
        cfg.pop(key, None)
    config = Gemma4Config(**cfg)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    model = Gemma4ForConditionalGeneration(config).float().eval()
    base = Gemma4ForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(".audio_tower." in k or ".embed_audio." in k for k in missing), missing
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".audio_tower." not in name and ".embed_audio." not in name:
                continue
            if name.endswith("per_dim_scale"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # norm weights and biases: not the identity a port could skip
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("*.safetensors"):
        p.unlink()
    model.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)
    for name in COPIED:
        shutil.copyfile(src / name, out / name)
    template = (src / "chat_template.jinja").read_text()
    image = "{%- if item['type'] == 'image' -%}{{- '<|image|>' -}}\n"
    assert image in template
    audio = "{%- elif item['type'] == 'audio' -%}{{- '<|audio|>' -}}\n"
    (out / "chat_template.jinja").write_text(template.replace(image, image + audio))
    speech(out / "example.wav")
    n = sum(p.numel() for n, p in model.named_parameters() if "audio" in n)
    print(f"wrote {out}: audio tower + embed_audio {n} parameters")


def speech(path: Path) -> None:
    """espeak-ng's reading of DEMO_AUDIO_TEXT as a 16-bit WAV (its own 22.05 kHz rate)."""
    if shutil.which("espeak-ng") is None:
        print(f"espeak-ng is not installed: {path} kept as it is")
        return
    subprocess.run(["espeak-ng", "-v", "en", "-s", "160", "-w", str(path), DEMO_AUDIO_TEXT], check=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=embedded_model_dir())
    ap.add_argument("--out", type=Path, default=embedded_audio_model_dir())
    args = ap.parse_args(argv)
    build(args.src, args.out)


if __name__ == "__main__":
    main()
