"""The static runtime's port of the audio tower (replayer/static_audio.py), against HF's own tower:
on the processor's features of two clips of different lengths in one batch (the demo speech clip and
its first 60%, so the second is padded), every audio site's valid frames equal HF's tensors taken with
forward hooks, and the soft tokens equal get_audio_features' stripped of padding; the static
runtime's prefill on an audio prompt gives HF's logits; a planted bug shows at its first site, and
`trace diff` names where each audio bug of the zoo starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4_trace.hf.model import DEMO_AUDIO, load_model
from gemma4_trace.replayer.static_audio import StaticAudio
from gemma4_trace.traces.errors import TraceToolError
from tests.support.bug_zoo import AUDIO_BUGS

RATE = 16000
LAYER_KINDS = ("ff1_out", "attn_out", "lconv_out", "ff2_out", "layer_out")
GLOBAL_KINDS = ("subsampled", "output_proj", "soft_tokens")


@pytest.fixture(scope="module")
def lm():
    return load_model(audio=True)


def _waves() -> list[np.ndarray]:
    """The demo clip at 16 kHz and its first 60% (another length: the batch pads it)."""
    import soundfile
    import soxr

    wave, rate = soundfile.read(str(DEMO_AUDIO), dtype="float32", always_2d=True)
    wave = soxr.resample(wave.mean(axis=1), rate, RATE).astype(np.float32)
    return [wave, wave[: int(len(wave) * 0.6)]]


def _features(lm, waves, text="Transcribe the audio."):
    """The processor's outputs for one audio token per clip then `text` (the clips padded to the longest)."""
    token = getattr(lm.processor, "audio_token", "<|audio|>")
    return lm.processor(text=token * len(waves) + text, audio=waves, return_tensors="pt")


class _Sites:
    """A probe keeping every site the port reports: {(kind, layer): rows (float32)}."""

    def __init__(self):
        self.d = {}

    def tensor(self, kind, value, layer=None, tower=None):
        assert tower == "audio" and (kind, layer) not in self.d, (kind, layer, tower)
        self.d[(kind, layer)] = value.float()


def _hf_sites(lm, feats, mask) -> dict:
    """HF's own audio tensors, captured with forward hooks on its modules, the valid frames' rows
    clip after clip: {(kind, layer): float32 rows}."""
    model = lm.model.model
    tower, got, valid = model.audio_tower, {}, {}

    def keep(key):
        def hook(_module, _args, out):
            out = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
            got[key] = out.float().clone()  # (clips, frames, ...): a module's output before the next one's in-place +=

        return hook

    def keep_mask(_module, _args, out):
        valid["mask"] = out[1]

    mods = [(tower.subsample_conv_projection, ("subsampled", None)), (tower.output_proj, ("output_proj", None))]
    mods.append((model.embed_audio, ("soft_tokens", None)))
    for i, layer in enumerate(tower.layers):
        mods += [(layer.feed_forward1, ("ff1_out", i)), (layer.self_attn, ("attn_out", i))]
        mods += [(layer.lconv1d, ("lconv_out", i)), (layer.feed_forward2, ("ff2_out", i)), (layer, ("layer_out", i))]
    handles = [m.register_forward_hook(keep(key)) for m, key in mods]
    handles.append(tower.subsample_conv_projection.register_forward_hook(keep_mask))
    try:
        with torch.no_grad():
            out = model.get_audio_features(feats, mask, return_dict=True)
    finally:
        for h in handles:
            h.remove()
    m = out.attention_mask
    assert torch.equal(m, valid["mask"])
    soft = out.pooler_output[m].float()
    got = {key: t[m] for key, t in got.items()}
    assert torch.equal(got[("soft_tokens", None)], soft)  # the hooks saw what get_audio_features returns
    return got


def _port_sites(port, feats, mask) -> tuple[dict, torch.Tensor]:
    probe = _Sites()
    with torch.no_grad():
        soft = port.encode(feats, mask, probe).float()
    return probe.d, soft


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def two_clips(lm):
    inputs = _features(lm, _waves())
    return inputs["input_features"], inputs["input_features_mask"]


def test_the_batch_pads_the_second_clip(two_clips):
    feats, mask = two_clips
    assert feats.dtype == torch.float32 and mask.dtype == torch.bool and feats.shape[0] == 2
    assert bool(mask[0].all()) and not bool(mask[1].all())


