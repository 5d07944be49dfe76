"""`trace diff REF RUN --baseline BASE` when BASE is itself noisy (a bf16 BASE against a float32
REF): an error BASE makes somewhere in a tensor and step is inside its envelope on every row
of that step (diff/baseline.py, check 3), and a token RUN chooses within reach of BASE's own
logit error is no divergence. Errors beyond what BASE ever makes still fail, on the right row.
"""

from __future__ import annotations

import numpy as np

from gemma4_trace.diff import diff_traces, format_text
from tests.support.cli import site_of
from tests.support.synth import write_trace

NOISE = 1e-5  # every float row of BASE and RUN, relative to the row's RMS (inside the float32 tolerance)
FLIP = 0.5  # a "near-tie flip": one row's attn_out moved by half its norm


def noisy(seed, flips=(), scale=FLIP, step=0, token=None):
    """Edit: small noise everywhere, plus big errors on attn_out of layer 1 at rows `flips` of
    `step`; `token` = (step, id) replaces a chosen token."""
    rng = np.random.default_rng(seed)

    def edit(k, l, s, rows):
        if k == "token":
            return np.int64(token[1]) if token and s == token[0] else rows
        if rows.dtype.kind != "f":
            return rows
        rows = rows + NOISE * rng.standard_normal(rows.shape) * np.sqrt(np.mean(rows**2))
        if (k, l, s) == ("attn_out", 1, step):
            for r in flips:
                rows[r] += scale * np.linalg.norm(rows[r]) * _unit(rng, rows[r].shape)
        return rows

    return edit


def _unit(rng, shape):
    v = rng.standard_normal(shape)
    return v / np.linalg.norm(v)


def traces(tmp_path, base_edit, run_edit):
    ref, base, run = tmp_path / "ref.h5", tmp_path / "base.h5", tmp_path / "run.h5"
    write_trace(ref, prompt_len=8)
    write_trace(base, prompt_len=8, mode="teacher-forced", edit=base_edit, force=True)
    write_trace(run, prompt_len=8, mode="teacher-forced", edit=run_edit, force=True)
    return ref, base, run


def test_flips_on_different_rows_are_the_same_noise(tmp_path):
    ref, base, run = traces(tmp_path, noisy(1, flips=(2, 6)), noisy(2, flips=(5,), scale=0.9 * FLIP))
    r = diff_traces(ref, run, baseline_path=base)
    assert r.match, format_text(r)
    plain = diff_traces(ref, run)  # without a baseline the flip is a divergence, at its row
    d = plain.to_json()["first_divergence"]
    assert site_of(d) == (0, 1, "attn_out", 5)


def test_an_error_beyond_base_worst_fails_on_its_row(tmp_path):
    ref, base, run = traces(tmp_path, noisy(1, flips=(2,)), noisy(2, flips=(5,), scale=4 * FLIP))
    r = diff_traces(ref, run, baseline_path=base)
    d = r.to_json()["first_divergence"]
    assert not r.match and site_of(d) == (0, 1, "attn_out", 5), format_text(r)
    b = d["baseline"]
    assert d["value"] > b["base_step_worst"] > b["base_value"] and b["ratio"] > 4
    assert "largest in this step" in d["sentence"]


def test_base_noise_in_prefill_does_not_cover_a_decode_step(tmp_path):
    """Check 3 is per step: BASE's prefill flip says nothing about a decode step's row."""
    ref, base, run = traces(tmp_path, noisy(1, flips=(2,)), noisy(2, flips=(0,), step=2, scale=0.5 * FLIP))
    d = diff_traces(ref, run, baseline_path=base).to_json()["first_divergence"]
    assert site_of(d, "step", "layer", "kind") == (2, 1, "attn_out")


def test_token_flip_within_base_logit_error(tmp_path):
    """RUN picks another token than REF and BASE at step 1: inside the envelope only when REF's
    logit gap to it is within twice BASE's largest logit error at that step."""
    from gemma4_trace.traces.reader import TraceReader

    ref = tmp_path / "ref.h5"
    write_trace(ref, prompt_len=8)
    with TraceReader(ref) as r:
        lg, chosen = r.read("logits")[1].astype(np.float64), int(r.tokens()[1])
    gap = lg[chosen] - lg  # REF's preference for its token over each other token
    gap[chosen] = np.nan
    near = int(np.nanargmin(np.where(gap > 0, gap, np.nan)))
    far = int(np.nanargmax(gap))
    err = 0.6 * gap[near]  # BASE's largest logit error at step 1: reaches `near` (2 x err > gap), not `far`
    assert gap[far] > 2 * err

    def base_edit(k, l, s, rows):
        if k == "logits" and s == 1:
            rows = rows.copy()
            rows[near] += err
        return rows

    base = tmp_path / "base.h5"
    write_trace(base, prompt_len=8, mode="teacher-forced", edit=base_edit)
    for token, inside in ((near, True), (far, False)):
        run = tmp_path / f"run{token}.h5"
        write_trace(run, prompt_len=8, mode="teacher-forced", edit=noisy(3, token=(1, token)))
        r = diff_traces(ref, run, baseline_path=base)
        if inside:
            assert r.match and any("inside the baseline" in n for n in r.notes), format_text(r)
        else:
            d = r.to_json()["first_divergence"]
            assert not r.match and site_of(d, "kind", "step") == ("token", 1), format_text(r)
        assert not diff_traces(ref, run).match  # two-way, every such flip is a divergence


