"""`trace record --shared-kv-prefill last`: generate()'s prefill shortcut, on the embedded model.

The KV-sharing layers then run only the last prompt position in prefill (their other rows
feed nothing); the trace stores those rows as zeros flagged absent and the diff leaves
them out. Everything recorded must still be HF's numbers, and bugs in those layers must
still be found (at the last prompt position or in decode).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error, site_of

PROMPT = ["--input-ids", "2,100,101,102,103,104,105,106,107,108,109", "--max-new-tokens", 5]
ROW_KINDS = ("mask", "q", "attn_out", "layer_out")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("skv")
    for name, extra in (("full", []), ("last", ["--shared-kv-prefill", "last"])):
        res = invoke("record", *PROMPT, "-o", d / f"{name}.h5", *extra)
        assert res.exit_code == 0, res.output
    return d


def test_last_row_trace_holds_hf_rows_and_flags_the_rest(traces):
    with TraceReader(traces / "full.h5") as a, TraceReader(traces / "last.h5") as b:
        T = len(a.prompt_ids)
        reusing = [i for i, li in enumerate(b.layers) if li.kv_role == "reuses"]
        assert reusing and len(reusing) < len(b.layers)
        assert "KV-shared prefill: last row" in b.provenance["runtime"]
        assert np.array_equal(a.tokens(), b.tokens())
        np.testing.assert_allclose(b.read("logits"), a.read("logits"), rtol=1e-5, atol=1e-5)
        for kind, layer in a.kinds_present():
            if kind == "token":
                continue
            present = b.rows_present(kind, layer)
            x, y = a.read(kind, layer), b.read(kind, layer)
            if layer in reusing and kind in ROW_KINDS or kind == "final_hidden":
                # the prompt's rows but the last are absent (zeros); the last and every decode row are HF's
                assert present is not None and not present[: T - 1].any() and present[T - 1 :].all(), (kind, layer)
                assert not y[: T - 1].any()
                x, y = x[T - 1 :], y[T - 1 :]
            else:
                assert present is None, (kind, layer)
            if x.dtype == bool:
                assert np.array_equal(x, y), (kind, layer)
            else:  # the same math on fewer rows: equal up to float32 round-off
                np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5, err_msg=f"{kind} {layer}")


def test_diff_and_replay_leave_absent_rows_out(traces):
    full, last = traces / "full.h5", traces / "last.h5"
    res = invoke("diff", full, last, "--json")
    assert res.exit_code == 0, res.output
    tensors = {site_of(t, "kind", "layer"): t for t in json.loads(res.output)["tensors"]}
    assert tensors[("layer_out", 7)]["absent_rows"] == 10 and tensors[("layer_out", 0)].get("absent_rows") in (None, 0)
    run_path = traces / "run.h5"
    res = invoke("replay", last, "-o", run_path)  # the static runtime computes every row; the diff compares REF's
    assert res.exit_code == 0, res.output
    res = invoke("diff", last, run_path)
    assert res.exit_code == 0 and "rows not reported (not compared)" in res.output, res.output
    res = invoke("replay", last, "--isolate", "-o", traces / "iso.h5")
    assert res.exit_code == 0, res.output
    assert invoke("diff", last, traces / "iso.h5").exit_code == 0


def test_a_bug_in_the_sharing_layers_is_still_found(traces):
    """Reusing layers reading their own empty cache: found at prefill, layer 5, the last prompt position."""
    last, out = traces / "last.h5", traces / "bug.h5"
    res = invoke("replay", last, "--runtime", "tests.support.bug_zoo:make_reuse_own_empty_cache", "-o", out)
    assert res.exit_code == 0, res.output
    res = invoke("diff", last, out, "--json")
    assert res.exit_code == 1, res.output
    d = json.loads(res.output)["first_divergence"]
    with TraceReader(last) as r:
        first_reusing = next(i for i, li in enumerate(r.layers) if li.kv_role == "reuses")
        T = len(r.prompt_ids)
    assert site_of(d, "step", "layer", "position") == (0, first_reusing, T - 1)


def test_bad_value_is_one_line_exit_2(tmp_path):
    res = invoke("record", *PROMPT, "-o", tmp_path / "x.h5", "--shared-kv-prefill", "first")
    one_line_error(res, "'first' is not one of", out=tmp_path / "x.h5")


def test_image_prompt_and_a_model_without_sharing(tmp_path):
    """An image + text prompt (bidirectional image blocks) replays and diffs clean; a model whose
    layers all own their K/V has nothing to leave out."""
    from PIL import Image

    from tests.support import tiny_models

    img = tmp_path / "i.png"
    Image.new("RGB", (40, 30), (200, 30, 90)).save(img)
    ref, out = tmp_path / "img.h5", tmp_path / "img_run.h5"
    res = invoke(
        "record",
        "--prompt",
        "What is this?",
        "--image",
        img,
        "--max-new-tokens",
        3,
        "-o",
        ref,
        "--shared-kv-prefill",
        "last",
    )
    assert res.exit_code == 0, res.output
    assert invoke("replay", ref, "-o", out).exit_code == 0
    res = invoke("diff", ref, out)
    assert res.exit_code == 0 and "not compared" in res.output, res.output

    model = tiny_models.build(tmp_path / "model", "no_sharing")
    plain = tmp_path / "plain.h5"
    res = invoke("record", "--model", model, *PROMPT, "-o", plain, "--shared-kv-prefill", "last")
    assert res.exit_code == 0, res.output
    with TraceReader(plain) as r:
        assert "last row" not in r.provenance["runtime"]
        assert all(r.rows_present(k, l) is None for k, l in r.kinds_present() if k != "token")


def test_one_token_prompt_has_nothing_to_leave_out(tmp_path):
    out = tmp_path / "one.h5"
    res = invoke("record", "--input-ids", "2", "--max-new-tokens", 2, "-o", out, "--shared-kv-prefill", "last")
    assert res.exit_code == 0, res.output
    with TraceReader(out) as r:
        assert "last row" not in r.provenance["runtime"]
        assert all(r.rows_present(k, l) is None for k, l in r.kinds_present() if k != "token")
