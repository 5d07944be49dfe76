"""Chosen token ids outside the tokenizer's vocabulary (a buggy runtime's dump may hold any
int64): `trace show` says which token it cannot decode, `trace diff` reports the token
divergence; neither ends in "internal error", and no id is silently dropped from the text.

The traces are the golden recording of the embedded model (whose tokenizer both commands
find by the model's name) with one chosen token replaced.
"""

from __future__ import annotations

import json
import shutil

import h5py
import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.traces import TraceReader
from gemma4_trace.traces import schema as S
from tests.support.cli import invoke

# 2^32: past the tokenizer's u32 ids; 10^6: a u32 the tokenizer does not know; the largest int64
BAD_IDS = [2**32, 10**6, 2**63 - 1]
STEP = 1


def with_token(tmp_path, token: int):
    path = tmp_path / f"token-{token}.h5"
    shutil.copyfile(golden_path("short"), path)
    with h5py.File(path, "r+") as f:
        ds = f[S.tensor_path(S.KIND_TOKEN, None)]
        ids = ds[()]
        ids[STEP] = token
        ds[...] = ids
    return path


@pytest.mark.parametrize("token", BAD_IDS)
def test_show_names_the_token_it_cannot_decode(tmp_path, token):
    r = invoke("show", with_token(tmp_path, token))
    assert r.exit_code == 0, r.output
    assert "internal error" not in r.output and "Traceback" not in r.output
    assert "generated  3 tokens (no EOS): [" in r.output and f", {token}, " in r.output
    text = [ln for ln in r.output.splitlines() if ln.startswith("text ")]
    assert text == [
        f"text       not decoded: token {token} of step {STEP} is not in the tokenizer's vocabulary (ids 0..679)"
    ], r.output


def test_show_still_decodes_a_good_trace():
    r = invoke("show", golden_path("short"))
    assert r.exit_code == 0 and 'text       "Once upon"' in r.output, r.output


@pytest.mark.parametrize("token", BAD_IDS)
def test_diff_reports_the_token_divergence(tmp_path, token):
    bad = with_token(tmp_path, token)
    with TraceReader(golden_path("short")) as g:
        ref_token = int(g.tokens()[STEP])
    for ref, run, (ref_id, run_id) in (
        (golden_path("short"), bad, (ref_token, token)),
        (bad, golden_path("short"), (token, ref_token)),
    ):
        r = invoke("diff", ref, run)
        assert r.exit_code == 1, r.output
        assert "internal error" not in r.output and "Traceback" not in r.output
        assert f"first divergence: decode step {STEP}, kind token" in r.output
        assert f"RUN chose token {run_id}, REF chose {ref_id}" in r.output
        j = invoke("diff", ref, run, "--json")
        assert j.exit_code == 1, j.output
        tokens = json.loads(j.output)["tokens"]
        bad_side, good_side = ("candidate", "reference") if run == bad else ("reference", "candidate")
        assert tokens[bad_side][STEP] == token
        assert tokens.get(f"{bad_side}_text") is None and tokens[f"{good_side}_text"] == "Once upon", tokens