def test_every_site_is_hfs_on_the_valid_frames(lm, two_clips):
    feats, mask = two_clips
    hf = _hf_sites(lm, feats, mask)
    ours, soft = _port_sites(StaticAudio(lm.model), feats, mask)
    layers = lm.model.config.audio_config.num_hidden_layers
    expected = {(k, None) for k in GLOBAL_KINDS} | {(k, i) for k in LAYER_KINDS for i in range(layers)}
    assert set(ours) == set(hf) == expected
    worst = {}
    for key, ref in hf.items():
        assert ours[key].shape == ref.shape, (key, ours[key].shape, ref.shape)
        worst[key] = _rel_l2(ours[key], ref)
    print({f"{k}{'' if i is None else i}": f"{v:.1e}" for (k, i), v in worst.items()})
    assert max(worst.values()) < 1e-5, worst
    assert torch.equal(soft, ours[("soft_tokens", None)])
    n_valid = int(mask[:, ::2][:, ::2].sum())
    assert soft.shape == (n_valid, lm.model.config.text_config.hidden_size)


def test_the_soft_tokens_are_get_audio_features(lm, two_clips):
    feats, mask = two_clips
    with torch.no_grad():
        out = lm.model.model.get_audio_features(feats, mask, return_dict=True)
        ours = StaticAudio(lm.model).encode(feats, mask)
    hf = out.pooler_output[out.attention_mask]
    assert ours.shape == hf.shape
    assert _rel_l2(ours, hf) < 1e-5


def test_the_attention_window_is_hfs(lm):
    """The mask of the port is what HF's blocked mask allows: 12 keys q - 11 .. q (context_left 13
    is the window's `context_left - 1` past frames, the query itself among them), none in the future."""
    port = StaticAudio(lm.model)
    valid = torch.ones(1, 30, dtype=torch.bool)
    allowed = port.attention_mask(valid)[0]
    q = 20
    assert allowed[q].nonzero().flatten().tolist() == list(range(q - 11, q + 1))


@pytest.mark.parametrize(
    "bug,site",
    [
        ("_AudioChunkOffByOne", ("attn_out", 0)),
        ("_AudioNoLeftContext", ("attn_out", 0)),
        ("_AudioConvCentred", ("lconv_out", 0)),
        ("_AudioNoLogitCap", ("attn_out", 0)),
        ("_AudioFullStepFF1", ("ff1_out", 0)),
    ],
)
def test_a_planted_bug_shows_at_its_first_site(lm, two_clips, bug, site):
    """The per-site comparison can fail: each audio bug of the zoo leaves every site before its own
    as HF's and moves its own."""
    from tests.support import bug_zoo

    feats, mask = two_clips
    hf = _hf_sites(lm, feats, mask)
    ours = _port_sites(getattr(bug_zoo, bug)(lm.model), feats, mask)[0]
    order = [("subsampled", None)] + [(k, i) for i in range(2) for k in LAYER_KINDS]
    diff = {key: _rel_l2(ours[key], hf[key]) for key in order}
    first = next(key for key in order if diff[key] > 1e-4)
    assert first == site, diff
    assert all(diff[key] < 1e-5 for key in order[: order.index(site)]), diff


# ---------------------------------------------------------------- the runtime's prefill
def _prompt(lm, clips: int):
    """(ids (T,), extra inputs) of an audio prompt of `clips` clips, as the processor makes them."""
    out = _features(lm, _waves()[:clips])
    return out["input_ids"][0], {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}


@pytest.mark.parametrize("clips", [1, 2])
def test_the_prefill_on_an_audio_prompt_gives_hfs_logits(lm, clips):
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    ids, extra = _prompt(lm, clips)
    rt = StaticGemma4Runtime(lm, max_seq=len(ids) + 4)
    _, ple_ids, mm_embeds, slots, *_ = rt.prepare_prefill(ids, extra)
    audio = ids == lm.model.config.audio_token_id
    assert torch.equal(slots[0, : len(ids)], audio) and not bool(slots[0, len(ids) :].any())
    assert not bool((ple_ids[0, : len(ids)] == lm.model.config.audio_token_id).any())  # PLE ids: pad at the slots
    with torch.no_grad():
        out = lm.model.model.get_audio_features(extra["input_features"], extra["input_features_mask"], return_dict=True)
        hf_soft = out.pooler_output[out.attention_mask]
    assert _rel_l2(mm_embeds[0, slots[0]], hf_soft) < 1e-5  # merged unscaled, clip after clip
    logits = rt.prefill(ids, extra)
    with torch.no_grad():
        hf = lm.model(input_ids=ids[None], **extra).logits[0, -1].float()
    # measured 4.6e-6 (one clip) and 3.6e-6 (two); REL of tests/test_runtime.py, the text stack's own rounding
    assert _rel_l2(logits.float(), hf) < 5e-5, _rel_l2(logits.float(), hf)
    assert int(logits.argmax()) == int(hf.argmax())


