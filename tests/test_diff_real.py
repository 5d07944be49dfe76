"""trace diff on real HF recordings of the embedded model (float32 vs bfloat16)."""

import pytest

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.recorder import golden
from gemma4_trace.recorder.record import record_trace
from tests.support.cli import site_of


@pytest.fixture(scope="module")
def fp32_bf16(tmp_path_factory):
    d = tmp_path_factory.mktemp("dtypes")
    for dtype in ("float32", "bfloat16"):
        record_trace(output=d / f"{dtype}.h5", max_new_tokens=8, dtype=dtype)
    return d / "float32.h5", d / "bfloat16.h5"


def test_identical_traces_match():
    res = diff_traces(golden.golden_path("window"), golden.golden_path("window"))
    assert res.match and res.to_json()["first_divergence"] is None
    assert res.to_json()["tokens"]["accuracy"] == 1.0


def test_fp32_vs_bf16_under_fp32_tolerances_diverges_at_the_embeddings(fp32_bf16, tmp_path):
    strict = tmp_path / "fp32.toml"
    strict.write_text("[[rule]]\nrel_l2 = 1e-4\n")
    res = diff_traces(*fp32_bf16, strict)
    first = res.to_json()["first_divergence"]
    assert not res.match
    # bf16 rounds the embedding rows first: 8-bit mantissa gives rel-L2 around 2^-9
    assert site_of(first, "step", "phase", "layer", "kind", "position") == (0, "prefill", None, "embeddings", 0)
    assert first["metric"] == "rel_l2" and 1e-4 < first["value"] < 1e-2 and first["threshold"] == 1e-4
    assert format_text(res).startswith("first divergence: prefill")


def test_fp32_vs_bf16_under_default_tolerances_is_a_bf16_match_with_bf16_sized_errors(fp32_bf16):
    res = diff_traces(*fp32_bf16)
    js = res.to_json()
    assert res.match, format_text(res)
    table = js["growth"]["table"]  # layer x step rel-L2 of layer_out
    assert len(table) == 8 and len(table[0]) == 8
    errors = [v for row in table for v in row]
    assert 1e-3 < max(errors) < 5e-2  # bf16-sized: far above float32 rounding, far below a bug
    assert "error growth" in format_text(res)
