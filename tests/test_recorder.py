"""The recorder against HF itself: every recorded tensor is checked against what HF computes
through a path that does not use the recorder's hooks."""

import numpy as np
import pytest
import torch

from gemma4_trace.hf.model import load_model
from gemma4_trace.recorder.record import PromptInputs, record_loaded
from gemma4_trace.traces import TraceReader
from tests.support import tiny_models

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
    assert list(r.tokens()) == out[0, len(PROMPT) :].tolist()
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
        np.testing.assert_allclose(
            r.read("layer_out", i), hs[i + 1][0].numpy(), rtol=1e-4, atol=1e-4, err_msg=f"layer {i}"
        )
    last = len(r.layers) - 1
    with torch.no_grad():
        normed = lm.model.model.norm(torch.from_numpy(r.read("layer_out", last)))
    np.testing.assert_allclose(r.read("final_hidden"), normed.numpy(), rtol=1e-5, atol=1e-5)
    logits = out.logits[0, len(PROMPT) - 1 :].numpy()
    np.testing.assert_allclose(r.read("logits"), logits, rtol=1e-4, atol=1e-4)


def test_kv_equal_hf_cache_at_same_positions(recorded):
    lm, r = recorded
    g = lm.model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=NEW,
        do_sample=False,
        return_dict_in_generate=True,
        output_hidden_states=True,
    )
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


@pytest.fixture(scope="module")
def image_recording(tmp_path_factory):
    from gemma4_trace.hf.model import DEMO_IMAGE, DEMO_IMAGE_PROMPT
    from gemma4_trace.recorder.record import open_image, prepare_inputs

    d = tmp_path_factory.mktemp("image")
    lm = load_model(None)
    inputs = prepare_inputs(lm, DEMO_IMAGE_PROMPT, None, [open_image(DEMO_IMAGE)], chat=True)
    record_loaded(lm, inputs, d / "t.h5", max_new_tokens=12)
    with TraceReader(d / "t.h5") as r:
        yield lm, inputs, r


def test_image_prompt_tokens_and_layers_equal_hf(image_recording):
    lm, inputs, r = image_recording
    ids = torch.tensor([inputs.input_ids])
    out = lm.model.generate(ids, **inputs.extra, max_new_tokens=12, do_sample=False)
    assert list(r.tokens()) == out[0, ids.shape[1] :].tolist()
    assert lm.tokenizer.decode(r.tokens()).startswith("The image shows")
    assert set(r.extra_inputs()) == {"pixel_values", "image_position_ids", "mm_token_type_ids"}

    seq = torch.tensor([_sequence(r)])
    extra = dict(inputs.extra)
    pad = seq.shape[1] - extra["mm_token_type_ids"].shape[1]
    extra["mm_token_type_ids"] = torch.nn.functional.pad(extra["mm_token_type_ids"], (0, pad))
    with torch.no_grad():
        hf = lm.model(seq, **extra, output_hidden_states=True)
    hs = hf.hidden_states
    np.testing.assert_allclose(r.read("embeddings"), hs[0][0].numpy(), rtol=1e-5, atol=1e-5)
    for i in range(len(r.layers) - 1):
        np.testing.assert_allclose(
            r.read("layer_out", i), hs[i + 1][0].numpy(), rtol=1e-4, atol=1e-4, err_msg=f"layer {i}"
        )


def test_image_prompt_masks_equal_hf_vision_masks(image_recording):
    from transformers.models.gemma4.modeling_gemma4 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    lm, inputs, r = image_recording
    T = r.prompt_len
    tt = inputs.extra["mm_token_type_ids"]
    masks = create_masks_for_vision_model(
        config=lm.text_config,
        inputs_embeds=torch.zeros(1, T, lm.text_config.hidden_size),
        attention_mask=None,
        cache=None,
        position_ids=torch.arange(T)[None],
        block_sequence_ids=get_block_sequence_ids_for_mask(tt, "cpu"),
    )
    for i, info in enumerate(r.layers):
        m = masks[info.layer_type]
        want = torch.tril(torch.ones(T, T, dtype=torch.bool)) if m is None else m[0, 0]
        if want.dtype != torch.bool:
            want = want == 0
        np.testing.assert_array_equal(r.read("mask", i)[:T, :T], want.numpy(), err_msg=f"layer {i}")
    image_rows = np.flatnonzero(r.prompt_ids == lm.config.image_token_id)
    sliding = next(i for i, li in enumerate(r.layers) if li.layer_type == "sliding_attention")
    first = image_rows[0]
    assert r.read("mask", sliding)[first, first + 1]  # image tokens see later ones on sliding layers
