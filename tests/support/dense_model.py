"""A tiny dense Gemma 4 (the 31B's shape: no KV sharing, no per-layer inputs, no MoE), for the
runtimes that run dense decoders only (--runtime ctranslate2), and REFs of it within and past its
sliding window of 4."""

from __future__ import annotations

from pathlib import Path

from tests.support import tiny_models

S, F = tiny_models.S, tiny_models.F
WITHIN = "2,17,33,40"  # 4 tokens: no query sees past the window of 4
PAST = "2,17,33,40,51,60,71,80,90,100"  # 10 tokens: positions 4-9 see more than the window
DENSE = dict(
    num_hidden_layers=4,
    layer_types=[S, F, S, F],
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
)


def build_dense(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """A random tiny dense Gemma 4 text checkpoint (4 layers, sliding window 4) in out_dir."""
    return tiny_models.build(out_dir, seed=seed, **{**DENSE, **overrides})


def dense_ref(folder: Path, prompt: str = PAST, new_tokens: int = 3, model: Path | None = None) -> tuple[Path, Path]:
    """(the dense model, its REF over `prompt` with `new_tokens` generated), built in `folder`."""
    from tests.support.cli import invoke

    model = model or build_dense(folder / "dense")
    ref = folder / f"ref_{len(prompt.split(','))}.h5"
    res = invoke("record", "--model", model, "--input-ids", prompt, "--max-new-tokens", str(new_tokens), "-o", ref)
    assert res.exit_code == 0, res.output
    return model, ref
