"""The static runtime's port of the vision tower (replayer/static_vision.py), against HF's own tower:
the soft tokens equal get_image_features' for one image and for two images of different sizes (one
padded, one filling its patch budget), every vision site of a replay matches the recording, and on a
variant whose tower uses what the embedded one leaves off (standardize, clipped linears, one K/V
head for two query heads) too; leaving either out is caught where it starts. Every site also against
HF's own tensors taken with forward hooks (the embedded tower and the variant pooling 3 x 3), and in
bfloat16 bit for bit against HF's eager attention."""

from __future__ import annotations

import pytest
import torch

from gemma4_trace.diff import diff_traces
from gemma4_trace.diff import vision_hints as VH
from gemma4_trace.hf.model import DEMO_IMAGE, DEMO_WIDE_IMAGE, load_model
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.recorder.record import open_image, prepare_inputs
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.replayer.static_vision import StaticVision
from gemma4_trace.traces import TraceReader
from gemma4_trace.traces import schema as S
from tests.support.bug_zoo import VARIANT_BUGS
from tests.support.cli import invoke

VISION_KEYS = [k.key for k in S.TOWER_BY_NAME["vision"].kinds]


@pytest.fixture(scope="module")
def lm():
    return load_model()


@pytest.mark.parametrize("images", [[DEMO_IMAGE], [DEMO_IMAGE, DEMO_WIDE_IMAGE]], ids=["one", "two"])
def test_the_soft_tokens_are_hfs(lm, images):
    inputs = prepare_inputs(lm, "Describe the images.", None, [open_image(str(p)) for p in images], chat=True)
    px, pos = inputs.extra["pixel_values"], inputs.extra["image_position_ids"]
    with torch.no_grad():
        hf = torch.cat(lm.model.model.get_image_features(px, pos, return_dict=True).pooler_output)
        ours = StaticVision(lm.model).encode(px, pos)
    assert ours.shape == hf.shape == (sum(inputs.input_ids.count(t) for t in [lm.model.config.image_token_id]), 64)
    assert float((ours - hf).abs().max()) < 1e-5


@pytest.mark.parametrize("golden", ["image", "two_images"])
def test_a_replay_reports_every_vision_site_and_matches(golden, tmp_path):
    run = tmp_path / "run.h5"
    replay_trace(golden_path(golden), run)
    result = diff_traces(golden_path(golden), run)
    assert result.match, result.first_divergence
    compared = {t.kind for t in result.tensors}
    assert set(VISION_KEYS) <= compared  # every vision kind compared, none only in one trace
    worst = max(t.worst["rel_l2"] for t in result.tensors if t.kind.startswith("vision."))
    assert worst < 1e-5  # float32 rounding: the port computes what HF does


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """(the variant model, its REF over the demo image)."""
    from tests.support.tiny_models import vision_variant

    d = tmp_path_factory.mktemp("vision-variant")
    model = vision_variant(d / "model")
    ref = d / "ref.h5"
    res = invoke("record", "--model", model, "--image", DEMO_IMAGE, "--prompt", "Describe the image.",
                 "--max-new-tokens", 3, "-o", ref)  # fmt: skip
    assert res.exit_code == 0, res.output
    return model, ref


def test_the_variant_uses_what_it_is_for(variant):
    model, _ = variant
    cfg = load_model(model).model.config.vision_config
    assert cfg.standardize and cfg.use_clipped_linears and cfg.num_key_value_heads < cfg.num_attention_heads


def test_the_port_matches_hf_on_the_variant(variant, tmp_path):
    model, ref = variant
    run = tmp_path / "run.h5"
    replay_trace(ref, run, model_dir=model)
    result = diff_traces(ref, run)
    assert result.match, result.first_divergence
    assert set(VISION_KEYS) <= {t.kind for t in result.tensors}
    with TraceReader(ref) as r:
        assert r.read("vision.k", 0).shape[1] == 1  # one K/V head recorded as HF ran it


