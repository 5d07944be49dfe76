"""StaticGemma4Runtime against HF Gemma 4 directly (forward + DynamicCache), and torch.export.

Bound: per-position rel-L2 <= 5e-5 in float32 (measured max 2.3e-5, typically <= 3e-6:
float32 rounding, amplified on rows of small norm by the random weights);
masks and greedy tokens exactly.
"""

from __future__ import annotations

import pytest
import torch

from gemma4_trace.hf.model import load_model
from gemma4_trace.replayer.runtime import StaticGemma4Runtime
from gemma4_trace.traces.errors import TraceToolError
from tests.support import tiny_models

REL = 5e-5
IMG, BOI, EOI = 120, 121, 122


def rel_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().reshape(a.shape[0], -1), b.float().reshape(b.shape[0], -1)
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).max())


class Collect:
    def __init__(self):
        self.d = {}

    def tensor(self, kind, value, layer=None):
        self.d[(kind, layer)] = value.clone()


def generate(rt, input_ids, extra_inputs: dict | None, max_new_tokens: int, eos_token_ids) -> list[int]:
    """Greedy generation with any runtime: stop at any EOS id or after max_new_tokens tokens.

    A test helper (in production the replay driver feeds runtimes)."""
    ids = list(int(i) for i in torch.as_tensor(input_ids).reshape(-1).tolist())
    if len(ids) + max_new_tokens > rt.max_seq:
        raise TraceToolError(
            f"prompt ({len(ids)}) + new tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} exceeds max_seq "
            f"{rt.max_seq}"
        )
    eos = set(int(e) for e in eos_token_ids)
    out = [int(torch.argmax(rt.prefill(ids, extra_inputs or {}, None)))]
    while len(out) < max_new_tokens and out[-1] not in eos:
        out.append(int(torch.argmax(rt.decode(out[-1], len(ids) + len(out) - 1, None))))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(variant="base", multimodal=False, **over):
        key = (variant, multimodal, tuple(sorted(over.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{variant}{'_mm' if multimodal else ''}")
            cache[key] = load_model(tiny_models.build(d, variant, multimodal=multimodal, **over))
        return cache[key]

    return get


def image_inputs(ids):
    """Two images: 4x4 patches (4 soft tokens) and 2x4 patches padded to 16 (2 soft tokens)."""
    g = torch.Generator().manual_seed(0)
    pv = torch.rand(2, 16, 48, generator=g)
    pos = torch.full((2, 16, 2), -1, dtype=torch.long)
    for b, (h, w) in enumerate([(4, 4), (2, 4)]):
        yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pos[b, : h * w] = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)
    pv[1, 8:] = 0
    tt = torch.tensor([[1 if i == IMG else 0 for i in ids]])
    return dict(pixel_values=pv, image_position_ids=pos, mm_token_type_ids=tt)


def check_against_hf(lm, ids, extra, n_decode, max_seq):
    """Prefill + n_decode greedy steps in both; compare hidden states, logits, tokens."""
    rt = StaticGemma4Runtime(lm, max_seq=max_seq)
    p = Collect()
    logits = rt.prefill(ids, extra, p)
    with torch.no_grad():
        out = lm.model(torch.tensor([ids]), **extra, output_hidden_states=True, use_cache=True)
    hs = out.hidden_states  # [embeddings, layer 0 out, ..., final (normed)]
    assert rel_rows(p.d[("embeddings", None)], hs[0][0]) <= REL
    for i in range(rt.n_layers - 1):
        assert rel_rows(p.d[("layer_out", i)], hs[i + 1][0]) <= REL, f"layer {i}"
    assert rel_rows(p.d[("final_hidden", None)], hs[-1][0]) <= REL
    assert rel_rows(logits[None], out.logits[0, -1:]) <= REL
    cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
    assert int(logits.argmax()) == tokens[0]
    for s in range(n_decode):
        p = Collect()
        mine = rt.decode(tokens[-1], len(ids) + s, p)
        with torch.no_grad():
            o = lm.model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True, output_hidden_states=True)
        cache = o.past_key_values
        assert rel_rows(mine[None], o.logits[0, -1:]) <= REL, f"decode step {s + 1}"
        assert rel_rows(p.d[("layer_out", 0)], o.hidden_states[1][0]) <= REL
        assert int(mine.argmax()) == int(o.logits[0, -1].argmax())
        tokens.append(int(o.logits[0, -1].argmax()))
    return rt, p


@pytest.mark.parametrize("variant", sorted(tiny_models.VARIANTS))
def test_text_variants_match_hf(models, variant):
    # window 4: 11 prompt + 12 decode positions cross it several times
    check_against_hf(models(variant), [2, 5, 9, 17, 33, 4, 8, 60, 61, 62, 11], {}, n_decode=12, max_seq=24)


@pytest.mark.parametrize("bidir", [None, "vision"])
def test_images_match_hf(models, bidir):
    lm = models("base", multimodal=True, use_bidirectional_attention=bidir, sliding_window=6)
    ids = [2, 5, BOI] + [IMG] * 4 + [EOI, 9, 17, BOI] + [IMG] * 2 + [EOI, 33, 4]
    extra = image_inputs(ids)
    rt, _ = check_against_hf(lm, ids, extra, n_decode=4, max_seq=24)

    # masks exactly as HF builds them for this prompt (bidirectional image blocks on sliding layers only)
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForConditionalGeneration

    p = Collect()
    rt.prefill(ids, extra, p)
    T = len(ids)
    hf = Gemma4ForConditionalGeneration.create_masks_for_generate(
        lm.config,
        torch.zeros(1, T, 32),
        None,
        None,
        torch.arange(T)[None],
        mm_token_type_ids=extra["mm_token_type_ids"],
    )
    for i, info in enumerate(rt.infos):
        m = hf[info.layer_type]
        if m is None:  # sdpa's causal fast path
            m = torch.ones(1, 1, T, T, dtype=torch.bool).tril()
        m = m[0, 0] if m.dtype == torch.bool else m[0, 0] > torch.finfo(m.dtype).min / 2
        mine = p.d[("mask", i)]
        assert mine.shape == (T, 24) and not mine[:, T:].any()
        assert torch.equal(mine[:, :T], m), f"layer {i} ({info.layer_type})"
    sliding = p.d[("mask", 0)]
    if bidir == "vision":
        assert sliding[3, 6] and not p.d[("mask", 2)][3, 6]  # image token sees a later one; full layer does not
    else:
        assert not sliding[3, 6]
    # soft tokens (of the port of the vision tower: HF's to float32 rounding) are merged unscaled at the
    # image slots; PLE uses pad ids there
    soft = torch.cat(
        list(lm.model.model.get_image_features(extra["pixel_values"], extra["image_position_ids"]).pooler_output)
    )
    emb = p.d[("embeddings", None)]
    assert rel_rows(emb[[i for i, t in enumerate(ids) if t == IMG]], soft) <= REL


def test_masks_far_past_the_window(models):
    lm = models("base")
    rt = StaticGemma4Runtime(lm, max_seq=40)
    p = Collect()
    rt.prefill(list(range(3, 33)), {}, p)
    m = p.d[("mask", 0)]  # sliding, window 4
    q = 29
    assert m[q].nonzero().flatten().tolist() == [26, 27, 28, 29]
    assert m.shape == (30, 40) and not m[:, 30:].any()
    p = Collect()
    rt.decode(5, 30, p)
    assert p.d[("mask", 0)][0].nonzero().flatten().tolist() == [27, 28, 29, 30]
    assert p.d[("mask", 2)][0].nonzero().flatten().tolist() == list(range(31))


def test_prefill_writes_only_valid_rows(models):
    rt = StaticGemma4Runtime(models("base"), max_seq=16)
    for L in rt.layers:
        if L.owns_kv:
            L.k_cache.fill_(7.0)
    rt.prefill([2, 5, 9, 17, 33], {})
    for L in rt.layers:
        if L.owns_kv:
            assert L.k_cache[:, :, :5].abs().sum() > 0 and not L.k_cache[:, :, 5:].any()
    assert not any(hasattr(L, "k_cache") for L, info in zip(rt.layers, rt.infos) if info.kv_role == "reuses")


def test_pieces_keep_the_attribute_paths(models):
    """The runtime is its pieces (replayer/static_*.py) mixed into one nn.Module: the buffer paths
    torch.export and quant.py see stay on the runtime and its layers, the caches on their layers."""
    from gemma4_trace.replayer.quant import weight_units

    rt = StaticGemma4Runtime(models("base"), max_seq=8)
    names = [n for n, _ in rt.named_buffers()]
    assert names[:4] == ["embed", "embed_scale", "final_norm", "lm_head"]
    assert {"ple_model_proj", "cos_sliding_attention", "sin_full_attention", "layers.0.q_proj"} <= set(names)
    owners = [i for i, info in enumerate(rt.infos) if info.kv_role != "reuses"]
    caches = [n for n in names if n.endswith("_cache")]
    assert caches == [f"layers.{i}.{c}_cache" for i in owners for c in "kv"]
    assert all(list(rt.layers[i]._buffers)[-2:] == ["k_cache", "v_cache"] for i in owners)  # after the weights
    assert ("layer.0", "layer.0.qkv", rt.layers[0], "q_proj") in weight_units(rt)
    assert ("ple_model_proj", "ple_model_proj", rt, "ple_model_proj") in weight_units(rt)


def test_generate_stops_at_eos_and_checks_max_seq(models):
    rt = StaticGemma4Runtime(models("no_sharing"), max_seq=24)
    ids = [2, 5, 9, 17, 33, 4, 8]
    free = generate(rt, ids, {}, 10, eos_token_ids=[])
    assert len(free) == 10
    first = free.index(free[3])
    assert generate(rt, ids, {}, 10, eos_token_ids=[999, free[3]]) == free[: first + 1]
    with pytest.raises(TraceToolError, match="exceeds max_seq 24"):
        generate(rt, ids, {}, 18, eos_token_ids=[])
    assert len(generate(rt, ids, {}, 17, eos_token_ids=[])) == 17  # fills max_seq exactly


def test_probe_none_reports_nothing_and_same_logits(models):
    rt = StaticGemma4Runtime(models("base"), max_seq=16)
    ids = [2, 5, 9, 17]
    a = rt.prefill(ids, {}, None)
    p = Collect()
    b = rt.prefill(ids, {}, p)
    assert torch.equal(a, b)
    kinds = {k for k, _ in p.d}
    assert {
        "embeddings",
        "per_layer_inputs",
        "rope_cos_full",
        "rope_sin_sliding",
        "q",
        "k",
        "v",
        "mask",
        "attn_out",
        "layer_out",
        "final_hidden",
    } <= kinds
    assert ("k", 4) not in p.d and ("k", 2) in p.d  # layer 4 reuses layer 2's K/V


def test_exported_steps_match_eager(models):
    """The step graphs the ONNX and ExecuTorch runtimes lower (replayer/functional.py), through
    torch.export: the eager runtime's logits and K/V caches, bit for bit."""
    from gemma4_trace.replayer import functional as F

    loaded = models("moe")
    rt, fn = StaticGemma4Runtime(loaded, max_seq=16), F.FunctionalKV(loaded, 16)
    ids = [2, 5, 9, 17, 33]
    prefill, decode = (F.export_step(fn, step).module() for step in F.STEPS)
    n = len(F.zero_caches(fn))
    owners = [L for L in rt.layers if L.owns_kv]
    eager = rt.prefill(ids)
    with torch.no_grad():
        out = prefill(*fn.prepare_prefill(ids, {}), *F.zero_caches(fn))
    assert torch.equal(eager, out[0])
    tok = int(eager.argmax())
    for pos in range(5, 9):
        caches = list(out[1 : 1 + n])
        assert all(torch.equal(caches[2 * j], L.k_cache) for j, L in enumerate(owners)), f"position {pos}"
        want = rt.decode(tok, pos)
        with torch.no_grad():
            out = decode(torch.tensor([[tok]]), torch.tensor([pos]), *caches)
        assert torch.equal(out[0], want), f"position {pos}"
        tok = int(want.argmax())
