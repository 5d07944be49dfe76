"""Likely causes (diff/hints.py): each hint fires on its own zoo bug and on no other zoo entry.

Every entry of the float zoo (tests/support/bug_zoo.py) and of the quantized zoo on the embedded model
(tests/support/quant_bugs.py, both weight schemes, judged with --baseline as tests/test_quant_bugs.py
does) is replayed once and diffed; its hint must be exactly the one expected for its bug class
(None where no signature applies), so a hint firing on another entry fails that entry. The
byte-identical fixtures (tests/test_diff_json_stable.py) hold that no planted numeric, mask,
token or missing-tensor divergence there gets a hint either.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from gemma4_trace.diff import audio_hints as AH
from gemma4_trace.diff import diff_traces, format_text, render_html
from gemma4_trace.diff import hints as H
from gemma4_trace.diff import vision_hints as VH
from gemma4_trace.diff.fmt import sci
from gemma4_trace.replayer.replay import replay_trace
from tests.support.bug_zoo import BUGS, reference_path, replayed_zoo
from tests.support.cli import invoke

# zoo entry -> the hint it must get (None: no signature applies; docs/bug-zoo.md says why)
FLOAT = {
    "zero_prefill_mask": H.CAUSAL_MASK_MISSING,
    "identity_rope": H.IDENTITY_ROPE,
    "shared_decode_mask": H.CAUSAL_MASK_ON_SLIDING,
    "window_off_by_one": H.WINDOW_OFF_BY_ONE,
    "window_off_by_one_decode": H.WINDOW_OFF_BY_ONE,
    "reuse_own_empty_cache": H.UNWRITTEN_KV,
    "reuse_own_cache_in_decode": H.UNWRITTEN_KV,
    "reuse_stale_current_row": H.KV_SOURCE_WRONG,
    "decode_slice_short": H.CURRENT_KEY_LEFT_OUT,
    "full_attention_scaled": H.SCORES_WRONG,
    "padding_kv_read_by_slot": H.MASK_BY_FILLED_SLOT,
    "no_softcap": H.NO_SOFTCAP,
    "no_ple": H.PLE_MISSING,
    "ple_raw_image_ids": H.PLE_RAW_IMAGE_IDS,
    "image_block_causal": H.IMAGE_BLOCK_CAUSAL,
    "image_block_past_window": H.IMAGE_BLOCK_PAST_WINDOW,
    "vision_scaled": H.VISION_SCALED,
    "vision_rope_axes": VH.VISION_ROPE_AXES,
    "vision_padding": VH.VISION_PADDING,
    "vision_pool_order": VH.VISION_POOL_ORDER,
    "vision_pool_scale": VH.VISION_POOL_SCALE,
    "vision_wrong_slots": H.VISION_SHIFTED,
}
QUANT = {
    "decode_rope_offset": H.ROPE_OFFSET,
    "reuse_own_cache_in_decode": H.UNWRITTEN_KV,
    "stale_ple_in_decode": H.STALE_PLE,
    "window_off_by_one": H.WINDOW_OFF_BY_ONE,
    "low_precision_layer": None,
}
SCHEMES = ("static-w8", "static-w4g32")
BASELINE_FACTOR = 1.5  # as tests/test_quant_bugs.py: BASE is the same simulated quantization


def test_every_zoo_entry_has_an_expectation():
    from tests.support.quant_bugs import BUGS as QUANT_BUGS

    assert set(FLOAT) == set(BUGS) and set(QUANT) == set(QUANT_BUGS)
    # on a model the zoo's goldens lack (tests/test_static_vision.py); the audio ones: tests/test_diff_audio.py
    elsewhere = {VH.VISION_STANDARDIZE, *AH.NAMES}
    assert set(FLOAT.values()) | set(QUANT.values()) | elsewhere == set(H.NAMES) | {None}  # every hint is tested


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hints")


@pytest.fixture(scope="module")
def zoo(workdir):
    return replayed_zoo(workdir)


def _name(result):
    return None if result.hint is None else result.hint.name


@pytest.mark.parametrize("bug", sorted(FLOAT))
def test_float_zoo_hint(zoo, bug):
    _, _, result = zoo(bug)
    assert not result.match
    assert _name(result) == FLOAT[bug], (result.first_divergence.sentence, result.hint)
    if result.hint is not None:
        assert result.hint.evidence and "bug" not in result.hint.evidence  # never the runtime's name


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_zoo_hints(workdir, scheme):
    pytest.importorskip("torchao")
    from tests.support.quant_bugs import runtime_spec as quant_spec

    ref = reference_path("prompt5", workdir)
    base = workdir / f"base-{scheme}.h5"
    replay_trace(ref, base, runtime=scheme, force=True)
    got = {}
    for bug in QUANT:
        run = workdir / f"{scheme}-{bug}.h5"
        replay_trace(ref, run, runtime=quant_spec(bug, scheme), force=True)
        result = diff_traces(ref, run, baseline_path=base, baseline_factor=BASELINE_FACTOR)
        assert not result.match, bug
        got[bug] = _name(result)
    assert got == QUANT


def test_window_evidence_names_the_extra_key(zoo):
    """The evidence states what was measured: the window, the queries and the keys."""
    _, _, result = zoo("window_off_by_one")
    ev = result.hint.evidence
    assert "window 8" in ev and "W + 1 = 9 keys q-8..q" in ev and "REF the last 8" in ev


def test_softcap_evidence_gives_both_errors(zoo):
    _, _, result = zoo("no_softcap")
    d = result.first_divergence
    ev = result.hint.evidence
    assert "30 * tanh(RUN / 30) is REF's logits" in ev
    assert f"RUN as it is: {sci(d.value)}" in ev  # the diff's own rel-L2 of that row


def test_hint_in_text_json_and_html(zoo):
    ref, run, result = zoo("decode_slice_short")
    r = invoke("diff", str(ref), str(run))
    assert r.exit_code == 1
    lines = r.output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  looks like: "))
    assert lines[at] == f"  looks like: {result.hint.name} ({result.hint.evidence})"
    assert all(line.startswith("  ") for line in lines[1:at])  # right after the first-divergence lines
    assert lines[at + 1].startswith("tokens")
    r = invoke("diff", str(ref), str(run), "--json")
    j = json.loads(r.output)
    assert j["hint"] == {"name": result.hint.name, "evidence": result.hint.evidence}
    assert list(j)[:3] == ["match", "first_divergence", "hint"]
    assert "looks like: " + H.CURRENT_KEY_LEFT_OUT in render_html(result)


def test_no_hint_no_key(zoo):
    """A divergence without a signature: no line, no JSON key (the fixtures' JSON is unchanged)."""
    _, _, result = zoo("no_ple")
    result = dataclasses.replace(result, hint=None)
    assert "looks like" not in format_text(result) and "hint" not in result.to_json()


def test_unreadable_trace_gives_no_hint(zoo, tmp_path):
    """The hint reads past the rows the diff read; a trace it cannot open gives no hint, no error."""
    ref, _, result = zoo("window_off_by_one")
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not a trace")
    assert H.likely_cause(result, ref, bad) is None


@pytest.mark.parametrize("rel,hinted", [(2e-4, False), (5e-2, True)])
def test_scores_wrong_needs_more_than_rounding(tmp_path, rel, hinted):
    """attention scores wrong fires on an attn_out that is right at position 0 (one key) and wrong from
    position 1, its q, mask and K/V matching, only where the error is far above the tolerance: FP16
    scores (llama.cpp) give about 2x the float32 tolerance there, with the same shape."""
    import numpy as np

    from gemma4_trace.recorder import golden
    from tests.support.diff_fixtures import copy_trace

    def edit(kind, layer, step, rows):
        if (kind, layer, step) == ("attn_out", 0, 0):
            rng = np.random.default_rng(5)
            scale = rel * np.sqrt(np.mean(rows[1:].astype(np.float64) ** 2, axis=-1, keepdims=True))
            rows[1:] += (rng.standard_normal(rows[1:].shape) * scale).astype(rows.dtype)
        return rows

    ref = golden.golden_path("short")
    copy_trace(ref, tmp_path / "run.h5", edit=edit)
    result = diff_traces(ref, tmp_path / "run.h5")
    d = result.first_divergence
    assert (d.step, d.layer, d.kind, d.position) == (0, 0, "attn_out", 1), d.sentence
    assert _name(result) == (H.SCORES_WRONG if hinted else None), result.hint
    if hinted:
        assert "broadcasts 1 KV head(s) to 4 query heads" in result.hint.evidence
