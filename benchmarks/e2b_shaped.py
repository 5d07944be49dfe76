"""An E2B-shaped random Gemma 4 for benchmarks: E2B widths, fewer layers, a smaller vocabulary.

E2B widths: hidden 1536, 8 query heads, 1 KV head, head_dim 256 (sliding) / 512 (full),
per-layer inputs of 256, MLP 6144 (double-wide on KV-reusing layers), window 512.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchmarks.make_e2b_random import E2B_TEXT as E2B_FULL

S, F = "sliding_attention", "full_attention"

# E2B's widths (benchmarks/make_e2b_random.py holds every E2B dimension); 10 layers, 5 of
# them reusing K/V, a 16k vocabulary and the default init so that a build stays small
E2B_TEXT = {
    k: v for k, v in E2B_FULL.items() if k not in ("max_position_embeddings", "rope_parameters", "tie_word_embeddings")
}
E2B_TEXT.update(
    vocab_size=16384,
    vocab_size_per_layer_input=16384,
    num_hidden_layers=10,
    layer_types=[S, S, S, S, F, S, S, S, S, F],
    num_kv_shared_layers=5,
    initializer_range=0.02,
)


def build(out_dir: str | Path, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
    """Write the random E2B-shaped checkpoint (text-only) to out_dir, once."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**E2B_TEXT, **overrides})).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = [1]
    model.save_pretrained(out, safe_serialization=True)
    return out


def bench_setup(
    doc: str, script: str, make, *leading: tuple[str, dict], **options: dict
) -> tuple[argparse.Namespace, Path]:
    """An E2B benchmark's command line (`leading` positional arguments as (name, add_argument's
    keywords), then WORK, --prompt, --new and `options` (--name: keywords)) and its model,
    WORK/model: built by `make(folder)` in a
    child process (`script ... --build-only`, which ends there), since a process's peak RSS counts
    what it inherits at fork, so the benchmark's own stays small."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name, kw in leading:
        ap.add_argument(name, **kw)
    ap.add_argument("work", type=Path)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=8)
    for name, kw in options.items():
        ap.add_argument(f"--{name}", **kw)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    model = a.work / "model"
    if a.build_only:
        make(model)
        sys.exit(0)
    argv = [str(getattr(a, name)) for name, _ in leading]
    subprocess.run([sys.executable, script, *argv, str(a.work), "--build-only"], check=True)
    return a, model
