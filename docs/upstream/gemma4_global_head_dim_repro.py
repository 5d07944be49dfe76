"""Minimal repro: Gemma 4 loaders read `global_head_dim`, which transformers 5.24 no longer saves.

transformers 5.24 keeps Gemma 4's per-layer head dims in `per_layer_config`: a checkpoint it saves
(`save_pretrained`) has the full-attention layers' head_dim only there, `{"1": {"head_dim": 16}, ...}`,
and no top-level `global_head_dim` (nor `num_global_key_value_heads`, where the full layers' K/V
heads differ). Three Gemma 4 loaders outside transformers read the top-level field, and without it
take the sliding layers' head_dim for the full layers:

- keras-hub 0.32.0: `Gemma4Backbone.from_preset(FOLDER)` (its transformers converter) fails on the
  full layers' q_proj (`cannot reshape array of size N into shape (...)`);
- mistral.rs 0.9.5 (its Python binding, `Which.MultimodalPlain(..., arch=Gemma4)`) takes its default
  head dim (512) and refuses the weights (`shape mismatch for ....self_attn.q_proj.weight`);
- CTranslate2 4.8.5: `TransformersConverter(FOLDER)` loads the config with transformers' AutoConfig,
  whose `head_dim` raises on such a config; read as the sliding layers' value, the converter writes
  every layer with the sliding head_dim and the converted model fails at its first forward.

Needs transformers 5.24, torch and numpy, and any of keras-hub (with jax), mistralrs, ctranslate2;
a project not installed is said and skipped:

    python docs/upstream/gemma4_global_head_dim_repro.py

It builds a random Gemma 4 (a 4-layer text decoder: sliding, full, sliding, full; head_dim 8, the
full layers' 16; a 1-layer vision tower, no audio), saves it with save_pretrained, and loads the
folder as saved, then a copy whose config.json has `global_head_dim` written back at the top of its
text_config (keras-hub, mistral.rs). CTranslate2's converter reads the loaded config object, not
config.json, and 5.24's AutoConfig folds a top-level `global_head_dim` back into per_layer_config:
for it the field is set on the loaded config instead (a subclass's `load_model`, as a caller can).
Each project loads with the field; keras-hub's and CTranslate2's logits are compared with
transformers'. Exit 1 while any installed project fails on the folder as saved.

The folder gets a small word-level tokenizer.json (mistral.rs loads one); CTranslate2's converter
is given a stand-in tokenizer (it reads a vocabulary only; the repro feeds token ids).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ["KERAS_BACKEND"] = "jax"  # before keras is imported
os.environ.setdefault("RUST_LOG", "error")  # mistral.rs: its errors only
PROMPT = [2, 17, 33, 40]  # within the sliding window: nothing here depends on the window
HEAD_DIM, GLOBAL_HEAD_DIM = 8, 16


def build(folder: Path) -> Path:
    """A random tiny Gemma 4 checkpoint saved by transformers, with a word-level tokenizer.json. Multimodal
    (a 1-layer vision tower, no audio): mistral.rs's Gemma 4 loads Gemma4ForConditionalGeneration's weights."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    S, F = "sliding_attention", "full_attention"
    torch.manual_seed(0)
    text = dict(
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        global_head_dim=GLOBAL_HEAD_DIM,
        sliding_window=4,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        final_logit_softcapping=30.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        initializer_range=0.2,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    ids = dict(image_token_id=120, boi_token_id=121, eoi_token_id=122, video_token_id=123, audio_token_id=124)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **ids)
    Gemma4ForConditionalGeneration(config).save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 128)}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t, i in list(vocab.items())[:4]
        ],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {  # mistral.rs wants a decoder it knows (Gemma's)
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"})
    )
    return folder


def with_field(folder: Path, out: Path) -> Path:
    """A copy of the folder whose config.json has global_head_dim at its top again."""
    shutil.copytree(folder, out)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["global_head_dim"] = GLOBAL_HEAD_DIM
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def first_line(e: BaseException) -> str:
    """The error's type and the first sentence of its first line."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text.split('. ')[0]}"


def rel_l2(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def keras_hub(folder: Path) -> np.ndarray:
    """keras-hub's logits for PROMPT (Gemma4CausalLM.call_with_cache over an empty cache)."""
    from keras_hub.models import Gemma4Backbone, Gemma4CausalLM

    bb = Gemma4Backbone.from_preset(str(folder), dtype="float32")
    lm = Gemma4CausalLM(backbone=bb, preprocessor=None)
    head_dim = max(bb.head_dim, bb.global_head_dim or 0)  # one cache width for every layer, as its _build_cache
    cache = np.zeros([1, bb.num_layers, 2, len(PROMPT), bb.num_key_value_heads, head_dim], "float32")
    return np.asarray(lm.call_with_cache(np.array([PROMPT], "int32"), cache, 0)[0])[0]


def mistralrs(folder: Path) -> None:
    from mistralrs import ModelDType, MultimodalArchitecture, Runner, Which

    which = Which.MultimodalPlain(model_id=str(folder), arch=MultimodalArchitecture.Gemma4, dtype=ModelDType.F32)
    Runner(which=which, no_paged_attn=True)


