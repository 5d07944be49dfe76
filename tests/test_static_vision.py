"""The static runtime's port of the vision tower (replayer/static_vision.py), against HF's own tower:
the soft tokens equal get_image_features' for one image and for two images of different sizes (one
padded, one filling its patch budget), every vision site of a replay matches the recording, and on a
variant whose tower uses what the embedded one leaves off (standardize, clipped linears, one K/V
head for two query heads) too; leaving either out is caught where it starts."""

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
