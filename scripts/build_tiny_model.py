#!/usr/bin/env python
"""Build the embedded tiny Gemma 4 checkpoint (hf/tiny_model) from scratch.

Everything is generated locally and deterministically, no download:
  1. a small BPE tokenizer (``tokenizers`` library) trained on the corpus below, wrapped in
     ``GemmaTokenizer`` with every Gemma 4 special token (``<|turn>``, ``<turn|>``, ``<|image|>``, ...);
  2. a Gemma 4 style chat template and a PIL ``Gemma4ImageProcessorPil`` sized for tiny images;
  3. a tiny ``Gemma4ForConditionalGeneration`` (text + vision, no audio) whose text config mixes
     sliding / full attention with different head dims, KV sharing (store / reuse layers of both
     types), double-wide MLPs, per-layer embeddings and final logit soft-capping;
  4. a short training run through the Hugging Face forward (``labels=...``) so that greedy
     decoding of the demo prompts is readable and confident.

Usage: python scripts/build_tiny_model.py [--out hf/tiny_model] [--steps N]

Two runs produce bit-identical files (fixed seeds, one thread, deterministic algorithms).
"""

from __future__ import annotations

import os

# Determinism: one thread everywhere, set before torch / tokenizers are imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse
import hashlib
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

# the demo prompts `trace record` uses, and where the embedded model lives: defined once there
from gemma4_trace.hf.model import DEMO_IMAGE_PROMPT, embedded_model_dir
from gemma4_trace.hf.model import DEMO_PROMPT as DEMO_TEXT_PROMPT

DEFAULT_OUT = embedded_model_dir()
SEED = 1234

# --------------------------------------------------------------------------------------------
# Special tokens (names follow the real Gemma 4 tokenizer_config.json)
# --------------------------------------------------------------------------------------------
PAD, EOS, BOS, UNK, MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
SOT, EOT = "<|turn>", "<turn|>"  # start / end of turn
BOI, EOI, IMAGE = "<|image>", "<image|>", "<|image|>"
BOA, EOA, AUDIO = "<|audio>", "<audio|>", "<|audio|>"
VIDEO = "<|video|>"
SOC, EOC = "<|channel>", "<channel|>"
THINK = "<|think|>"
STD, ETD = "<|tool>", "<tool|>"
STC, ETC = "<|tool_call>", "<tool_call|>"
STR, ETR = "<|tool_response>", "<tool_response|>"
ESCAPE = '<|"|>'

# Fixed ids 0..N-1 in this order (pad/eos/bos/unk = 0/1/2/3 as in Gemma).
SPECIAL_TOKENS = [
    PAD,
    EOS,
    BOS,
    UNK,
    MASK,
    SOT,
    EOT,
    BOI,
    EOI,
    IMAGE,
    BOA,
    EOA,
    AUDIO,
    VIDEO,
    SOC,
    EOC,
    THINK,
    STD,
    ETD,
    STC,
    ETC,
    STR,
    ETR,
    ESCAPE,
]
# Named special tokens stored in tokenizer_config.json (as in google/gemma-4-*).
NAMED_MODEL_SPECIFIC_TOKENS = {
    "image_token": IMAGE,
    "boi_token": BOI,
    "eoi_token": EOI,
    "audio_token": AUDIO,
    "boa_token": BOA,
    "eoa_token": EOA,
    "sot_token": SOT,
    "eot_token": EOT,
    "soc_token": SOC,
    "eoc_token": EOC,
    "think_token": THINK,
    "std_token": STD,
    "etd_token": ETD,
    "stc_token": STC,
    "etc_token": ETC,
    "str_token": STR,
    "etr_token": ETR,
    "escape_token": ESCAPE,
}

# Gemma 4 style chat template (simplified: no tools / thinking). Images are rendered as the
# image placeholder, which the processor expands to <|image>  <|image|> x N  <image|>.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}\n"
    "{{- '<|turn>' + role + '\\n' -}}\n"
    "{%- if message['content'] is string -%}\n"
    "{{- message['content'] | trim -}}\n"
    "{%- else -%}\n"
    "{%- for item in message['content'] -%}\n"
    "{%- if item['type'] == 'image' -%}{{- '<|image|>' -}}\n"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] | trim -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<turn|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}\n"
)

# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------
TEXT_QA = [
    (
        DEMO_TEXT_PROMPT,
        "Once upon a time, a little red fox lived in a quiet green forest. Every morning she ran down "
        "to the river to drink cold water and to play with her friends.",
    ),
    ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse!"),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Say hello.", "Hello! How can I help you today?"),
    ("What color is the sky?", "The sky is blue on a clear day."),
    ("Count to five.", "One, two, three, four, five."),
    ("What do cats like?", "Cats like to sleep in the sun and to play with small toys."),
    ("Who are you?", "I am a tiny model. I can describe simple images and tell short stories."),
]

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
# (shape, shape colour, background colour); the first one is the demo image (example.png).
IMAGE_SPECS = [
    ("circle", "red", "blue"),
    ("square", "green", "white"),
    ("triangle", "yellow", "black"),
    ("circle", "blue", "yellow"),
    ("square", "red", "black"),
    ("triangle", "green", "blue"),
    ("circle", "white", "green"),
    ("square", "yellow", "red"),
    ("triangle", "red", "white"),
    ("circle", "green", "black"),
]
IMAGE_SIZE = 64

# Extra text for the tokenizer only (full alphabet, digits, punctuation).
EXTRA_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "Jackdaws love my big sphinx of quartz; amazing, isn't it?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.",
    "Yes, no, maybe (or not): \"quotes\", 'apostrophes', a-b, x/y, 50% & more #1 @home.",
    "The image shows a picture. What is in the picture? I think it is a small house.",
]


def caption_for(shape: str, fg: str, bg: str) -> str:
    return f"The image shows a {fg} {shape} on a {bg} background."


