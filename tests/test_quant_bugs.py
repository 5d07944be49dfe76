"""Planted bugs on top of the quantized runtimes (tests/support/quant_bugs.py) are localised exactly
under quantization noise: to the step, layer, kind and position where each starts, with
tolerances calibrated from the quantized runtime alone; and that runtime alone is a match.

Models: the embedded tiny model (window 8, prompt of 5: decode crosses the window) and two
random variants of tests/support/tiny_models.py (k_eq_v; MoE), window 4. Every expected place is
derived from the model's structure and REF's tokens, never from the tool's output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gemma4_trace.diff import diff_traces
from gemma4_trace.diff.calibrate import write_calibration
from gemma4_trace.recorder.record import record_trace
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.reader import TraceReader
from tests.support import tiny_models
from tests.support.bug_zoo import reference_path
from tests.support.cli import site_of
from tests.support.quant_bugs import BUGS, LOW_LAYER, WEIGHT_SCHEMES, runtime_spec
from tests.test_bug_zoo import FIRST_ROPE_KIND, Facts

pytestmark = pytest.mark.slow  # every quantized bug of the zoo replayed and diffed; make test-fast skips it

pytest.importorskip("torchao")

MODELS = ("embedded", "k_eq_v", "moe")
VARIANT_PROMPT = [2, 10, 11, 12, 13]
# weights at the scale of real checkpoints (and of the embedded model); at the variants' default
# 0.2 (raised for clear top-1 margins) int8 noise alone already hides the KV-reuse bug on MoE
INIT = 0.02
# Measured limit of calibrated tolerances: int4 (groups of 32) on these 32-wide random stacks
# gives rel-L2 0.3..1.3 per layer at layer 0 and 1..3 from layer 1 on (sharp softmax, no 1/sqrt(d)
# scaling). A KV-reuse bug (attn_out -> 0, rel-L2 1) or one layer at int2 is inside that
# envelope: these pairs need --baseline (a trusted run of the same quantization), not tolerances.
# BASE here is the same simulated quantization as the bug's runtime, so their noise is the same
# but for the bug: a low factor is right (docs/quantized.md; the default 4 is for a BASE whose
# rounding is independent of RUN's). Measured: at 4 the int4 runs of the random variants put
# the one-layer-at-int2 bug in a later kind or position of that layer, at 1.5 exactly.
BASELINE_FACTOR = 1.5
HIDDEN_BY_INT4_NOISE = {
    (m, "static-w4g32", b) for m in ("k_eq_v", "moe") for b in ("reuse_own_cache_in_decode", "low_precision_layer")
}


def _cases():
    for model in MODELS:
        for scheme in WEIGHT_SCHEMES:
            for bug in BUGS:
                hidden = (model, scheme, bug) in HIDDEN_BY_INT4_NOISE
                marks = pytest.mark.skip(reason="inside int4 noise of a 32-wide random model") if hidden else ()
                yield pytest.param(model, scheme, bug, marks=marks, id=f"{model}-{scheme}-{bug}")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Traces made once per module: REF per model, BASE + calibrated file per scheme, bug runs."""
    root = tmp_path_factory.mktemp("quant_bugs")
    cache: dict = {}

    def ref(model):
        """(REF path, model folder or None for the embedded model)."""
        if ("ref", model) not in cache:
            if model == "embedded":
                cache[("ref", model)] = (reference_path("prompt5", root), None)
            else:
                d = root / model
                folder = tiny_models.build(d / "model", model, initializer_range=INIT)
                record_trace(folder, d / "ref.h5", input_ids=VARIANT_PROMPT, max_new_tokens=8)
                cache[("ref", model)] = (d / "ref.h5", folder)
        return cache[("ref", model)]

    def base(model, scheme):
        key = ("base", model, scheme)
        if key not in cache:
            r, folder = ref(model)
            run = r.parent / f"{model}-{scheme}.h5"
            replay_trace(r, run, model_dir=folder, runtime=scheme, force=True)
            tol = r.parent / f"{model}-{scheme}.toml"
            write_calibration(r, [run], tol, margin=2.0, force=True)
            cache[key] = (run, tol)
        return cache[key]

    def bug(model, scheme, name):
        key = ("bug", model, scheme, name)
        if key not in cache:
            r, folder = ref(model)
            run = r.parent / f"{model}-{scheme}-{name}.h5"
            replay_trace(r, run, model_dir=folder, runtime=runtime_spec(name, scheme), force=True)
            cache[key] = run
        return cache[key]

    return SimpleNamespace(ref=ref, base=base, bug=bug)