def test_the_prefill_refuses_a_count_mismatch(lm):
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    ids, extra = _prompt(lm, 1)
    ids = ids[ids != lm.model.config.audio_token_id][:-1].tolist() + [lm.model.config.audio_token_id]  # 1 slot
    rt = StaticGemma4Runtime(lm, max_seq=len(ids) + 4)
    with pytest.raises(TraceToolError, match=r"soft tokens for 1 audio-token slots") as e:
        rt.prepare_prefill(ids, extra)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("which", ["vision-only", "text-only"])
def test_a_model_without_an_audio_tower_refuses_features(lm, which, tmp_path):
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime
    from tests.support.tiny_models import build

    ids, extra = _prompt(lm, 1)
    other = load_model() if which == "vision-only" else load_model(build(tmp_path / "text"))
    ids = ids.clamp(max=other.model.config.get_text_config().vocab_size - 1)
    rt = StaticGemma4Runtime(other, max_seq=len(ids) + 4)
    with pytest.raises(TraceToolError, match="without an audio tower") as e:
        rt.prepare_prefill(ids, extra)
    assert "\n" not in str(e.value)


def test_video_stays_refused(lm):
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    ids, extra = _prompt(lm, 1)
    rt = StaticGemma4Runtime(lm, max_seq=len(ids) + 4)
    with pytest.raises(TraceToolError, match="pixel_values_videos"):
        rt.prepare_prefill(ids, {**extra, "pixel_values_videos": torch.zeros(1, 1)})


# ---------------------------------------------------------------- replays of an audio trace
@pytest.fixture(scope="module")
def audio_ref(tmp_path_factory):
    """REF: the embedded audio model on the demo clip and its first 60% (two clips, one padded)."""
    import soundfile

    from gemma4_trace.recorder.record import record_trace

    d = tmp_path_factory.mktemp("audio-ref")
    wave, rate = soundfile.read(str(DEMO_AUDIO), dtype="float32")
    soundfile.write(str(d / "short.wav"), wave[: int(len(wave) * 0.6)], rate)
    ref = d / "ref.h5"
    record_trace(output=ref, audios=[str(DEMO_AUDIO), str(d / "short.wav")], prompt="Transcribe the audio.",
                 max_new_tokens=3)  # fmt: skip
    return ref


def test_a_replay_reports_every_audio_site_and_matches(audio_ref, tmp_path):
    from gemma4_trace.diff import diff_traces
    from gemma4_trace.replayer.replay import replay_trace
    from gemma4_trace.traces import schema as S

    run = tmp_path / "run.h5"
    replay_trace(audio_ref, run)
    result = diff_traces(audio_ref, run)
    assert result.match, result.first_divergence
    assert {k.key for k in S.TOWER_BY_NAME["audio"].kinds} <= {t.kind for t in result.tensors}
    worst = max(t.worst["rel_l2"] for t in result.tensors if t.kind.startswith("audio."))
    assert worst < 1e-5, worst


# the tiny model's attention logits are small (a few units), so the missing tanh cap (50) moves attn_out
# by ~1e-4 rel-L2 only, at the float32 default tolerance: its diff runs with audio sites held to 1e-5
# (the port matches HF to ~1e-6)
TIGHT = {"audio_no_logit_cap"}


@pytest.mark.parametrize("bug", sorted(AUDIO_BUGS))
def test_trace_diff_names_where_each_audio_bug_starts(audio_ref, tmp_path, bug):
    from gemma4_trace.diff import diff_traces
    from gemma4_trace.replayer.replay import replay_trace

    factory, _, (kind, layer) = AUDIO_BUGS[bug]
    run = tmp_path / "run.h5"
    replay_trace(audio_ref, run, runtime=f"tests.support.bug_zoo:{factory}")
    tol = None
    if bug in TIGHT:
        tol = tmp_path / "tight.toml"
        tol.write_text('[[rule]]\nkind = "audio.*"\nrel_l2 = 1e-5\n')
    d = diff_traces(audio_ref, run, tol).first_divergence
    assert d is not None and (d.tower, d.kind, d.layer, d.step) == ("audio", kind, layer, 0), d
    assert d.threshold == (1e-5 if bug in TIGHT else 1e-4), d.threshold


def test_bfloat16_every_site_is_hfs_bit_for_bit():
    """In bfloat16 every site is HF's bit for bit (the features cast as HF's convs cast them, the
    sinusoidal table from HF's own inv_timescales buffer, the attention in float32 as HF's)."""
    lm16 = load_model(audio=True, dtype="bfloat16")
    inputs = _features(lm16, _waves())
    feats, mask = inputs["input_features"], inputs["input_features_mask"]
    hf = _hf_sites(lm16, feats, mask)
    ours = _port_sites(StaticAudio(lm16.model), feats, mask)[0]
    unequal = [key for key, ref in hf.items() if not torch.equal(ours[key], ref)]
    assert not unequal, unequal
