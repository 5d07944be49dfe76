"""An E2B-shaped random Gemma 4 for benchmarks: E2B widths, fewer layers, a smaller vocabulary.

E2B widths: hidden 1536, 8 query heads, 1 KV head, head_dim 256 (sliding) / 512 (full),
per-layer inputs of 256, MLP 6144 (double-wide on KV-reusing layers), window 512.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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


def vocab_size(model_dir: str | Path) -> int:
    """The text vocabulary of a checkpoint folder (its config.json; a ConditionalGeneration's text_config)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def token_ids(n: int, model_dir: str | Path, high: int = 16000) -> str:
    """n seeded random token ids in [10, min(high, the model's vocabulary)), comma-separated: the
    benchmarks' prompt (on the E2B-shaped model, vocabulary 16,384, the ids they always used)."""
    rng = random.Random(0)
    return ",".join(str(rng.randrange(10, min(high, vocab_size(model_dir)))) for _ in range(n))


def random_prompt(n: int, vocab: int, high: int = 16000) -> list[int]:
    """n seeded random token ids in [3, min(high, vocab)): the in-process benchmarks' prompt (on the
    E2B-shaped model, vocabulary 16,384, the ids they always used)."""
    import torch

    return torch.randint(3, min(high, vocab), (n,), generator=torch.Generator().manual_seed(0)).tolist()


# --cache DIR: the artifact cache to use as it is (kept) instead of WORK/cache emptied at the start;
# the export rows then time what the cache already holds (the suite's tests pass their own cache)
CACHE_OPTION = dict(
    type=Path,
    help="an artifact cache to use as it is, instead of an empty WORK/cache: "
    "exports found there are not built again, so their rows time a cache hit",
)


def artifact_env(cache: Path | None, fresh: Path) -> dict:
    """The environment of a benchmark's `trace` commands: GEMMA4_TRACE_CACHE is `cache` (--cache) as
    it is, else `fresh`, emptied first (every export, conversion and lowering is built, and timed)."""
    if cache is None:
        shutil.rmtree(fresh, ignore_errors=True)
    return {**os.environ, "GEMMA4_TRACE_CACHE": str(cache or fresh)}


def bench_setup(
    doc: str, script: str, make, *leading: tuple[str, dict], **options: dict
) -> tuple[argparse.Namespace, Path]:
    """An E2B benchmark's command line (`leading` positional arguments as (name, add_argument's
    keywords), then WORK, --prompt, --new, --model and `options` (--name: keywords)) and its model:
    --model's folder as it is, else WORK/model, built by `make(folder)` in a
    child process (`script ... --build-only`, which ends there), since a process's peak RSS counts
    what it inherits at fork, so the benchmark's own stays small. `a.model_flags` repeats --model
    for the script's own children."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name, kw in leading:
        ap.add_argument(name, **kw)
    ap.add_argument("work", type=Path)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument(
        "--model",
        type=Path,
        help="a Gemma 4 checkpoint folder to run on instead of building the E2B-shaped one "
        "(hf/tiny_model: the embedded tiny model, a quick check that the benchmark runs)",
    )
    for name, kw in options.items():
        ap.add_argument(f"--{name}", **kw)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    a.model_flags = [] if a.model is None else ["--model", str(a.model.resolve())]
    if a.model is not None:
        return a, a.model.resolve()
    model = a.work / "model"
    if a.build_only:
        make(model)
        sys.exit(0)
    argv = [str(getattr(a, name)) for name, _ in leading]
    subprocess.run([sys.executable, script, *argv, str(a.work), "--build-only"], check=True)
    return a, model