def ctranslate2(folder: Path, out: Path, fields: dict, readable: bool) -> np.ndarray:
    """CTranslate2's forward_batch logits for PROMPT, converted by its TransformersConverter; `readable`:
    the loaded config's head_dim readable (allow_global_per_layer_attribute_access), `fields` set on it."""
    import ctranslate2 as ct2

    class NoTokens:
        bos_token, unk_token, eos_token, chat_template = "<bos>", "<unk>", "<eos>", None

        def get_vocab(self):
            return {}

    class Converter(ct2.converters.TransformersConverter):
        def load_model(self, model_class, path, **kwargs):
            config = kwargs["config"].get_text_config()
            if readable:
                config.allow_global_per_layer_attribute_access = True
            for key, value in fields.items():
                setattr(config, key, value)
            return super().load_model(model_class, path, **kwargs)

        def load_tokenizer(self, tokenizer_class, path, **kwargs):
            return NoTokens()

    try:
        Converter(str(folder)).convert(str(out), quantization="float32", force=True)
    except Exception as e:  # noqa: BLE001 - its refusal, one line
        raise RuntimeError(f"conversion: {first_line(e)}") from None
    try:
        generator = ct2.Generator(str(out), device="cpu", compute_type="float32")
        return np.array(generator.forward_batch([PROMPT]))[0]
    except Exception as e:  # noqa: BLE001 - its refusal, one line
        raise RuntimeError(f"converts; forward_batch: {first_line(e)}") from None


def main() -> int:
    import torch
    import transformers
    from transformers import Gemma4ForConditionalGeneration

    installed = {m: importlib.util.find_spec(m) is not None for m in ("keras_hub", "mistralrs", "ctranslate2")}
    print(f"transformers {transformers.__version__}")
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        saved = build(Path(tmp) / "saved")
        config = json.loads((saved / "config.json").read_text())["text_config"]
        print(
            f"a Gemma 4 (tiny vision tower, no audio) whose text decoder has 4 layers (sliding, full, sliding, full), "
            f"head_dim {HEAD_DIM}, the full layers' {GLOBAL_HEAD_DIM}; saved by save_pretrained"
        )
        print(
            f"config.json's text_config: global_head_dim: {'global_head_dim' in config}; "
            f"per_layer_config {json.dumps(config.get('per_layer_config'), sort_keys=True)}"
        )
        fixed = with_field(saved, Path(tmp) / "fixed")
        hf = Gemma4ForConditionalGeneration.from_pretrained(saved).eval()
        with torch.no_grad():
            want = hf(torch.tensor([PROMPT])).logits[0].numpy()
        print(f"transformers' next tokens for the prompt {PROMPT}: {want.argmax(-1).tolist()}")

        name = "keras-hub"
        if not installed["keras_hub"]:
            print(f"{name}: not installed")
        else:
            from importlib.metadata import version

            name = f"keras-hub {version('keras-hub')}"
            try:
                keras_hub(saved)
                print(f"{name}, the folder as saved: loads")
            except Exception as e:  # noqa: BLE001 - its refusal, one line
                failed.append(name)
                print(f"{name}, the folder as saved: {first_line(e)}")
            got = keras_hub(fixed)
            print(
                f"{name}, global_head_dim written back: loads; logits vs transformers rel-L2 {rel_l2(got, want):.2g}, "
                f"next tokens {got.argmax(-1).tolist()}"
            )

        name = "mistral.rs"
        if not installed["mistralrs"]:
            print(f"{name}: not installed")
        else:
            from importlib.metadata import version

            name = f"mistral.rs {version('mistralrs')}"
            try:
                mistralrs(saved)
                print(f"{name}, the folder as saved: loads")
            except Exception as e:  # noqa: BLE001 - its refusal, one line
                failed.append(name)
                print(f"{name}, the folder as saved: {first_line(e)}")
            mistralrs(fixed)
            print(f"{name}, global_head_dim written back: loads")

        name = "CTranslate2"
        if not installed["ctranslate2"]:
            print(f"{name}: not installed")
        else:
            from importlib.metadata import version

            name = f"CTranslate2 {version('ctranslate2')}"
            out = Path(tmp) / "ct2"
            for what, folder, readable, fields in (
                ("the folder as saved", saved, False, {}),
                ("head_dim readable (allow_global_per_layer_attribute_access)", saved, True, {}),
                ("global_head_dim written back, head_dim readable", fixed, True, {}),
                (
                    "head_dim readable, global_head_dim set on the loaded config",
                    saved,
                    True,
                    {"global_head_dim": GLOBAL_HEAD_DIM},
                ),
            ):
                try:
                    got = ctranslate2(folder, out, fields, readable)
                    print(
                        f"{name}, {what}: converts; logits vs transformers rel-L2 {rel_l2(got, want):.2g}, "
                        f"next tokens {got.argmax(-1).tolist()}"
                    )
                except Exception as e:  # noqa: BLE001 - its refusal, one line
                    if not readable:  # the converter as it is, on the folder as saved
                        failed.append(name)
                    print(f"{name}, {what}: {e}")
    print(f"BUG: {', '.join(failed)} cannot load the folder as saved" if failed else "fixed: every one loads it")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
