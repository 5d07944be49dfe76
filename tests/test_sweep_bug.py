"""A planted quantized bug (one layer's weights at int4 inside static-w8, tests/support/quant_bugs.py) shows in
a sweep's aggregates: every prompt's first divergence at that layer in the histogram, KL far above
the quantized base's; the quantized base alone, judged against a coarser baseline, crosses nothing."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import invoke
from tests.support.quant_bugs import LOW_LAYER, runtime_spec
from tests.test_sweep import subset_file

pytestmark = pytest.mark.slow  # a record, replays and a diff per prompt; make test-fast skips it

IDS = ("long-02", "ids-02", "image-00")  # past the window, token ids, an image


def test_planted_bug_shows_in_the_aggregates_and_its_base_alone_does_not(tmp_path):
    env = {"GEMMA4_TRACE_CACHE": str(tmp_path / "cache")}
    prompts = subset_file(tmp_path, IDS)
    common = ["sweep", prompts, "--max-new-tokens", 4]
    bug = runtime_spec("low_precision_layer", "static-w8")
    r = invoke(*common, "--runtime", bug, "--baseline-runtime", "static-w8", "-o", tmp_path / "bug", env=env)
    assert r.exit_code == 1, r.output
    s = json.loads((tmp_path / "bug" / "summary.json").read_text())
    assert s["diverging"] == len(IDS)
    assert s["first_divergence_histogram"] == [{"layer": LOW_LAYER, "kind": "q", "prompts": len(IDS)}]
    run, base = s["run"], s["base"]
    assert run["positions"] == base["positions"] > 0
    for q in ("p99", "p90", "p50"):
        assert run["kl"]["percentiles"][q] > 3 * base["kl"]["percentiles"][q], q
    assert run["kl"]["mean"] > 5 * base["kl"]["mean"]
    assert f"{LOW_LAYER} q" in r.stdout and "prompts diverge (exit 1)" in r.stdout
    # the summary page: BASE plotted beside RUN, every section with content, settings in words
    page = (tmp_path / "bug" / "summary.html").read_text()
    assert "KL(REF||RUN) and KL(REF||BASE) percentiles" in page and page.count("<polyline") == 2
    assert all(f"<title>{who} p99: " in page for who in ("RUN", "BASE"))
    # RUN drawn after BASE: on top where the two lines meet (BASE's grey line hid it)
    assert page.index("<title>BASE p99: ") < page.index("<title>RUN p99: ")
    assert page.index('stroke="#888888"') < page.index('stroke="#2c6fbb"')
    settings = page.split("<h2>Settings</h2>")[1]
    assert ">None<" not in settings and ">True<" not in settings and ">False<" not in settings
    assert '<td class="l">yes</td>' in settings  # chat
    assert "worst prompts (of" not in page  # the verdict box lists no ranking (the table below does)

    r = invoke(
        *common, "--runtime", "static-w8", "--baseline-runtime", "static-w4g32", "-o", tmp_path / "base", env=env
    )
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "base" / "summary.json").read_text())
    assert s["diverging"] == 0 and s["first_divergence_histogram"] == []
    assert f"all {len(IDS)} prompts match (exit 0)" in r.stdout
    # the float defaults alone cannot tell the base's noise from a bug: the baseline is what clears it
    r = invoke(*common, "--runtime", "static-w8", "-o", tmp_path / "alone", env=env)
    assert r.exit_code == 1, r.output
