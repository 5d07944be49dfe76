"""`trace sweep` over a GGUF port: the user's own file (`--gguf FILE`), and `--baseline-runtime auto`
(the static runtime on the file's dequantized weights, as `trace replay --weights-from` makes BASE),
on the embedded model. REF stays HF's: the dequantized weights go into a second copy of the model."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")

from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

pytestmark = pytest.mark.slow  # converts a GGUF and runs llama.cpp per prompt; make test-fast skips it

PROMPTS = '{"id": "a", "input_ids": [2, 100, 101, 102]}\n{"id": "b", "input_ids": [2, 300, 301, 302, 303, 304]}\n'


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep-gguf")
    env = {"GEMMA4_TRACE_CACHE": str(d / "cache")}
    (d / "p.jsonl").write_text(PROMPTS)
    r = invoke("export-gguf", "--type", "Q8_0", "-o", d / "user-q8.gguf", env=env)
    assert r.exit_code == 0, r.output
    return d, env


def test_a_users_gguf_swept_and_judged_by_its_dequantized_weights(lab):
    d, env = lab
    out = d / "s"
    args = ["sweep", d / "p.jsonl", "--gguf", d / "user-q8.gguf", "--baseline-runtime", "auto"]
    r = invoke(*args, "--max-new-tokens", 2, "--tolerances", "llamacpp-f32", "--keep-traces", "-o", out, env=env)
    assert r.exit_code in (0, 1), r.output
    summary = json.loads((out / "summary.json").read_text())
    settings = summary["settings"]
    assert settings["runtime"] == "llama.cpp --gguf user-q8.gguf" and len(settings["gguf_sha256"]) == 64
    assert settings["baseline_runtime"] == "static --weights-from user-q8.gguf"
    assert summary["prompts"] == 2 and summary["base"]["positions"] > 0
    for pid in ("a", "b"):
        with (
            TraceReader(out / "prompts" / f"{pid}.run.h5") as run,
            TraceReader(out / "prompts" / f"{pid}.base.h5") as b,
        ):
            assert run.provenance["runtime"].startswith("llama.cpp:user-q8.gguf (Q8_0)")
            assert "weights from user-q8.gguf, Q8_0, dequantized" in b.provenance["runtime"]
    # REF is HF's own recording for every prompt, the second one too (recorded after BASE's weights loaded)
    fresh = d / "fresh-b.h5"
    assert invoke("record", "--input-ids", "2,300,301,302,303,304", "--max-new-tokens", 2, "-o", fresh).exit_code == 0
    with TraceReader(out / "prompts" / "b.ref.h5") as kept, TraceReader(fresh) as again:
        np.testing.assert_array_equal(kept.dataset("logits", None)[()], again.dataset("logits", None)[()])
    # the same verdict `trace diff --baseline` gives on the kept traces
    p = out / "prompts"
    diff = invoke("diff", p / "a.ref.h5", p / "a.run.h5", "--baseline", p / "a.base.h5", "--tolerances", "llamacpp-f32")
    rec = json.loads((p / "a.json").read_text())
    assert (diff.exit_code == 0) == rec["match"], diff.output


def test_baseline_auto_for_a_llamacpp_type_uses_the_projects_conversion(lab):
    d, env = lab
    out = d / "t"
    args = ["sweep", d / "p.jsonl", "--runtime", "llama.cpp:Q8_0", "--baseline-runtime", "auto", "-o", out]
    r = invoke(*args, "--max-new-tokens", 2, "--tolerances", "llamacpp-f32", env=env)
    assert r.exit_code in (0, 1), r.output
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert settings["baseline_runtime"] == "static --weights-from the Q8_0 conversion"
    assert "judged against baseline static --weights-from the Q8_0 conversion" in r.stdout


def test_gguf_sweep_refusals_are_one_line(lab, tmp_path):
    d, env = lab
    p = d / "p.jsonl"
    one_line_error(
        invoke("sweep", p, "--runtime", "static-w8", "--baseline-runtime", "auto", "-o", tmp_path / "o"),
        "static-w8 has no baseline of its own",
    )
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    one_line_error(invoke("sweep", p, "--gguf", tmp_path / "bad.gguf", "-o", tmp_path / "o"), "bad.gguf")
    one_line_error(invoke("sweep", p, "--gguf", d / "user-q8.gguf", "--runtime", "mlx", "-o", tmp_path / "o"), "--gguf")
    one_line_error(invoke("sweep", p, "-o", tmp_path / "o"), "--runtime", "--gguf")
    assert not (tmp_path / "o").exists()