@pytest.mark.parametrize(
    "bug,site,hint",
    [
        ("vision_std_skipped", ("vision.pooled", None, 0), VH.VISION_STANDARDIZE),
        ("vision_clip_skipped", ("vision.attn_out", 0), None),
    ],
)
def test_a_variant_bug_is_caught_where_it_starts(variant, tmp_path, bug, site, hint):
    model, ref = variant
    run = tmp_path / "run.h5"
    replay_trace(ref, run, model_dir=model, runtime=f"tests.support.bug_zoo:{VARIANT_BUGS[bug][0]}")
    result = diff_traces(ref, run)
    d = result.first_divergence
    assert d is not None and (d.kind, d.layer, d.position)[: len(site)] == site, d
    assert (result.hint.name if result.hint else None) == hint


# ---------------------------------------------------------------- every site against HF's own tensors
class _Sites:
    """A probe keeping every site the port reports: {(kind, layer): rows (float32)}."""

    def __init__(self):
        self.d = {}

    def tensor(self, kind, value, layer=None, tower=None):
        assert tower == "vision" and (kind, layer) not in self.d, (kind, layer, tower)
        self.d[(kind, layer)] = value.float()


def _hf_sites(lm, px, pos, monkeypatch) -> dict:
    """HF's own vision tensors for (px, pos), captured with forward hooks (q and k: the outputs of
    modeling_gemma4's apply_multidimensional_rope, q then k in each layer), the per-patch kinds as the
    real patches' rows, image after image: {(kind, layer): float32 rows}."""
    import transformers.models.gemma4.modeling_gemma4 as M

    model, valid = lm.model.model, (pos != -1).all(dim=-1)
    tower, got, roped = model.vision_tower, {}, []
    rope = M.apply_multidimensional_rope
    monkeypatch.setattr(M, "apply_multidimensional_rope", lambda *a, **kw: roped.append(rope(*a, **kw)) or roped[-1])

    def keep(key, patches=True):
        def hook(_module, _args, out):
            out = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
            got[key] = (out[valid] if patches else out).float()

        return hook

    mods = [(tower.patch_embedder, ("patch_embeddings", None), True), (tower, ("pooled", None), False)]
    mods.append((model.embed_vision, ("soft_tokens", None), False))
    for i, layer in enumerate(tower.encoder.layers):
        mods += [(layer.self_attn.v_norm, ("v", i), True), (layer.self_attn, ("attn_out", i), True)]
        mods += [(layer.mlp, ("mlp_out", i), True), (layer, ("layer_out", i), True)]
    handles = [m.register_forward_hook(keep(key, p)) for m, key, p in mods]
    try:
        with torch.no_grad():
            soft = torch.cat(model.get_image_features(px, pos, return_dict=True).pooler_output).float()
    finally:
        for h in handles:
            h.remove()
    assert len(roped) == 2 * len(tower.encoder.layers)  # q and k of each layer
    for i in range(len(tower.encoder.layers)):
        got[("q", i)], got[("k", i)] = roped[2 * i][valid].float(), roped[2 * i + 1][valid].float()
    assert torch.equal(got[("soft_tokens", None)], soft)  # the hooks saw what get_image_features returns
    return got


def _port_sites(port, px, pos) -> tuple[dict, torch.Tensor]:
    probe = _Sites()
    with torch.no_grad():
        soft = port.encode(px, pos, probe).float()
    return probe.d, soft


