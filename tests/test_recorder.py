"""The recorder against HF itself: every recorded tensor is checked against what HF computes
through a path that does not use the recorder's hooks."""

import numpy as np
import pytest
import torch

from recorder.model import load_model
from recorder.record import PromptInputs, record_loaded
from tests import tiny_models
from traces import TraceReader

PROMPT = [2, 5, 9, 13, 7, 3]
NEW = 12  # prompt 6 + 12 decode steps: crosses the window of 4 several times


@pytest.fixture(scope="module", params=["base", "k_eq_v", "moe", "no_ple", "no_softcap"])
def recorded(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    tiny_models.build(d / "model", request.param)
    lm = load_model(d / "model")
    record_loaded(lm, PromptInputs(PROMPT), d / "t.h5", max_new_tokens=NEW)
    with TraceReader(d / "t.h5") as r:
        yield lm, r


def _sequence(r):
    """The ids fed over the whole run: prompt + every generated token but the last."""
    return list(r.prompt_ids) + list(r.tokens()[:-1])


def test_tokens_equal_generate(recorded):
    lm, r = recorded
    out = lm.model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, output_hidden_states=True)
    assert list(r.tokens()) == out[0, len(PROMPT):].tolist()
    assert r.n_steps == len(r.tokens()) and r.step_positions[0] == (0, len(PROMPT))


def test_layer_outputs_equal_hf_hidden_states(recorded):
    lm, r = recorded
    ids = torch.tensor([_sequence(r)])
    with torch.no_grad():
        out = lm.model(ids, output_hidden_states=True)
    hs = out.hidden_states  # (embeddings, layer 0 .. layer L-2 outputs, final norm output)
    np.testing.assert_allclose(r.read("embeddings"), hs[0][0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r.read("final_hidden"), hs[-1][0].numpy(), rtol=1e-4, atol=1e-4)
    for i in range(len(r.layers) - 1):
        # incremental decode vs one full forward: equal up to float32 rounding
        np.testing.assert_allclose(r.read("layer_out", i), hs[i + 1][0].numpy(), rtol=1e-4, atol=1e-4, err_msg=f"layer {i}")
    last = len(r.layers) - 1
    with torch.no_grad():
        normed = lm.model.model.norm(torch.from_numpy(r.read("layer_out", last)))
    np.testing.assert_allclose(r.read("final_hidden"), normed.numpy(), rtol=1e-5, atol=1e-5)
    logits = out.logits[0, len(PROMPT) - 1 :].numpy()
    np.testing.assert_allclose(r.read("logits"), logits, rtol=1e-4, atol=1e-4)


def test_kv_equal_hf_cache_at_same_positions(recorded):
    lm, r = recorded
    g = lm.model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                          output_hidden_states=True)
    cache = g.past_key_values
    n_fed = r.n_positions
    checked = 0
    for i, info in enumerate(r.layers):
        if info.kv_role == "reuses":
            assert not r.has("k", i) and not r.has("v", i)
            continue
        keys, values = cache.layers[i].keys[0], cache.layers[i].values[0]  # (KVH, len, D)
        # a sliding cache keeps only the last positions; they end at the last fed position
        pos = range(n_fed - keys.shape[1], n_fed)
        k = r.read("k", i)[pos.start : pos.stop].transpose(1, 0, 2)
        v = r.read("v", i)[pos.start : pos.stop].transpose(1, 0, 2)
        np.testing.assert_allclose(k, keys.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"k layer {i}")
        np.testing.assert_allclose(v, values.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"v layer {i}")
        checked += 1
    assert checked >= 2


def test_masks_are_causal_with_the_sliding_window(recorded):
    lm, r = recorded
    window = lm.text_config.sliding_window
    n = r.n_positions
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    for i, info in enumerate(r.layers):
        want = k <= q
        if info.layer_type == "sliding_attention":
            want &= k > q - window
        np.testing.assert_array_equal(r.read("mask", i), want, err_msg=f"layer {i}")
    assert n > 2 * window


def test_q_and_rope_match_an_independent_computation(recorded):
    """q of layer 0 recomputed from the recorded embeddings with the layer's own weights."""
    lm, r = recorded
    tm = lm.model.model
    layer = tm.layers[0]
    info = r.layers[0]
    x = torch.from_numpy(r.read("embeddings"))
    with torch.no_grad():
        h = layer.input_layernorm(x)
        q = layer.self_attn.q_norm(layer.self_attn.q_proj(h).view(len(x), info.num_heads, info.head_dim))
        pos = torch.arange(len(x), dtype=torch.float32)
        base = lm.text_config.rope_parameters["sliding_attention"]["rope_theta"]
        inv = 1.0 / base ** (torch.arange(0, info.head_dim, 2, dtype=torch.float32) / info.head_dim)
        ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
        cos, sin = ang.cos(), ang.sin()
        rot = torch.cat([-q[..., info.head_dim // 2 :], q[..., : info.head_dim // 2]], dim=-1)
        q = q * cos[:, None] + rot * sin[:, None]
    np.testing.assert_allclose(r.read("rope_cos_sliding"), cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(r.read("q", 0), q.numpy(), rtol=1e-4, atol=1e-5)


def test_recording_twice_gives_the_same_content_hash(tmp_path):
    tiny_models.build(tmp_path / "m", "base")
    lm = load_model(tmp_path / "m")
    hashes = []
    for name in ("a.h5", "b.h5"):
        record_loaded(lm, PromptInputs(PROMPT), tmp_path / name, max_new_tokens=5)
        with TraceReader(tmp_path / name) as r:
            hashes.append(r.content_hash())
    assert hashes[0] == hashes[1]
    assert (tmp_path / "a.h5").read_bytes() != b""
