"""Report fixes for quantized candidates (issue 11 §6), on real runs of the embedded model."""

from __future__ import annotations

import re

import pytest

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.recorder.record import record_trace
from gemma4_trace.replayer.replay import replay_trace
from tests.support.bug_zoo import reference_path, runtime_spec

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference_path("prompt5", tmp_path_factory.mktemp("report"))


def _replay(ref, name, runtime):
    out = ref.parent / f"{name}.h5"
    if not out.exists():
        replay_trace(ref, out, runtime=runtime)
    return out


def test_largest_jump_is_per_step_and_includes_the_embeddings(ref):
    # decode-only bug whose first wrong layer is layer 0 (sliding): prefill is exact
    result = diff_traces(ref, _replay(ref, "shared-decode-mask", runtime_spec("shared_decode_mask")))
    j = result.growth.largest_jump
    assert j.layer == 0 and j.step >= 1 and j.ratio > 100
    assert f"largest jump: from the embeddings into layer 0 at decode step {j.step}" in format_text(result)


def test_value_and_threshold_never_print_alike(ref, tmp_path):
    run = _replay(ref, "w8", "static-w8")
    value = diff_traces(ref, run).first_divergence.value
    tol = tmp_path / "t.toml"
    tol.write_text(f'[[rule]]\nkind = "per_layer_inputs"\nrel_l2 = {value * 0.999!r}\n')
    d = diff_traces(ref, run, tol).first_divergence
    shown = re.search(r"rel-L2 (\S+) > (\S+) ", d.sentence).groups()
    assert shown[0] != shown[1] and float(shown[0]) > float(shown[1]), d.sentence


def test_tensors_after_the_first_divergence_are_not_called_ok(ref):
    result = diff_traces(ref, _replay(ref, "w8", "static-w8"))
    assert not result.match
    statuses = {t.status for t in result.tensors}
    assert "not compared" in statuses or "partly compared" in statuses
    for t in result.tensors:
        if t.status == "ok":
            assert t.rows_compared == t.rows
        if t.status == "not compared":
            assert t.rows_compared == 0


def test_per_layer_inputs_origin_is_judged_from_the_embeddings(ref):
    d = diff_traces(ref, _replay(ref, "w8", "static-w8")).first_divergence
    assert d.kind == "per_layer_inputs"
    assert d.origin.input.kind == "embeddings" and d.origin.verdict == "introduced"
    assert "token ids" not in (d.origin.reason or "")


def test_a_second_reference_is_compared_as_free_running(tmp_path):
    """Two recordings of one prompt by two checkpoints of one config (random weights of two seeds),
    each fed its own tokens: their tokens differ, and after the first step whose token differs
    nothing is compared, with a note saying why."""
    from tests.support import tiny_models

    refs = []
    for seed in (0, 1):
        model = tiny_models.build(tmp_path / f"model{seed}", seed=seed)
        refs.append(tmp_path / f"ref{seed}.h5")
        record_trace(model_dir=model, output=refs[-1], input_ids=[2, 17, 33, 40], max_new_tokens=6)
    result = diff_traces(*refs)
    assert result.steps.free_running
    assert any("reference recording" in n for n in result.notes)
    m = result.tokens.first_mismatch_step
    assert m is not None and m + 1 < result.steps.compared, (m, result.steps.compared)  # tokens really differ
    assert result.steps.numbers_compared == m + 1
