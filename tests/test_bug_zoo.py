"""The bug zoo (tests/support/bug_zoo.py): `trace diff` must put the first divergence exactly where
each known Gemma 4 porting bug starts, and say so (exit 1, never "match").

Every expected (step, layer, kind, position) is derived here from the model's structure
and the reference's prompt (window, layer types, KV roles, image-token slots), never copied
from the tool's output. Data-flow order inside a step: embeddings, per_layer_inputs, RoPE
tables, then per layer mask, q, k, v, attn_out, layer_out, then final_hidden, logits.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.replayer.replay import default_max_seq, replay_trace
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.support.bug_zoo import (
    BUGS,
    CRASHING,
    RECORDED,
    SUBTLE,
    SUBTLE_LAYER,
    reference_path,
    replayed_zoo,
    runtime_spec,
)
from tests.support.cli import invoke, one_line_error, site_of


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module")
def zoo(workdir):
    return replayed_zoo(workdir)


class Facts:
    """What the expectations are derived from: the reference's model and prompt."""

    def __init__(self, ref):
        with TraceReader(ref) as r:
            self.T = r.prompt_len
            self.n_positions = r.n_positions
            self.max_new_tokens = r.max_new_tokens
            self.layers = r.layers
            self.prompt_ids = [int(x) for x in r.prompt_ids]
            cfg = r.model_config
            pos = r.extra_inputs().get("image_position_ids")
            self.patch_budget = None if pos is None else pos.shape[1]
            self.grids = [] if pos is None else [p[(p != -1).all(-1)] for p in pos]  # real patches (x, y)
        text = cfg.get("text_config", cfg)
        self.window = int(text["sliding_window"])
        self.image_token_id = cfg.get("image_token_id")
        self.first_sliding = min(i for i, li in enumerate(self.layers) if li.layer_type == "sliding_attention")
        self.first_full = min(i for i, li in enumerate(self.layers) if li.layer_type == "full_attention")
        self.first_reuser = min(i for i, li in enumerate(self.layers) if li.kv_role == "reuses")

    def step_of(self, pos: int) -> int:
        return 0 if pos < self.T else pos - self.T + 1

    @property
    def first_image_slot(self) -> int:
        return self.prompt_ids.index(self.image_token_id)


FIRST_ROPE_KIND = next(k for k in S.KIND_NAMES if k.startswith("rope_"))


