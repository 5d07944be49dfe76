"""`trace diff` output on golden-derived pairs is byte-identical to the checked-in fixtures.

The fixtures (tests/data/diff/) were written by the diff code before its dicts became
dataclasses, so JSON consumers see the same keys and values; see tests/support/diff_fixtures.py
for how the candidate traces are made and how paths are kept stable. Regenerated once on
purpose when the report gained logit metrics, per-step jumps from the embeddings, the
"not compared" status and the reference-as-free-running note (issue 11).
"""

import json

import pytest

from tests.support.diff_fixtures import CASES, expected_path, run_case


@pytest.mark.parametrize("name", sorted(CASES))
def test_diff_output_unchanged(name, tmp_path):
    out = run_case(name, tmp_path)
    for suffix, text in out.items():
        assert text == expected_path(name, suffix).read_text(encoding="utf-8"), f"{name}.{suffix} changed"
    j = json.loads(out["json"])
    assert j["match"] is (name == "match")  # every case but "match" plants a divergence
