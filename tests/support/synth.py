"""Build small synthetic traces with the real writer (no torch): used by format and diff tests."""

from __future__ import annotations

import numpy as np

from gemma4_trace.traces import LayerInfo, Provenance, TraceHeader, TraceWriter
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.layers import TowerInfo

LAYERS = [
    LayerInfo("sliding_attention", 4, 2, 1, "owns", 0),
    LayerInfo("full_attention", 8, 2, 1, "stores", 1),
    LayerInfo("sliding_attention", 4, 2, 1, "stores", 2),
    LayerInfo("full_attention", 8, 2, 1, "reuses", 1),
]
HIDDEN, VOCAB, PLE, WINDOW = 6, 11, 3, 4
# a two-image vision tower (schema version 2): 6 + 3 patches, 2 + 1 soft tokens
VISION_CONFIG = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "head_dim": 4}
VISION = TowerInfo("vision", 2, 8, 2, 4, item_rows=(6, 3), item_tokens=(2, 1))


def vision_config(config=None, layers=None) -> dict:
    """A model config with the synthetic vision tower's sub-config."""
    layers = LAYERS if layers is None else layers
    return (config or {"model_type": "gemma4", "num_hidden_layers": len(layers)}) | {"vision_config": VISION_CONFIG}


def put_tower(w, tower: TowerInfo, rng, edit=None, omit=()) -> None:
    """Every kind of an encoder tower, random rows (two calls for a two-item tower: item after item)."""
    for site in S.dataflow({tower.name: tower.layers}):
        spec = site.spec
        if site.key in omit:
            continue
        n = tower.tokens if spec.index == S.ROW_SOFT_TOKEN else tower.rows
        width = {"hidden": tower.hidden, "heads": tower.heads, "head_dim": tower.head_dim, "model_hidden": HIDDEN}
        rows = rng.standard_normal((n, *(width[a.width] for a in spec.axes)))
        if edit is not None:
            rows = edit(site.key, site.layer, 0, rows.copy())
        half = n // 2
        w.add(site.kind, rows[:half], layer=site.layer, tower=site.tower)
        w.add(site.kind, rows[half:], layer=site.layer, tower=site.tower)


def provenance(layers=None, config=None, **over) -> dict:
    layers = LAYERS if layers is None else layers
    p = dict(
        creator_version="test",
        torch_version="-",
        transformers_version="-",
        h5py_version="-",
        dtype="float32",
        device="cpu",
        runtime="synthetic",
        mode="reference",
        model_name="synthetic",
        model_config=config or {"model_type": "gemma4_text", "num_hidden_layers": len(layers)},
        model_config_sha256="0" * 64,
    )
    p.update(over)
    return p


def allowed(layer: LayerInfo, queries: range, width: int) -> np.ndarray:
    q = np.asarray(queries)[:, None]
    k = np.arange(width)[None, :]
    ok = k <= q
    if layer.layer_type == "sliding_attention":
        ok &= k > q - WINDOW
    return ok


def write_trace(
    path,
    prompt_len=5,
    new_tokens=4,
    seed=0,
    edit=None,
    mode="reference",
    force=False,
    layers=None,
    config=None,
    prompt_ids=None,
    mask_width=None,
    dtype="float32",
    source_dtype=None,
    stop_after=None,
    omit=(),
    towers=(),
):
    """A trace of deterministic random tensors; `edit(kind, layer, step, rows)` may change rows.

    The same seed gives the same values whatever the other options: `layers`/`config`/`prompt_ids`
    change the header, `mask_width` pads masks to a static key width (a static runtime's max_seq),
    `dtype`/`source_dtype` set provenance and stored source dtype, `stop_after` ends after that
    many steps (a free-running run that hit EOS), `omit` names kinds not written, `towers` adds
    encoder towers (TowerInfo; their sub-configs must be in `config`: `vision_config(...)`), whose
    rows come from a generator of their own (the text tower's values stay the same).
    """
    layers = LAYERS if layers is None else layers
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=new_tokens)
    with TraceWriter(path, force=force, source_dtype=source_dtype) as w:
        ids = rng.integers(0, VOCAB, size=prompt_len)
        w.write_header(
            TraceHeader(
                Provenance.from_dict(provenance(layers, config, mode=mode, dtype=dtype)),
                ids if prompt_ids is None else prompt_ids,
                layers,
                max_new_tokens=new_tokens,
                eos_token_ids=[1],
                towers=towers,
            )
        )
        tower_rng = np.random.default_rng(seed + 1000)
        start = 0
        for step in range(new_tokens if stop_after is None else min(stop_after, new_tokens)):
            stop = prompt_len if step == 0 else start + 1
            pos = range(start, stop)
            w.begin_step(pos)
            n = len(pos)

            def put(kind, rows, layer=None):
                if kind in omit:
                    return
                if edit is not None:
                    rows = edit(kind, layer, step, rows.copy())  # noqa: B023 - called in this iteration
                w.add(kind, rows, layer=layer)

            if step == 0:
                for tower in towers:
                    put_tower(w, tower, tower_rng, edit, omit)
            put("embeddings", rng.standard_normal((n, HIDDEN)))
            put("per_layer_inputs", rng.standard_normal((n, len(layers), PLE)))
            for li, layer in enumerate(layers):
                put("mask", allowed(layer, pos, mask_width or stop), li)
                put("q", rng.standard_normal((n, layer.num_heads, layer.head_dim)), li)
                if layer.kv_role != "reuses":
                    put("k", rng.standard_normal((n, layer.num_kv_heads, layer.head_dim)), li)
                    put("v", rng.standard_normal((n, layer.num_kv_heads, layer.head_dim)), li)
                put("attn_out", rng.standard_normal((n, HIDDEN)), li)
                put("layer_out", rng.standard_normal((n, HIDDEN)), li)
            put("final_hidden", rng.standard_normal((n, HIDDEN)))
            logits = rng.standard_normal(VOCAB)
            logits[tokens[step]] += 5.0
            put("logits", logits)
            put("token", np.int64(tokens[step]))
            w.end_step()
            start = stop
    return tokens