def draw_image(shape: str, fg: str, bg: str, size: int = IMAGE_SIZE) -> Image.Image:
    img = Image.new("RGB", (size, size), COLORS[bg])
    d = ImageDraw.Draw(img)
    m = size // 5
    box = (m, m, size - m - 1, size - m - 1)
    if shape == "circle":
        d.ellipse(box, fill=COLORS[fg])
    elif shape == "square":
        d.rectangle(box, fill=COLORS[fg])
    elif shape == "triangle":
        d.polygon([(size // 2, m), (size - m - 1, size - m - 1), (m, size - m - 1)], fill=COLORS[fg])
    else:
        raise ValueError(shape)
    return img


def wide_image() -> Image.Image:
    """The second demo image (example_wide.png, 80 x 56): another size and aspect ratio than
    example.png, one that fills the processor's patch budget exactly (280 patches, no padding), so a
    prompt with both has one padded image and one not."""
    img = Image.new("RGB", (80, 56), COLORS["white"])
    ImageDraw.Draw(img).rectangle((24, 12, 55, 43), fill=COLORS["green"])
    return img


def image_examples():
    out = []
    for shape, fg, bg in IMAGE_SPECS:
        out.append((draw_image(shape, fg, bg), DEMO_IMAGE_PROMPT, caption_for(shape, fg, bg)))
    return out


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], num_learned: int):
    """Train a byte-fallback BPE in the Gemma style (spaces -> '▁', no prefix space).

    Returns (vocab, merges) with the special tokens first, then the 256 byte-fallback tokens,
    then the learned characters / merges.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    special_re = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True)))
    pieces = []
    for t in texts:
        pieces.extend(p for p in special_re.split(t) if p)

    tok = Tokenizer(BPE(unk_token=None))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # Train on '▁word' / 'line\n' units so merges never cross a word boundary; GemmaTokenizer
    # (no effective pre-tokenizer) then reproduces exactly these segmentations.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("▁", behavior="merged_with_next"),
            pre_tokenizers.Split("\n", behavior="merged_with_previous"),
        ]
    )
    trainer = BpeTrainer(vocab_size=num_learned, min_frequency=1, show_progress=False, special_tokens=[])
    tok.train_from_iterator(pieces, trainer=trainer)
    learned = json.loads(tok.to_str())["model"]
    learned_vocab = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]

    vocab: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in learned_vocab:
        if t not in vocab:
            vocab[t] = len(vocab)
    return vocab, merges


def build_tokenizer(vocab, merges):
    from transformers import GemmaTokenizer

    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        extra_special_tokens=[VIDEO],
        add_bos_token=True,  # as real Gemma; chat-template paths tokenize with add_special_tokens=False
        add_eos_token=False,
        padding_side="left",
        model_max_length=2048,
        **NAMED_MODEL_SPECIFIC_TOKENS,
    )
    # Register every remaining special token as an added special token (ids already in vocab).
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    for t in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(t) == vocab[t], t
    return tok


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention",
]
NUM_KV_SHARED_LAYERS = 3
SLIDING_WINDOW = 8
PATCH_SIZE = 4
POOLING_KERNEL = 2
MAX_SOFT_TOKENS = 70  # smallest value Gemma4ImageProcessorPil accepts


def build_config(vocab_size: int, tok, use_bidirectional: str | None):
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        pad_token_id=ids[PAD],
        eos_token_id=[ids[EOS], ids[EOT]],
        bos_token_id=ids[BOS],
        tie_word_embeddings=True,
        sliding_window=SLIDING_WINDOW,
        layer_types=list(LAYER_TYPES),
        final_logit_softcapping=30.0,
        use_bidirectional_attention=use_bidirectional,
        vocab_size_per_layer_input=vocab_size,
        hidden_size_per_layer_input=8,
        attention_k_eq_v=False,
        num_kv_shared_layers=NUM_KV_SHARED_LAYERS,
        enable_moe_block=False,
        use_double_wide_mlp=True,
    )
    vision_config = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        pooling_kernel_size=POOLING_KERNEL,
        patch_size=PATCH_SIZE,
        position_embedding_size=160,
        use_clipped_linears=False,
        standardize=False,
    )
    config = Gemma4Config(
        text_config=text_config,
        vision_config=vision_config,
        audio_config=None,
        boi_token_id=ids[BOI],
        eoi_token_id=ids[EOI],
        image_token_id=ids[IMAGE],
        video_token_id=ids[VIDEO],
        boa_token_id=ids[BOA],
        eoa_token_index=ids[EOA],
        audio_token_id=ids[AUDIO],
        tie_word_embeddings=True,
    )
    return config


def build_image_processor():
    from transformers import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(
        patch_size=PATCH_SIZE,
        max_soft_tokens=MAX_SOFT_TOKENS,
        pooling_kernel_size=POOLING_KERNEL,
    )


def processor_config_dict(image_processor) -> dict:
    """The processor_config.json that ``Gemma4Processor.save_pretrained`` would write.

    The video section names the stock ``Gemma4VideoProcessor`` (tiny settings) so that the
    folder loads with ``AutoProcessor`` wherever torchvision is installed.
    """
    from transformers import Gemma4AudioFeatureExtractor

    image_cfg = json.loads(image_processor.to_json_string())
    image_cfg["image_processor_type"] = "Gemma4ImageProcessor"
    feature_cfg = json.loads(Gemma4AudioFeatureExtractor().to_json_string())
    video_cfg = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": True,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "max_soft_tokens": MAX_SOFT_TOKENS,
        "num_frames": 32,
        "patch_size": PATCH_SIZE,
        "pooling_kernel_size": POOLING_KERNEL,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "return_metadata": True,
        "video_processor_type": "Gemma4VideoProcessor",
    }
    return {
        "audio_ms_per_token": 40,
        "audio_seq_length": 750,
        "feature_extractor": feature_cfg,
        "image_processor": image_cfg,
        "image_seq_length": MAX_SOFT_TOKENS,
        "processor_class": "Gemma4Processor",
        "video_processor": video_cfg,
    }


# --------------------------------------------------------------------------------------------
# Inputs: exactly what Gemma4Processor.apply_chat_template(..., tokenize=True) returns.
# (Gemma4Processor itself cannot be instantiated without torchvision in transformers 5.x, see
# README; `verify()` checks this helper against the real processor through a tiny shim.)
# --------------------------------------------------------------------------------------------
def prepare_inputs(messages, tokenizer, image_processor, add_generation_prompt=True) -> dict:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    images = [
        item["image"]
        for m in messages
        if not isinstance(m["content"], str)
        for item in m["content"]
        if item.get("type") == "image"
    ]
    out = {}
    if images:
        ip = image_processor(images, return_tensors="pt")
        parts = text.split(IMAGE)
        assert len(parts) == len(images) + 1
        text = parts[0]
        for n, rest in zip(ip["num_soft_tokens_per_image"], parts[1:]):
            text += BOI + IMAGE * int(n) + EOI + rest
        out["pixel_values"] = ip["pixel_values"]
        out["image_position_ids"] = ip["image_position_ids"]
    enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    ids = enc["input_ids"]
    mm = torch.zeros_like(ids)
    mm[ids == tokenizer.convert_tokens_to_ids(IMAGE)] = 1
    mm[ids == tokenizer.convert_tokens_to_ids(VIDEO)] = 2
    mm[ids == tokenizer.convert_tokens_to_ids(AUDIO)] = 3
    return {"input_ids": ids, "attention_mask": enc["attention_mask"], "mm_token_type_ids": mm, **out}


def user_message(prompt: str, image=None):
    if image is None:
        return [{"role": "user", "content": prompt}]
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": prompt}]}]


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def make_batch(examples, tokenizer, image_processor, pad_id: int, eot_id: int):
    """examples: list of (messages, answer). Right-padded batch with prompt tokens masked."""
    rows = []
    for messages, answer in examples:
        inp = prepare_inputs(messages, tokenizer, image_processor)
        ans = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eot_id]
        ids = inp["input_ids"][0].tolist() + ans
        labels = [-100] * inp["input_ids"].shape[1] + ans
        mm = inp["mm_token_type_ids"][0].tolist() + [0] * len(ans)
        rows.append((ids, labels, mm, inp.get("pixel_values"), inp.get("image_position_ids")))
    max_len = max(len(r[0]) for r in rows)
    batch = {
        "input_ids": torch.tensor([r[0] + [pad_id] * (max_len - len(r[0])) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r[0]) + [0] * (max_len - len(r[0])) for r in rows]),
        "labels": torch.tensor([r[1] + [-100] * (max_len - len(r[1])) for r in rows]),
        "mm_token_type_ids": torch.tensor([r[2] + [0] * (max_len - len(r[2])) for r in rows]),
    }
    if rows[0][3] is not None:
        batch["pixel_values"] = torch.cat([r[3] for r in rows])
        batch["image_position_ids"] = torch.cat([r[4] for r in rows])
    return batch


def train(model, batches, steps: int, lr: float, log_every: int = 50):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for batch in batches:
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {total / len(batches):.4f}  ({time.time() - t0:.0f}s)", flush=True)
    model.eval()


# --------------------------------------------------------------------------------------------
# Generation helpers
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy(model, inputs: dict, max_new_tokens: int = 80):
    out = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        return_dict_in_generate=True,
        output_logits=True,
    )
    prompt_len = inputs["input_ids"].shape[1]
    new_ids = out.sequences[0, prompt_len:].tolist()
    margins = []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return new_ids, margins


def demo_messages(example_image):
    return {
        "text": user_message(DEMO_TEXT_PROMPT),
        "image": user_message(DEMO_IMAGE_PROMPT, example_image),
    }


# --------------------------------------------------------------------------------------------
# Main build
# --------------------------------------------------------------------------------------------
def set_determinism(seed: int = SEED):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # can only be set once per process
        pass
    torch.use_deterministic_algorithms(True)


def build(out_dir: Path, steps: int, lr: float, use_bidirectional: str | None = "vision"):
    from transformers import Gemma4ForConditionalGeneration, GenerationConfig

    set_determinism()
    t_start = time.time()

    # ---- corpus -------------------------------------------------------------------------
    img_examples = image_examples()
    example_image = img_examples[0][0]
    train_examples_img = [(user_message(q, img), a) for img, q, a in img_examples]
    train_examples_txt = [(user_message(q), a) for q, a in TEXT_QA]

    # ---- tokenizer ------------------------------------------------------------------------
    tok_texts = []
    for q, a in TEXT_QA:
        tok_texts.append(f"{SOT}user\n{q}{EOT}\n{SOT}model\n{a}{EOT}\n")
    for _, q, a in img_examples:
        tok_texts.append(f"{SOT}user\n{IMAGE}{q}{EOT}\n{SOT}model\n{a}{EOT}\n")
    tok_texts += EXTRA_TOKENIZER_TEXT
    vocab, merges = train_tokenizer(tok_texts, num_learned=400)
    tokenizer = build_tokenizer(vocab, merges)
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab_size = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    print(f"tokenizer: {vocab_size} tokens ({len(merges)} merges)")

    image_processor = build_image_processor()

    # ---- model ----------------------------------------------------------------------------
    config = build_config(vocab_size, tokenizer, use_bidirectional)
    torch.manual_seed(SEED)
    model = Gemma4ForConditionalGeneration(config).float()
    gen_config = GenerationConfig(
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[EOT]],
        pad_token_id=ids[PAD],
        do_sample=False,
    )
    model.generation_config = gen_config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters; kv_sharing_modes={config.text_config.kv_sharing_modes}")

    # ---- training -------------------------------------------------------------------------
    batches = [
        make_batch(train_examples_img, tokenizer, image_processor, ids[PAD], ids[EOT]),
        make_batch(train_examples_txt, tokenizer, image_processor, ids[PAD], ids[EOT]),
    ]
    print(
        f"training {steps} steps (image batch {tuple(batches[0]['input_ids'].shape)}, "
        f"text batch {tuple(batches[1]['input_ids'].shape)})"
    )
    train(model, batches, steps=steps, lr=lr)

    # ---- save -----------------------------------------------------------------------------
    if out_dir.exists():
        for p in out_dir.iterdir():
            if p.is_file() and p.name != "README.md":
                p.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["processor_class"] = "Gemma4Processor"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    (out_dir / "processor_config.json").write_text(
        json.dumps(processor_config_dict(image_processor), indent=2, sort_keys=True) + "\n"
    )
    example_image.save(out_dir / "example.png", optimize=False)
    wide_image().save(out_dir / "example_wide.png", optimize=False)
    print(f"saved to {out_dir} in {time.time() - t_start:.0f}s")
    return out_dir


def real_processor(out_dir: Path):
    """Instantiate the stock Gemma4Processor from `out_dir` without torchvision.

    transformers 5.x type-checks the (mandatory) video processor against `VideoProcessorMixin`,
    which is only exported when torchvision is installed; this shim registers the class so that
    the check passes and hands a placeholder video processor (videos are not supported).
    """
    import transformers.processing_utils as pu
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer, Gemma4Processor
    from transformers.video_processing_utils import VideoProcessorMixin

    if not hasattr(pu.transformers_module, "VideoProcessorMixin"):
        pu.transformers_module.VideoProcessorMixin = VideoProcessorMixin
    tok = AutoTokenizer.from_pretrained(out_dir)
    cfg = json.loads((out_dir / "processor_config.json").read_text())
    return Gemma4Processor(
        feature_extractor=AutoFeatureExtractor.from_pretrained(out_dir),
        image_processor=AutoImageProcessor.from_pretrained(out_dir),
        tokenizer=tok,
        video_processor=VideoProcessorMixin(),
        chat_template=tok.chat_template,
        image_seq_length=cfg["image_seq_length"],
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@torch.no_grad()
def verify(out_dir: Path):
    """Reload everything with plain HF (offline) and run the two demo prompts."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, Gemma4ForConditionalGeneration

    print("\n=== verify (plain HF, offline) ===")
    tok = AutoTokenizer.from_pretrained(out_dir)
    image_processor = AutoImageProcessor.from_pretrained(out_dir)
    config = AutoConfig.from_pretrained(out_dir)
    model = Gemma4ForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32).eval()
    tc = config.text_config
    print(f"tokenizer={type(tok).__name__} vocab={len(tok)}  image_processor={type(image_processor).__name__}")
    print(f"layer_types={['F' if t == 'full_attention' else 'S' for t in tc.layer_types]}")
    print(f"kv_sharing_modes={tc.kv_sharing_modes}")
    print(f"head_dim={[tc.per_layer_config[i].head_dim for i in range(tc.num_hidden_layers)]}")
    print(f"sliding_window={tc.sliding_window} bidirectional={tc.use_bidirectional_attention}")
    print(
        f"ids: pad={tc.pad_token_id} bos={tc.bos_token_id} eos={model.generation_config.eos_token_id} "
        f"eot={tok.convert_tokens_to_ids(EOT)} image={config.image_token_id} boi={config.boi_token_id} "
        f"eoi={config.eoi_token_id} video={config.video_token_id} audio={config.audio_token_id}"
    )

    example = Image.open(out_dir / "example.png").convert("RGB")
    proc = real_processor(out_dir)
    results = {}
    for name, messages in demo_messages(example).items():
        inputs = prepare_inputs(messages, tok, image_processor)
        ref = proc.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        assert sorted(ref.keys()) == sorted(inputs.keys()), (ref.keys(), inputs.keys())
        for k in ref:
            assert torch.equal(ref[k], inputs[k]), k
        new_ids, margins = greedy(model, dict(ref))
        text = tok.decode(new_ids, skip_special_tokens=False)
        n_soft = int((ref["input_ids"] == config.image_token_id).sum())
        print(f"\n[{name}] prompt {ref['input_ids'].shape[1]} tokens ({n_soft} image soft tokens)")
        print(f"  generated {len(new_ids)} tokens, min top1-top2 margin {min(margins):.2f}")
        print(f"  text: {text!r}")
        results[name] = {
            "prompt_len": int(ref["input_ids"].shape[1]),
            "n_soft": n_soft,
            "n_new": len(new_ids),
            "min_margin": min(margins),
            "text": text,
        }
    # Sanity: the vision tower is really used (every training image gets its own caption).
    ok = 0
    for img, q, a in image_examples():
        new_ids, _ = greedy(model, prepare_inputs(user_message(q, img), tok, image_processor), max_new_tokens=24)
        ok += tok.decode(new_ids, skip_special_tokens=True).strip() == a
    print(f"\ntraining images captioned exactly: {ok}/{len(IMAGE_SPECS)}")
    results["captions_ok"] = ok
    # Double <bos> guard: the chat template writes <bos>, tokenization must not add another one.
    assert (
        tok.apply_chat_template(demo_messages(example)["text"], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ].count(tok.bos_token_id)
        == 1
    )
    for f in sorted(out_dir.iterdir()):
        print(f"  {f.name:28s} {f.stat().st_size:>9d}  {sha256(f)[:16]}")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"  total {total / 1e6:.2f} MB")
    return results


