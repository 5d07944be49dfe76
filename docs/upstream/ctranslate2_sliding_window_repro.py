"""Minimal repro: CTranslate2 4.8.5 runs a Gemma 4 prompt without its sliding window.

`ctranslate2.converters.TransformersConverter` (Gemma4Loader.get_model_spec) sets
`spec.decoder.sliding_window = 0` "so the decoder processes all tokens at once"; each sliding layer's
own `sliding_window` then only trims the KV cache in incremental decoding. A pass over several tokens
at once (`Generator.forward_batch`, `score_batch`, and the prompt of `generate_batch(...,
include_prompt_in_result=False)`) lets every query of a sliding layer attend to every earlier key.
transformers (and Gemma 4 as trained) lets it see the last `sliding_window` keys only.

Needs ctranslate2 4.8.5, numpy, torch and transformers 5.24 (nothing else):

    python docs/upstream/ctranslate2_sliding_window_repro.py

It builds a random 4-layer dense Gemma 4 (sliding, full, sliding, full; sliding_window 4; no KV
sharing, per-layer inputs or MoE), converts it and compares the logits of a 10-token prompt with
transformers'. Expected: every position equal to float32 rounding. Observed: positions 0-3 (whose
queries see at most 4 keys) equal, positions 4-9 not, and different greedy tokens. Exit 1 while the
bug holds.

Two things of the converter's are set aside here, both unrelated to the bug: transformers 5.24 keeps
Gemma 4's full-attention head_dim (and K/V heads) in `per_layer_config`, where the converter reads
`config.head_dim` (which raises AmbiguousGlobalPerLayerAttributeError on such a config) and
`global_head_dim`; `load_model` below sets them as older transformers releases did. And the converter
loads a tokenizer for its vocabulary only: a stand-in gives none (the repro feeds token ids).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPT = [2, 17, 33, 40, 51, 60, 71, 80, 90, 100]
WINDOW = 4


def build(folder: Path) -> Path:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    S, F = "sliding_attention", "full_attention"
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        global_head_dim=16,
        sliding_window=WINDOW,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        final_logit_softcapping=30.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        initializer_range=0.2,
    )
    Gemma4ForCausalLM(config).save_pretrained(folder / "hf")
    return folder / "hf"


def convert(model: Path, out: Path) -> None:
    import ctranslate2

    class NoTokens:
        bos_token, unk_token, eos_token, chat_template = "<bos>", "<unk>", "<eos>", None

        def get_vocab(self):
            return {}

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_model(self, model_class, path, **kwargs):
            config = kwargs["config"]  # transformers 5.24: head dims per layer (see the docstring)
            config.allow_global_per_layer_attribute_access = True
            config.global_head_dim = 16
            return super().load_model(model_class, path, **kwargs)

        def load_tokenizer(self, tokenizer_class, path, **kwargs):
            return NoTokens()

    Converter(str(model)).convert(str(out), quantization="float32")


def main() -> int:
    import ctranslate2
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp))
        convert(model, Path(tmp) / "ct2")
        hf = AutoModelForCausalLM.from_pretrained(model).eval()
        with torch.no_grad():
            want = hf(torch.tensor([PROMPT])).logits[0].numpy()
            greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)[0, len(PROMPT) :]
        generator = ctranslate2.Generator(str(Path(tmp) / "ct2"), device="cpu", compute_type="float32")
        got = np.array(generator.forward_batch([PROMPT]))[0]
        tokens = [f"<extra_id_{i}>" for i in PROMPT]  # the converter's names for the ids
        runs = {
            inc: generator.generate_batch(
                [tokens], max_length=(len(PROMPT) - 1 if inc else 0) + 4, end_token=[], include_prompt_in_result=inc
            )[0].sequences_ids[0][-4:]
            for inc in (True, False)
        }
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    print(f"transformers {__import__('transformers').__version__}, ctranslate2 {ctranslate2.__version__}")
    print(
        f"a dense Gemma 4: 4 layers (sliding, full, sliding, full), window {WINDOW}; a prompt of {len(PROMPT)} tokens"
    )
    print(
        "forward_batch logits vs transformers, rel-L2 by position: "
        + "  ".join(f"{i}: {r:.2g}" for i, r in enumerate(rel))
    )
    print(f"positions 0-{WINDOW - 1} (within the window): max rel-L2 {rel[:WINDOW].max():.2g}")
    print(f"positions {WINDOW}-{len(PROMPT) - 1} (past it): min rel-L2 {rel[WINDOW:].min():.2g}")
    print(f"next token by position: transformers {want.argmax(-1).tolist()}, forward_batch {got.argmax(-1).tolist()}")
    print(
        f"greedy, 4 tokens: transformers {greedy.tolist()}; generate_batch, the prompt fed token by token {runs[True]}"
    )
    print(f"greedy, 4 tokens: generate_batch, the prompt at once (include_prompt_in_result=False) {runs[False]}")
    bug = rel[WINDOW:].min() > 1e-2 and rel[:WINDOW].max() < 1e-5
    print(
        "BUG: the prompt pass attends past the sliding window"
        if bug
        else "fixed: the prompt pass keeps the sliding window"
    )
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
