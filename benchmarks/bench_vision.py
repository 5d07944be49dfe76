"""The vision tower's record cost: `trace record` of one image prompt against the same generate()
without hooks, at E2B's vision tower size, side by side.

    python benchmarks/bench_vision.py [--tokens 256] [--rounds 3] [--work DIR]
    python benchmarks/bench_vision.py --tiny --tokens 16 --rounds 1      # E2B's structure at tiny widths

A random Gemma4ForConditionalGeneration with E2B's vision tower (16 encoder layers, hidden 768, 12
heads of 64, MLP 3072, patch 16, pooling 3: about 167 M parameters; `--tiny`: 2 layers of 32) over
the embedded model's text tower (so the text tower's share of the time is negligible), saved with
the embedded model's tokenizer and a processor for its patch size and `--tokens` soft tokens; one
square image of exactly `--tokens` tokens. Each round times, alternating: the tower's own forward
(get_image_features), generate() of one token (the tower and a prefill; no hooks), and `trace record`
of the same (every vision site, the text tower's too, written to HDF5). The ratio that counts is
record / generate (goal <= 1.15 at E2B's tower: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

import torch

from gemma4_trace.hf.model import embedded_model_dir, load_model
from gemma4_trace.recorder.record import eos_ids, prepare_inputs, record_loaded

E2B_VISION = dict(  # google/gemma-4-e2b-it's vision_config
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=10240,
)
TINY_VISION = E2B_VISION | dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)  # fmt: skip


def build(out: Path, vision: dict, tokens: int) -> Path:
    """A random checkpoint: E2B's vision tower (`vision`) on the embedded model's text tower."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    src = embedded_model_dir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["vision_config"] = cfg["vision_config"] | vision
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(Gemma4Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(src / name, out / name)
    proc = json.loads((src / "processor_config.json").read_text())
    for key in ("image_processor", "video_processor"):
        proc[key] |= dict(patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"])
        proc[key]["max_soft_tokens"] = budget(tokens)
    proc["image_seq_length"] = budget(tokens)
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2))
    return out


def budget(tokens: int) -> int:
    """The processor's max_soft_tokens for an image of `tokens`: the smallest it accepts that holds them."""
    return min(b for b in (70, 140, 280, 560, 1120) if b >= tokens)


def image(tokens: int, vision: dict):
    """A square image of exactly `tokens` soft tokens (side: sqrt(tokens) pooled cells)."""
    from PIL import Image

    side = round(tokens**0.5) * vision["pooling_kernel_size"] * vision["patch_size"]
    g = torch.Generator().manual_seed(1)
    return Image.fromarray(torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8).numpy())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="soft tokens of the image (a square number, <= 1024)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="E2B's vision structure at tiny widths (a quick check)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the checkpoint and traces (default: temporary)")
    args = ap.parse_args()
    vision = TINY_VISION if args.tiny else E2B_VISION
    work = Path(tempfile.mkdtemp(prefix="bench-vision-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    lm = load_model(build(work / "model", vision, args.tokens))
    inputs = prepare_inputs(lm, "Describe the image.", None, [image(args.tokens, vision)], chat=True)
    pixels, pos = inputs.extra["pixel_values"], inputs.extra["image_position_ids"]
    tokens = int((pos != -1).all(-1).sum()) // vision["pooling_kernel_size"] ** 2
    n_params = sum(p.numel() for p in lm.model.model.vision_tower.parameters())
    print(
        f"vision tower: {vision['num_hidden_layers']} layers, hidden {vision['hidden_size']}, {n_params / 1e6:.0f} M "
        f"parameters; image: {int((pos != -1).all(-1).sum())} patches, {tokens} soft tokens; "
        f"prompt {len(inputs.input_ids)} tokens; torch threads {torch.get_num_threads()}"
    )
    ids = torch.tensor([inputs.input_ids])
    times: dict[str, list[float]] = {"tower": [], "generate": [], "record": []}
    size = 0
    for r in range(args.rounds):
        with torch.no_grad():
            t = time.perf_counter()
            lm.model.model.get_image_features(pixels, pos)
            times["tower"].append(time.perf_counter() - t)
            t = time.perf_counter()
            lm.model.generate(
                ids, **inputs.extra, max_new_tokens=1, do_sample=False, eos_token_id=eos_ids(lm),
                pad_token_id=lm.text_config.pad_token_id, top_k=None, top_p=None, temperature=None,
            )  # fmt: skip
            times["generate"].append(time.perf_counter() - t)
        out = work / f"rec{r}.h5"
        t = time.perf_counter()
        record_loaded(lm, inputs, out, max_new_tokens=1, force=True)
        times["record"].append(time.perf_counter() - t)
        size = out.stat().st_size
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'':<28}{'median s':>10}{'x tower':>10}")
    for name, label in (("tower", "tower forward"), ("generate", "generate() 1 token"), ("record", "trace record")):
        print(f"{label:<28}{med[name]:>10.4f}{med[name] / med['tower']:>10.2f}")
    print(f"record / generate: {med['record'] / med['generate']:.2f}x over {args.rounds} round(s)")
    print(f"trace size: {size / 2**20:.1f} MiB")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
