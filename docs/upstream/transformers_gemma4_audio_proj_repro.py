"""Minimal repro: transformers 5.24 sizes Gemma 4's audio `input_proj_linear` from the wrong field.

`Gemma4AudioSubSampleConvProjection` builds

    proj_input_dim = (config.subsampling_conv_channels[0] // 4) * config.subsampling_conv_channels[1]

but the tensor that reaches the linear is (frames, (feature_size // 4) * subsampling_conv_channels[1]):
the two stride-2 convolutions quarter the 128 log-mel bins, not the first conv's channel count. The two
agree only when subsampling_conv_channels[0] == 128 (as in every released checkpoint), so any other
audio config builds a model whose forward fails.

    python transformers_gemma4_audio_proj_repro.py

Needs torch and transformers 5.24; nothing else. Prints the linear's in_features, what the forward
hands it, and exits 1 while the bug is there.
"""

from __future__ import annotations

import sys

import torch
from transformers import Gemma4AudioConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel

MEL_BINS = 128  # the feature extractor's feature_size (Gemma4AudioFeatureExtractor default)


def main() -> int:
    torch.manual_seed(0)
    config = Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[8, 4],
        output_proj_dims=32,
    )
    model = Gemma4AudioModel(config).eval()
    expected = (MEL_BINS // 4) * config.subsampling_conv_channels[1]
    built = model.subsample_conv_projection.input_proj_linear.in_features
    print(f"input_proj_linear.in_features = {built}; the subsampled frames are {expected} wide")
    features = torch.randn(1, 40, MEL_BINS)
    try:
        with torch.no_grad():
            model(features, torch.ones(1, 40, dtype=torch.bool))
    except RuntimeError as e:
        print(f"forward fails: {e}")
        return 1
    print("forward runs: fixed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