def test_a_recorded_base_that_leaves_ref_tokens_bounds_the_steps(tmp_path):
    """BASE recorded on its own tokens (an HF bf16 recording) leaves REF's at step 1: its later
    steps had other inputs and give no envelope, so they are not compared (with a note)."""
    from gemma4_trace.traces.reader import TraceReader

    ref, base, run = tmp_path / "ref.h5", tmp_path / "base.h5", tmp_path / "run.h5"
    write_trace(ref, prompt_len=8)
    with TraceReader(ref) as r:
        other = (int(r.tokens()[1]) + 1) % 11
    write_trace(run, prompt_len=8, mode="teacher-forced", edit=noisy(2, flips=(0,), step=3))
    write_trace(base, prompt_len=8, mode="reference", edit=noisy(1, token=(1, other)))
    r = diff_traces(ref, run, baseline_path=base)
    assert r.match and r.to_json()["steps"]["numbers_compared"] == 2, format_text(r)
    assert any("leave REF's at step 1" in n and "tokens of steps 2..3 were not judged" in n for n in r.notes), r.notes
    write_trace(base, prompt_len=8, mode="reference", edit=noisy(1), force=True)  # on REF's tokens
    d = diff_traces(ref, run, baseline_path=base).to_json()["first_divergence"]
    assert site_of(d, "step", "layer", "kind") == (3, 1, "attn_out")


def test_every_token_flip_is_judged_not_only_the_first_hundred(tmp_path):
    """RUN and BASE flip the same tokens at steps 1..100 (inside); RUN alone flips step 110."""
    from gemma4_trace.traces.reader import TraceReader

    ref = tmp_path / "ref.h5"
    write_trace(ref, prompt_len=4, new_tokens=120)
    with TraceReader(ref) as r:
        other = (r.tokens() + 1) % 11

    def flips(steps):
        def edit(k, l, s, rows):
            return np.int64(other[s]) if k == "token" and s in steps else rows

        return edit

    base, run = tmp_path / "base.h5", tmp_path / "run.h5"
    write_trace(base, prompt_len=4, new_tokens=120, mode="teacher-forced", edit=flips(range(1, 101)))
    write_trace(run, prompt_len=4, new_tokens=120, mode="teacher-forced", edit=flips({*range(1, 101), 110}))
    d = diff_traces(ref, run, baseline_path=base).to_json()["first_divergence"]
    assert site_of(d, "kind", "step") == ("token", 110)


def _rewrite(path, kind, layer, fn):
    """Replace one tensor dataset of a trace by fn(its data), keeping its attributes."""
    import h5py

    from gemma4_trace.traces import schema as S

    with h5py.File(path, "r+") as f:
        p = S.tensor_path(kind, layer)
        data, attrs = f[p][...], dict(f[p].attrs)
        del f[p]
        new = f.create_dataset(p, data=fn(data))
        new.attrs.update(attrs)


def test_rows_base_lacks_or_spoils_give_no_envelope(tmp_path):
    """A BASE that holds NaN in a row of attn_out, or stopped reporting it after decode step
    1, gives no envelope there: RUN's error on such a row is judged by the tolerance
    alone (found), and nothing crashes."""
    ref, base, run = traces(tmp_path, noisy(1, flips=(1,), scale=0.4), noisy(2, flips=(1, 6), scale=0.3))
    assert diff_traces(ref, run, baseline_path=base).match  # row 6 inside BASE's worst (row 1) in prefill
    _rewrite(base, "attn_out", 1, lambda d: np.where(np.arange(len(d))[:, None] == 6, np.nan, d).astype(d.dtype))
    d = diff_traces(ref, run, baseline_path=base).to_json()["first_divergence"]
    assert site_of(d) == (0, 1, "attn_out", 6)

    (tmp_path / "b").mkdir()  # BASE stopped reporting attn_out of layer 1 after decode step 1
    ref2, base2, run2 = traces(tmp_path / "b", noisy(1, flips=(0,), step=3), noisy(2, flips=(0,), step=3))
    assert diff_traces(ref2, run2, baseline_path=base2).match  # the same flip in both: inside
    _rewrite(base2, "attn_out", 1, lambda d: d[:9])
    d = diff_traces(ref2, run2, baseline_path=base2).to_json()["first_divergence"]
    assert site_of(d, "step", "layer", "kind") == (3, 1, "attn_out")
