"""`trace replay --isolate`: every layer fed REF's input, so each layer's error is its own.

Local errors are computed here straight from the traces with numpy (rel-L2 of each
layer_out row against REF), never taken from the tool's report.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from gemma4_trace.cli import main
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.bug_zoo import reference_path
from tests.quant_bugs import LOW_LAYER, WEIGHT_SCHEMES, runtime_spec

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
        replay_trace(ref, out, runtime="tests.plugin_runtime:make_exported", isolate=True)
    r = CliRunner().invoke(main, ["replay", str(ref), "--isolate", "--runtime", "tests.plugin_runtime:make_exported",
                                  "-o", str(out)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "does not support --isolate" in r.output, r.output
    r = CliRunner().invoke(main, ["replay", str(ref), "--isolate", "--free-running", "-o", str(out)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--free-running" in r.output, r.output
    assert not out.exists()
