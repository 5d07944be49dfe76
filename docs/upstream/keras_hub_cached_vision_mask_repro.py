"""Minimal repro: keras-hub 0.32.0's Gemma 4 prefill never attends within an image both ways.

`Gemma4TextDecoderBlock._compute_attention_mask` ORs the within-image (bidirectional) mask into a
sliding layer's causal mask only `if vision_mask is not None and cache is None`. The prefill of
`Gemma4CausalLM.call_with_cache` (the path `generate()` takes; `_build_cache` seeds the cache with
it) always passes a cache, so with `use_bidirectional_attention: "vision"` in the HF config (keras-hub's
`use_vision_bidirectional_attention=True`) an image's tokens stay causal: query p of an image does not
see the image's tokens after p. transformers 5.24 (`create_masks_for_generate` in modeling_gemma4.py)
lets every token of an image see the whole image on a sliding layer, cached or not.

Needs keras-hub 0.32.0, keras 3 with jax, and numpy (nothing else):

    python docs/upstream/keras_hub_cached_vision_mask_repro.py

It builds one random sliding-attention Gemma 4 decoder block with use_vision_bidirectional_attention,
and a 12-token prompt: text 0-1, an image at 2-9, text 10-11. Part 1 (sliding window 16, longer than
the prompt, so no window applies): the block's mask and output through the cached path (a cache
passed, cache_update_index 0, as the prefill does) against the uncached path. Expected: the same
mask and output. Observed: the image rows differ. Part 2 (the second bug, in the uncached path;
sliding window 4, shorter than the image): the uncached mask against transformers 5.24's rule for a
sliding layer, `window AND (causal OR same_image)` with window `k > q - sliding_window`; keras-hub
composes `(causal AND window) OR same_image`, so the image's last tokens see its first ones across
more than the window. Exit 1 while either bug holds.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

TEXT, IMAGE = [0, 1, 10, 11], range(2, 10)
N = 12


def block(window: int):
    from keras_hub.src.models.gemma4.gemma4_decoder_block import Gemma4TextDecoderBlock

    return Gemma4TextDecoderBlock(
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
        num_query_heads=2,
        num_key_value_heads=1,
        use_sliding_window_attention=True,
        sliding_window_size=window,
        use_vision_bidirectional_attention=True,
        is_global_attention=False,
        dtype="float32",
    )


def hf_sliding_rule(window: int, vision: np.ndarray) -> np.ndarray:
    """transformers 5.24's sliding mask for Gemma 4 with use_bidirectional_attention "vision":
    and_masks(or_masks(causal, blockwise_overlay(image ids)), sliding_window_overlay(window))."""
    q, k = np.arange(N)[:, None], np.arange(N)[None, :]
    same_image = vision[:, None] & vision[None, :]  # one image here
    return (k > q - window) & ((k <= q) | same_image)


def keys(row: np.ndarray) -> str:
    idx = np.flatnonzero(row)
    runs, start = [], idx[0]
    for a, b in zip(idx, list(idx[1:]) + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a > start else f"{start}")
            start = b
    return ",".join(runs)


def main() -> int:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    vision = np.zeros(N, bool)
    vision[list(IMAGE)] = True
    x = np.random.default_rng(0).normal(size=(1, N, 16)).astype("float32")
    vm = vision[None]
    print(f"keras-hub {keras_hub.__version__}, keras {keras.__version__} ({keras.backend.backend()})")
    print(f"one sliding-attention Gemma4TextDecoderBlock, use_vision_bidirectional_attention=True; {N} tokens:")
    print("text 0-1, an image at 2-9, text 10-11")

    print("1. sliding window 16 (no window applies): the cached path (the prefill) vs the uncached path")
    b = block(16)
    cache = np.zeros((1, 2, N, 1, 8), "float32")
    out_cached, _ = b(x, vision_mask=vm, cache=cache, cache_update_index=0)
    out_plain, _ = b(x, vision_mask=vm)
    m_cached = np.asarray(b._compute_attention_mask(x, None, vm, cache, 0))[0].astype(bool)
    m_plain = np.asarray(b._compute_attention_mask(x, None, vm, None, 0))[0].astype(bool)
    want = hf_sliding_rule(16, vision)
    for q in (2, 5, 9):
        print(
            f"   image query {q}: transformers allows keys {keys(want[q])}; keras-hub uncached {keys(m_plain[q])},"
            f" cached {keys(m_cached[q])}"
        )
    rel = np.linalg.norm(np.asarray(out_cached - out_plain)[0], axis=-1) / np.linalg.norm(
        np.asarray(out_plain)[0], axis=-1
    )
    print(f"   block output, cached vs uncached, rel-L2 by position: {'  '.join(f'{r:.2g}' for r in rel)}")
    bug1 = bool((m_cached != want).any()) and (m_plain == want).all() and rel[list(IMAGE)[:-1]].min() > 1e-3
    print(
        "   BUG: the cached path (the prefill) drops the within-image bidirectional mask"
        if bug1
        else "   fixed: the cached path keeps the within-image bidirectional mask"
    )

    print("2. sliding window 4 (shorter than the image): the uncached path vs transformers' rule")
    b = block(4)
    m_plain = np.asarray(b._compute_attention_mask(x, None, vm, None, 0))[0].astype(bool)
    want = hf_sliding_rule(4, vision)
    for q in (2, 9):
        print(f"   image query {q}: transformers allows keys {keys(want[q])}; keras-hub uncached {keys(m_plain[q])}")
    bad = np.argwhere(m_plain != want)
    print(f"   {len(bad)} (query, key) pairs differ: {', '.join(f'({q}, {k})' for q, k in bad[:6])}")
    bug2 = len(bad) > 0
    print(
        "   BUG: the uncached sliding mask is (causal AND window) OR image, not window AND (causal OR image)"
        if bug2
        else "   fixed: the uncached sliding mask keeps the window over the image"
    )
    return 1 if bug1 or bug2 else 0


if __name__ == "__main__":
    sys.exit(main())