def _images_inputs(lm, paths):
    inputs = prepare_inputs(lm, "Describe the images.", None, [open_image(str(p)) for p in paths], chat=True)
    return inputs.extra["pixel_values"], inputs.extra["image_position_ids"]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The variant tower (standardize, clipped linears, one K/V head) pooling 3 x 3 patches a token."""
    from tests.support.tiny_models import vision_variant

    return load_model(vision_variant(tmp_path_factory.mktemp("vision-k3") / "model", pooling_kernel_size=3))


@pytest.mark.parametrize("which", ["lm", "k3"])
def test_every_site_is_hfs_on_the_real_patches(which, request, monkeypatch):
    lm = request.getfixturevalue(which)
    px, pos = _images_inputs(lm, [DEMO_IMAGE, DEMO_WIDE_IMAGE])
    valid = (pos != -1).all(dim=-1)
    assert not bool(valid[0].all()) and bool(valid[1].all())  # the first image padded, the second not
    hf = _hf_sites(lm, px, pos, monkeypatch)
    ours, soft = _port_sites(StaticVision(lm.model), px, pos)
    layers = lm.model.config.vision_config.num_hidden_layers
    assert (
        set(ours)
        == set(hf)
        == {(k, None) for k in ("patch_embeddings", "pooled", "soft_tokens")}
        | {(k, i) for k in ("q", "k", "v", "attn_out", "mlp_out", "layer_out") for i in range(layers)}
    )
    worst = {}
    for key, ref in hf.items():
        assert ours[key].shape == ref.shape, (key, ours[key].shape, ref.shape)
        worst[key] = float((ours[key] - ref).abs().max()) / max(1.0, float(ref.abs().max()))
    print({f"{k}{'' if i is None else i}": f"{v:.1e}" for (k, i), v in worst.items()})
    assert max(worst.values()) < 1e-5, worst  # float32 rounding (relative where |x| > 1)
    assert torch.equal(soft, ours[("soft_tokens", None)])
    n_real, k = int(valid.sum()), lm.model.config.vision_config.pooling_kernel_size
    assert hf[("layer_out", 0)].shape[0] == n_real and soft.shape[0] == n_real // (k * k)


def test_the_k3_variant_bites(k3):
    """What the k3 variant is for does change the soft tokens (so matching HF there means something)."""
    from tests.support.bug_zoo import _ClipSkipped, _StdSkipped

    cfg = k3.model.config.vision_config
    assert cfg.pooling_kernel_size == 3 and cfg.standardize and cfg.use_clipped_linears
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    px, pos = _images_inputs(k3, [DEMO_IMAGE, DEMO_WIDE_IMAGE])
    good = _port_sites(StaticVision(k3.model), px, pos)[1]
    for bug in (_ClipSkipped, _StdSkipped):
        assert float((_port_sites(bug(k3.model), px, pos)[1] - good).abs().max()) > 1e-2, bug.__name__


def test_a_planted_bug_shows_at_its_first_site(lm, monkeypatch):
    """The per-site comparison can fail: RoPE's axes swapped leaves the patch embeddings and v as HF's
    and moves q and k from layer 0 on."""
    from tests.support.bug_zoo import _RopeAxesSwapped

    px, pos = _images_inputs(lm, [DEMO_IMAGE])
    hf = _hf_sites(lm, px, pos, monkeypatch)
    ours = _port_sites(_RopeAxesSwapped(lm.model), px, pos)[0]
    diff = {key: float((ours[key] - ref).abs().max()) for key, ref in hf.items()}
    assert diff[("patch_embeddings", None)] < 1e-5 and diff[("v", 0)] < 1e-5
    assert diff[("q", 0)] > 1e-2 and diff[("k", 0)] > 1e-2 and diff[("soft_tokens", None)] > 1e-3


def test_bfloat16_every_site_is_hfs_bit_for_bit(monkeypatch):
    """In bfloat16, against HF's eager attention, every site is HF's bit for bit: the pixels are scaled
    in float32 before the cast (as HF's patch embedder does; scaling after the cast rounds 14% of them
    differently), and the static runtime hands the port the processor's float32 pixels."""
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    lm = load_model(None, dtype="bfloat16")
    lm.model.config.vision_config._attn_implementation = "eager"  # sdpa's kernel rounds its own way
    images = [open_image(str(p)) for p in (DEMO_IMAGE, DEMO_WIDE_IMAGE)]
    inputs = prepare_inputs(lm, "Describe the images.", None, images, chat=True)
    px, pos = inputs.extra["pixel_values"], inputs.extra["image_position_ids"]
    assert px.dtype == torch.float32
    hf = _hf_sites(lm, px, pos, monkeypatch)
    ours = _port_sites(StaticVision(lm.model), px, pos)[0]
    unequal = [key for key, ref in hf.items() if not torch.equal(ours[key], ref)]
    assert not unequal, unequal
    rt = StaticGemma4Runtime(lm, max_seq=len(inputs.input_ids) + 4)
    _, _, mm_embeds, slots, *_ = rt.prepare_prefill(inputs.input_ids, inputs.extra)
    assert mm_embeds.dtype == torch.bfloat16
    assert torch.equal(mm_embeds[slots].float(), hf[("soft_tokens", None)])
