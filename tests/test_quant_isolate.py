"""`trace replay --isolate`: every layer fed REF's input, so each layer's error is its own.

Local errors are computed here straight from the traces with numpy (rel-L2 of each
layer_out row against REF), never taken from the tool's report.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.support.bug_zoo import reference_path
from tests.support.cli import invoke, one_line_error
from tests.support.quant_bugs import LOW_LAYER, WEIGHT_SCHEMES, runtime_spec

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference_path("prompt5", tmp_path_factory.mktemp("isolate"))


def _replay(ref, name, runtime, isolate=True):
    out = ref.parent / f"{name}.h5"
    if not out.exists():
        replay_trace(ref, out, runtime=runtime, isolate=isolate)
    return out


def local_errors(ref, run, kind="layer_out") -> np.ndarray:
    """Worst per-row rel-L2 of `kind` per layer (rows of every step)."""
    out = []
    with TraceReader(ref) as a, TraceReader(run) as b:
        for layer in range(len(a.layers)):
            x = a.read(kind, layer).astype(np.float64)
            y = b.read(kind, layer).astype(np.float64)
            x, y = x.reshape(len(x), -1), y.reshape(len(y), -1)
            out.append((np.linalg.norm(y - x, axis=1) / np.linalg.norm(x, axis=1)).max())
    return np.array(out)


def test_float_static_runtime_isolated_is_round_off(ref):
    run = _replay(ref, "static-iso", "static")
    with TraceReader(run) as r:
        assert r.provenance["mode"] == "isolated"
        assert [int(t) for t in r.tokens()] == [int(t) for t in TraceReader(ref).tokens()]
    for kind in ("q", "attn_out", "layer_out"):
        assert local_errors(ref, run, kind).max() < 1e-5, kind


def test_isolation_removes_accumulated_drift(ref):
    """Without isolation int8 noise grows down the stack; isolated, each layer keeps its own."""
    free = local_errors(ref, _replay(ref, "w8", "static-w8", isolate=False))
    iso = local_errors(ref, _replay(ref, "w8-iso", "static-w8"))
    assert iso.max() < free.max()
    assert np.all(iso[1:] <= free[1:] * 1.5)


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
def test_low_precision_layer_ranks_first_when_isolated(ref, scheme):
    run = _replay(ref, f"low-{scheme}-iso", runtime_spec("low_precision_layer", scheme))
    errors = local_errors(ref, run)
    assert int(np.argmax(errors)) == LOW_LAYER, errors
    # and well above the same layer's own quantization noise in the isolated known-good run
    base = local_errors(ref, _replay(ref, f"{scheme}-iso", scheme))
    assert errors[LOW_LAYER] > 2 * base[LOW_LAYER]


def test_isolate_is_refused_where_it_cannot_work(ref, tmp_path):
    out = tmp_path / "x.h5"
    with pytest.raises(TraceToolError, match="does not support --isolate"):
        replay_trace(ref, out, runtime="tests.support.plugin_runtime:make_exported", isolate=True)
    r = invoke(
        "replay", str(ref), "--isolate", "--runtime", "tests.support.plugin_runtime:make_exported", "-o", str(out)
    )
    one_line_error(r, "does not support --isolate")
    r = invoke("replay", str(ref), "--isolate", "--free-running", "-o", str(out))
    one_line_error(r, "--free-running")
    assert not out.exists()


@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
def test_diff_of_an_isolated_trace_ranks_the_planted_layer_first(ref, scheme, tmp_path):
    run = _replay(ref, f"low-{scheme}-iso", runtime_spec("low_precision_layer", scheme))
    result = diff_traces(ref, run)
    ranking = result.isolation.ranking
    assert ranking[0].layer == LOW_LAYER == int(np.argmax(local_errors(ref, run)))
    assert [e.rel_l2 for e in ranking] == sorted((e.rel_l2 for e in ranking), reverse=True)
    assert len(ranking) == len(result.layers)
    assert f"local error, layer_out rel-L2 at the worst step: L{LOW_LAYER} " in format_text(result)
    assert result.to_json()["isolation"]["ranking"][0]["layer"] == LOW_LAYER
    r = invoke("diff", str(ref), str(run), "--report", str(tmp_path / "r.html"))
    assert r.exit_code == 1 and "Layers by local error" in (tmp_path / "r.html").read_text()


def test_float_isolated_ranking_is_round_off_and_plain_diffs_have_none(ref):
    result = diff_traces(ref, _replay(ref, "static-iso", "static"))
    assert result.match and max(e.rel_l2 for e in result.isolation.ranking) < 1e-5
    plain = diff_traces(ref, _replay(ref, "w8", "static-w8", isolate=False))
    assert plain.isolation is None and "isolation" not in plain.to_json()