def expected(bug: str, f: Facts, ref_tokens) -> tuple[int, int | None, str, int]:
    T, W = f.T, f.window
    if bug == "decode_rope_offset":
        # the first decode step's RoPE tables are the first thing it gets wrong
        return 1, None, FIRST_ROPE_KIND, T
    if bug == "reuse_own_cache_in_decode":
        # prefill is right; the first decode step's first reusing layer attends over zeros
        return 1, f.first_reuser, "attn_out", T
    if bug == "stale_ple_in_decode":
        # step 1 computes the PLE it keeps; the first later step fed another token differs
        s = next(s for s in range(2, len(ref_tokens) + 1) if ref_tokens[s - 1] != ref_tokens[0])
        return s, None, "per_layer_inputs", T + s - 1
    if bug == "low_precision_layer":
        # q is the layer's first quantized product; the prompt's first row already shows it
        return 0, LOW_LAYER, "q", 0
    if bug == "window_off_by_one":
        # the extra key p - W exists from p == W on (prefill when T > W, else decode)
        return f.step_of(W), f.first_sliding, "mask", W
    raise AssertionError(bug)


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
@pytest.mark.parametrize("model", MODELS)
def test_quantized_runtime_alone_is_a_match_under_its_calibration(lab, model, scheme):
    ref, _ = lab.ref(model)
    run, tol = lab.base(model, scheme)
    assert not diff_traces(ref, run).match  # the float defaults cannot tell noise from bugs
    result = diff_traces(ref, run, tol)
    assert result.match, result.first_divergence and result.first_divergence.sentence


@pytest.mark.parametrize("model,scheme,bug", list(_cases()))
def test_bug_localised_with_calibrated_tolerances(lab, model, scheme, bug):
    ref, _ = lab.ref(model)
    _, tol = lab.base(model, scheme)
    run = lab.bug(model, scheme, bug)
    with TraceReader(ref) as r:
        ref_tokens = [int(t) for t in r.tokens()]
    f = Facts(ref)
    result = diff_traces(ref, run, tol)
    assert not result.match
    d = result.first_divergence
    assert site_of(d) == expected(bug, f, ref_tokens), d.sentence
    if bug == "window_off_by_one":
        assert d.detail.allowed_in_run_blocked_in_ref == [0]  # key p - W at query p = W


@pytest.mark.parametrize("factor", [BASELINE_FACTOR, 4.0])
@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
@pytest.mark.parametrize("model", MODELS)
def test_quantized_runtime_alone_is_a_match_under_baseline(lab, model, scheme, factor):
    """RUN: the same quantization replayed at another max_seq (other matmul shapes, other
    round-off); BASE: the quantized runtime. No false alarm, although REF is float."""
    ref, folder = lab.ref(model)
    base, _ = lab.base(model, scheme)
    run = ref.parent / f"{model}-{scheme}-max-seq-64.h5"
    if not run.exists():
        replay_trace(ref, run, model_dir=folder, runtime=scheme, max_seq=64)
    result = diff_traces(ref, run, baseline_path=base, baseline_factor=factor)
    assert result.match, result.first_divergence and result.first_divergence.sentence
    assert result.baseline.factor == factor and result.baseline.trace.runtime == scheme


def _baseline_cases():
    for model in MODELS:
        for scheme in WEIGHT_SCHEMES:
            for bug in BUGS:
                hidden = (model, scheme, bug) == ("moe", "static-w4g32", "reuse_own_cache_in_decode")
                marks = pytest.mark.skip(reason="BASE's own attn_out error there is 0.7+ (int4 MoE)") if hidden else ()
                yield pytest.param(model, scheme, bug, marks=marks, id=f"{model}-{scheme}-{bug}")


@pytest.mark.parametrize("model,scheme,bug", list(_baseline_cases()))
def test_bug_localised_with_baseline(lab, model, scheme, bug):
    ref, _ = lab.ref(model)
    base, _ = lab.base(model, scheme)
    run = lab.bug(model, scheme, bug)
    with TraceReader(ref) as r:
        ref_tokens = [int(t) for t in r.tokens()]
    result = diff_traces(ref, run, baseline_path=base, baseline_factor=BASELINE_FACTOR)
    assert not result.match
    d = result.first_divergence
    assert site_of(d) == expected(bug, Facts(ref), ref_tokens), d.sentence
    if d.baseline is not None:  # float rows: the figures say how far outside the envelope
        assert d.baseline.ratio > BASELINE_FACTOR and d.baseline.run_vs_base > d.threshold
        assert "x the baseline" in d.sentence or "BASE is exact here" in d.sentence