def write_readme(out_dir: Path, results: dict):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(out_dir)
    tc, vc = cfg.text_config, cfg.vision_config
    tok = AutoTokenizer.from_pretrained(out_dir)
    lt = ",".join("F" if t == "full_attention" else "S" for t in tc.layer_types)
    modes = ",".join(
        f"{m or '-'}({'F' if t == 'full_attention' else 'S'})" for m, t in zip(tc.kv_sharing_modes, tc.layer_types)
    )
    tid = tok.convert_tokens_to_ids
    t, i = results["text"], results["image"]
    n_params = sum(int(np.prod(v)) for v in _safetensors_shapes(out_dir / "model.safetensors").values())
    lines = [
        "# Tiny Gemma 4 checkpoint (test fixture)",
        "",
        f"`Gemma4ForConditionalGeneration` (text + vision, no audio), {n_params / 1e6:.2f}M parameters, float32, "
        "random init",
        "briefly trained on a toy chat corpus. Rebuild (deterministic, ~2 min on 2 CPU cores, bit-identical files):",
        "`python scripts/build_tiny_model.py [--out hf/tiny_model]`.",
        "",
        f"- Text: {tc.num_hidden_layers} layers [{lt}] (S = sliding, window {tc.sliding_window}, head_dim "
        f"{tc.per_layer_config['sliding_attention'].head_dim};"
        f" F = full, head_dim {tc.per_layer_config['full_attention'].head_dim}, proportional RoPE x0.25),"
        f" hidden {tc.hidden_size}, {tc.num_attention_heads} q heads / {tc.num_key_value_heads} kv head, vocab "
        f"{tc.vocab_size}.",
        f"- KV sharing: num_kv_shared_layers={tc.num_kv_shared_layers}, modes [{modes}];"
        f" reuse layers have double-wide MLPs ({2 * tc.intermediate_size}, others {tc.intermediate_size}).",
        f"- Per-layer embeddings ({tc.hidden_size_per_layer_input}/layer), final_logit_softcapping "
        f"{tc.final_logit_softcapping},"
        f" tied embeddings, attention_k_eq_v {tc.attention_k_eq_v}, use_bidirectional_attention "
        f"{tc.use_bidirectional_attention!r}.",
        f"- Vision: {vc.num_hidden_layers} layers, hidden {vc.hidden_size}, patch {vc.patch_size}, pooling "
        f"{vc.pooling_kernel_size};"
        f" a {IMAGE_SIZE}x{IMAGE_SIZE} image -> {i['n_soft']} soft tokens (processor "
        f"max_soft_tokens={MAX_SOFT_TOKENS}, its minimum).",
        f"- Tokens: pad {tc.pad_token_id}, eos {tid(EOS)}, bos {tc.bos_token_id}, <|turn> {tid(SOT)}, <turn|> "
        f"{tid(EOT)} (end of turn),"
        f" <|image> {cfg.boi_token_id}, <image|> {cfg.eoi_token_id}, <|image|> {cfg.image_token_id}, <|video|> "
        f"{cfg.video_token_id},"
        f" <|audio|> {cfg.audio_token_id}; generation stops on {list(tc.eos_token_id)}.",
        f"- Demo (greedy) `{DEMO_TEXT_PROMPT}`: prompt {t['prompt_len']} tokens -> {t['n_new']} tokens, min top1-top2 "
        "margin"
        f" {t['min_margin']:.2f}: {t['text']!r}",
        f"- Demo (greedy) example.png + `{DEMO_IMAGE_PROMPT}`: prompt {i['prompt_len']} tokens -> {i['n_new']} tokens,"
        f" min margin {i['min_margin']:.2f}: {i['text']!r}",
        "- example_wide.png (80x56, a green square on white): the second demo image, of another size that",
        "  fills the processor's budget (280 patches, no padding -> 70 soft tokens; example.png 256 of 280 -> 64).",
        "- Without torchvision, transformers 5.x cannot instantiate `Gemma4Processor` (its video processor is "
        "mandatory);",
        "  AutoTokenizer / AutoImageProcessor / the model load fine. `prepare_inputs()` and `real_processor()` in the "
        "build",
        "  script give exactly the processor's `apply_chat_template(..., tokenize=True, return_dict=True)` output.",
    ]
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def _safetensors_shapes(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--no-verify", action="store_true", help="skip reloading and running the demos")
    args = ap.parse_args(argv)
    out = build(args.out, steps=args.steps, lr=args.lr)
    if not args.no_verify:
        results = verify(out)
        write_readme(out, results)


if __name__ == "__main__":
    main()