def expected(bug: str, f: Facts) -> tuple[int, int | None, str, int]:
    """(step, layer, kind, position) where the bug starts."""
    T, W = f.T, f.window
    if bug == "zero_prefill_mask":
        # layer 0 is the first to apply a mask; query 0 is the first with a future key (1)
        return 0, 0, "mask", 0
    if bug == "identity_rope":
        # position 0 rotates by angle 0 (cos 1, sin 0) in both; position 1 has angle 1 * inv_freq[0] = 1 rad
        # in the first RoPE table of the data-flow order
        return 0, None, FIRST_ROPE_KIND, 1
    if bug == "shared_decode_mask":
        # prefill is right; a decode query p sees key p - W under the causal mask: first p >= max(W, T)
        p = max(W, T)
        return f.step_of(p), f.first_sliding, "mask", p
    if bug in ("window_off_by_one", "window_off_by_one_decode"):
        # the extra key p - W exists from p == W on: prefill when T > W, else decode
        return f.step_of(W), f.first_sliding, "mask", W
    if bug == "reuse_own_empty_cache":
        # this runtime attends through the cache in prefill as well: the first reusing layer reads
        # zeros from position 0; its mask and q are right, it writes no k/v -> attn_out
        return 0, f.first_reuser, "attn_out", 0
    if bug in ("reuse_own_cache_in_decode", "reuse_stale_current_row"):
        # prefill is right; the first decode step's reusing layer attends over wrong K/V rows
        return 1, f.first_reuser, "attn_out", T
    if bug == "decode_slice_short":
        # every layer misses the current key from the first decode query on; layer 0 comes first
        return 1, 0, "mask", T
    if bug == "padding_kv_read_by_slot":
        # prefill masks hide the padding rows; the first decode query sees the later slots
        return 1, 0, "mask", T
    if bug == "full_attention_scaled":
        # q, k, v and the mask are right; query 0 sees one key (softmax weight 1 whatever its score),
        # query 1 two: the first full layer's attention output from position 1
        return 0, f.first_full, "attn_out", 1
    if bug == "no_softcap":
        # nothing before the logits changes; logits are indexed by step, at the prefill's last position
        return 0, None, "logits", T - 1
    if bug == "no_ple":
        # no per_layer_inputs reported (not compared); PLE joins the residual at the end of layer 0
        return 0, 0, "layer_out", 0
    if bug == "ple_raw_image_ids":
        return 0, None, "per_layer_inputs", f.first_image_slot
    if bug == "image_block_causal":
        # the first image query is the first with a later key of its own image, on the first sliding layer
        return 0, f.first_sliding, "mask", f.first_image_slot
    if bug == "image_block_past_window":
        # query q blocks key k <= q - W; the image's first key falls out of the window at q = first + W
        return 0, f.first_sliding, "mask", f.first_image_slot + W
    if bug in ("vision_scaled", "vision_wrong_slots"):
        return 0, None, "embeddings", f.first_image_slot
    if bug == "vision_rope_axes":
        # q comes before k in the vision layer; x and y swapped change nothing where x == y: the first
        # patch off the diagonal, in image 1's row order
        xy = f.grids[0]
        return 0, 0, "vision.q", int(np.flatnonzero(xy[:, 0] != xy[:, 1])[0])
    if bug == "vision_pool_order":
        # the cell index transposed: the first pooled token whose (row, col) is not its own transpose
        width = (int(f.grids[0][:, 0].max()) + 1) // 2  # the embedded model pools 2 x 2
        return 0, None, "vision.pooled", next(t for t in range(width * width) if t // width != t % width)
    if bug == "vision_pool_scale":
        return 0, None, "vision.pooled", 0  # every pooled row is scaled
    raise AssertionError(f"no expectation for {bug}")


def check_details(bug: str, f: Facts, d: dict, result) -> None:
    """Bug-specific details of the first divergence (mask keys, values)."""
    T, W = f.T, f.window
    if bug == "zero_prefill_mask":
        assert d["allowed_in_run_blocked_in_ref"][0] == 1
    elif bug == "identity_rope":
        assert d["ref_value"] == pytest.approx(math.cos(1.0), abs=1e-6) and d["run_value"] == 1.0
    elif bug in ("shared_decode_mask", "window_off_by_one", "window_off_by_one_decode"):
        p = d["position"]
        assert d["allowed_in_run_blocked_in_ref"] == [p - W] and d["n_blocked_in_run_allowed_in_ref"] == 0
    elif bug == "reuse_own_empty_cache" or bug == "reuse_own_cache_in_decode":
        assert d["run_value"] == 0.0  # attention over all-zero values
    elif bug == "decode_slice_short":
        assert d["blocked_in_run_allowed_in_ref"] == [T] and d["n_allowed_in_run_blocked_in_ref"] == 0
    elif bug == "padding_kv_read_by_slot":
        max_seq = default_max_seq(T, f.max_new_tokens)
        assert d["allowed_in_run_blocked_in_ref"] == list(range(T + 1, max_seq))
        assert "never-written slot" in d["sentence"]
    elif bug == "image_block_causal":  # the image's later keys, none extra
        first = f.first_image_slot
        assert d["blocked_in_run_allowed_in_ref"][0] == first + 1 and d["n_allowed_in_run_blocked_in_ref"] == 0
    elif bug == "image_block_past_window":  # the image's first key, nothing blocked
        assert d["allowed_in_run_blocked_in_ref"] == [f.first_image_slot] and d["n_blocked_in_run_allowed_in_ref"] == 0
    elif bug == "no_softcap":
        assert all(t.status == "ok" for t in result.tensors if t.kind != "logits")
    elif bug == "no_ple":
        assert ("per_layer_inputs", None, "only in REF") in [
            site_of(s, "kind", "layer", "reason") for s in result.skipped
        ]


def check_tokens(ref, run, result, d) -> None:
    """The token report against the chosen tokens read straight from both traces."""
    with TraceReader(ref) as a, TraceReader(run) as b:
        rt, ct = a.tokens(), b.tokens()
    tok = result.to_json()["tokens"]
    assert tok["reference"] == rt.tolist() and tok["candidate"] == ct.tolist()
    diff = np.flatnonzero(rt != ct)
    first = int(diff[0]) if diff.size else None
    assert tok["first_mismatch_step"] == first
    assert tok["accuracy"] == pytest.approx(float(np.mean(rt == ct)))
    if first is not None:
        assert first >= d["step"]  # a token cannot change before the numbers do
        assert (tok["reference_token"], tok["candidate_token"]) == (int(rt[first]), int(ct[first]))


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_bug_is_localised(zoo, bug):
    ref, run, result = zoo(bug)
    f = Facts(ref)
    assert not result.match
    d = result.to_json()["first_divergence"]
    if bug == "vision_padding":  # not positional: layer 0's attention output of the padded image (image 1)
        assert site_of(d)[:3] == (0, 0, "vision.attn_out") and d["position"] < len(f.grids[0]) < f.patch_budget
        return
    step, layer, kind, position = expected(bug, f)
    assert site_of(d) == (step, layer, kind, position), d["sentence"]
    assert d["phase"] == ("prefill" if step == 0 else "decode")
    assert format_text(result).splitlines()[0] == d["sentence"]
    check_details(bug, f, d, result)
    check_tokens(ref, run, result, d)


def test_no_softcap_keeps_every_token(zoo):
    # tanh(x / cap) * cap is strictly increasing: the argmax cannot change
    _, _, result = zoo("no_softcap")
    assert result.tokens.first_mismatch_step is None and result.tokens.accuracy == 1.0


@pytest.mark.parametrize("name", sorted({ref for _, ref, _ in BUGS.values()}))
def test_static_runtime_matches_each_reference(workdir, name):
    """The zoo's references replay cleanly on the unmodified runtime: each divergence is the bug's."""
    ref = reference_path(name, workdir)
    run = workdir / f"static_{name}.h5"
    replay_trace(ref, run, force=True)
    result = diff_traces(ref, run)
    assert result.match, format_text(result)
    if name in RECORDED:  # prompt5 exists to decode past the window from a shorter prompt
        f = Facts(ref)
        assert f.T < f.window < f.n_positions


@pytest.mark.parametrize("bug", sorted(SUBTLE))
def test_a_bug_under_the_tolerance_gets_a_note_naming_its_layer(zoo, bug):
    """Under the tolerance the diff matches (exit 0), but the planted layer's own error stands out
    against the others' round-off: a note names it, in the text and the JSON."""
    ref, run, result = zoo(bug)
    assert result.match, format_text(result)
    o = result.growth.outlier
    assert o is not None and o.layer == SUBTLE_LAYER and o.ratio >= 20 and o.typical < 2, o
    if bug.startswith("decode_"):
        assert o.step >= 1
    r = invoke("diff", str(ref), str(run))
    assert r.exit_code == 0 and f"note: layer {SUBTLE_LAYER}'s own error stands out at " in r.output, r.output
    j = json.loads(invoke("diff", str(ref), str(run), "--json").output)
    assert j["match"] is True and j["growth"]["outlier"]["layer"] == SUBTLE_LAYER


@pytest.mark.parametrize("name", ["short", "window", "eos", "image", "two_images", "prompt5"])
def test_a_clean_replay_gets_no_outlier_note(workdir, name):
    """The static runtime's round-off grows alike through the layers: no layer is singled out."""
    ref = reference_path(name, workdir)
    run = workdir / f"clean_{name}.h5"
    replay_trace(ref, run, force=True)
    result = diff_traces(ref, run)
    assert result.match and result.growth.outlier is None, format_text(result)
    assert "stands out" not in format_text(result)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_cli_never_reports_match_on_a_bug(zoo, bug):
    """Bug class 10: no "All checks passed" on a mismatch. Exit 1, a divergence sentence first."""
    ref, run, _ = zoo(bug)
    r = invoke("diff", str(ref), str(run))
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("first divergence: ")
    assert not any(line.lower().startswith("match") for line in lines)
    assert "no divergence" not in r.output and "passed" not in r.output.lower()
    r = invoke("diff", str(ref), str(run), "--json")
    assert r.exit_code == 1 and json.loads(r.output)["match"] is False


def test_sliding_head_dim_cache_fails_naming_the_layer(workdir):
    ref = reference_path(CRASHING["sliding_head_dim_cache"][1], workdir)
    f = Facts(ref)
    # the first full layer is the first whose head_dim differs from the sliding one; it owns K/V
    layer = f.first_full
    assert f.layers[layer].kv_role != "reuses" and f.layers[layer].head_dim != f.layers[f.first_sliding].head_dim
    out = workdir / "crash.h5"
    with pytest.raises(TraceToolError, match=rf"layer {layer} \(full_attention\) writes K/V"):
        replay_trace(ref, out, runtime=runtime_spec("sliding_head_dim_cache"))
    assert not out.exists()
    r = invoke("replay", str(ref), "--runtime", runtime_spec("sliding_head_dim_cache"), "-o", str(out))
    one_line_error(r, f"layer {layer} (full_attention)", out=out)


def test_a_pooling_kernel_that_changes_the_token_count_is_one_line(workdir):
    """Pooling 3 x 3 where the model pools 2 x 2 gives another number of soft tokens than the prompt
    has image slots: the replay cannot run, and says why in one line (no trace)."""
    ref, out = reference_path(CRASHING["vision_pool_kernel"][1], workdir), workdir / "kernel.h5"
    with TraceReader(ref) as r:
        slots = r.towers["vision"].tokens
    r = invoke("replay", str(ref), "--runtime", runtime_spec("vision_pool_kernel"), "-o", str(out))
    line = one_line_error(r, f"for {slots} image-token slots in the prompt", "pools or resizes otherwise", out=out)
    assert f"give {slots} soft tokens" not in line
