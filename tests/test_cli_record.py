"""`trace record` and `trace show` from the command line: bad input gives exit 2 and one line."""

import json
import signal
import subprocess
import sys
import time

import pytest

from gemma4_trace.traces import TraceReader
from tests.support import tiny_models
from tests.support.cli import invoke, one_line_error

pytestmark = pytest.mark.slow  # records interrupted by signals in subprocesses; make test-fast skips it


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("m") / "model", "base")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """Room for a run far longer than the test lasts (record refuses more positions than the model has)."""
    return tiny_models.build(tmp_path_factory.mktemp("m") / "model", "base", max_position_embeddings=1 << 20)


def test_record_and_show(text_model, tmp_path):
    out = tmp_path / "t.h5"
    res = invoke("record", "--model", text_model, "--input-ids", "2,17,33", "--max-new-tokens", 5, "-o", out)
    assert res.exit_code == 0, res.output
    assert "3 prompt tokens, 5 generated" in res.output
    res = invoke("show", out)
    assert res.exit_code == 0 and "steps      5 (prefill + 4 decode)" in res.output
    assert "reuses layer 2" in res.output
    res = invoke("show", "--hash", out)
    with TraceReader(out) as r:
        assert res.output.strip() == r.content_hash()
        assert list(r.prompt_ids) == [2, 17, 33]


def test_missing_model_folder(tmp_path):
    out = tmp_path / "t.h5"
    one_line_error(
        invoke("record", "--model", tmp_path / "nope", "--input-ids", "2,3", "-o", out), "does not exist", out=out
    )


def test_not_gemma4(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = tmp_path / "t.h5"
    one_line_error(invoke("record", "--model", d, "--input-ids", "2,3", "-o", out), "not Gemma 4", out=out)


def test_folder_without_weights(tmp_path, text_model):
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((text_model / "config.json").read_text())
    out = tmp_path / "t.h5"
    one_line_error(invoke("record", "--model", d, "--input-ids", "2,3", "-o", out), "safetensors", out=out)


def test_prompt_without_tokenizer(text_model, tmp_path):
    out = tmp_path / "t.h5"
    one_line_error(invoke("record", "--model", text_model, "--prompt", "hi", "-o", out), "no tokenizer", out=out)


def test_image_for_text_only_model(text_model, tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "i.png")
    out = tmp_path / "t.h5"
    res = invoke("record", "--model", text_model, "--prompt", "hi", "--image", tmp_path / "i.png", "-o", out)
    one_line_error(res, "text-only model", out=out)


def test_unreadable_image(text_model, tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not an image")
    out = tmp_path / "t.h5"
    res = invoke("record", "--model", text_model, "--prompt", "hi", "--image", tmp_path / "bad.png", "-o", out)
    one_line_error(res, "not a readable image", out=out)
    res = invoke("record", "--model", text_model, "--prompt", "hi", "--image", tmp_path / "missing.png", "-o", out)
    one_line_error(res, "does not exist", out=out)


def test_bad_ids_and_options(text_model, tmp_path):
    out = tmp_path / "t.h5"
    one_line_error(invoke("record", "--model", text_model, "--input-ids", "2,x", "-o", out), "comma-separated", out=out)
    one_line_error(
        invoke("record", "--model", text_model, "--input-ids", "2,99999", "-o", out), "outside the vocabulary", out=out
    )
    one_line_error(invoke("record", "--model", text_model, "-o", out), "give the prompt", out=out)
    one_line_error(
        invoke("record", "--model", text_model, "--prompt", "a", "--input-ids", "2", "-o", out),
        "exactly one of",
        out=out,
    )
    one_line_error(
        invoke("record", "--model", text_model, "--input-ids", "2", "--max-new-tokens", 0, "-o", out),
        "max-new-tokens",
        out=out,
    )


def test_existing_output_and_failed_force_keep_old_file(text_model, tmp_path):
    out = tmp_path / "t.h5"
    assert (
        invoke("record", "--model", text_model, "--input-ids", "2,17", "--max-new-tokens", 2, "-o", out).exit_code == 0
    )
    before = out.read_bytes()
    one_line_error(invoke("record", "--model", text_model, "--input-ids", "2,17", "-o", out), "already exists")
    res = invoke("record", "--model", text_model, "--input-ids", "2,99999", "--force", "-o", out)
    one_line_error(res, "outside the vocabulary")
    assert out.read_bytes() == before


def test_unwritable_output_folder(text_model, tmp_path):
    one_line_error(
        invoke("record", "--model", text_model, "--input-ids", "2", "-o", tmp_path / "no" / "t.h5"), "does not exist"
    )
    one_line_error(invoke("record", "--model", text_model, "--input-ids", "2", "-o", "/proc/t.h5"), "output folder")


def test_show_bad_files(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"garbage")
    one_line_error(invoke("show", tmp_path / "x.h5"), "not a readable HDF5")
    one_line_error(invoke("show", tmp_path / "none.h5"), "no such file")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_record_leaves_nothing(long_model, tmp_path, sig):
    out = tmp_path / "t.h5"
    cmd = [
        sys.executable,
        "-m",
        "gemma4_trace",
        "record",
        "--model",
        str(long_model),
        "--input-ids",
        "2,17",
        "--max-new-tokens",
        "100000",
        "-o",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not any(p.name.startswith(".trace-partial") for p in tmp_path.iterdir()):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the decode loop
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not out.exists()
    if sig == signal.SIGKILL:
        # a killed run cannot clean up; its clearly named partial file goes at the next run
        assert [p for p in tmp_path.iterdir() if p.name.startswith(".trace-partial")]
        assert (
            invoke("record", "--model", long_model, "--input-ids", "2", "--max-new-tokens", 1, "-o", out).exit_code == 0
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]
    else:
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written", err
        assert "Traceback" not in err
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("force", [False, True])
def test_two_runs_writing_one_path_leave_one_complete_trace(text_model, tmp_path, force):
    out = tmp_path / "t.h5"
    cmd = [
        sys.executable,
        "-m",
        "gemma4_trace",
        "record",
        "--model",
        str(text_model),
        "--max-new-tokens",
        "40",
        "-o",
        str(out),
    ] + (["--force"] if force else [])
    procs = [
        subprocess.Popen(cmd + ["--input-ids", ids], stderr=subprocess.PIPE, text=True) for ids in ("2,17", "2,18")
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == ([0, 0] if force else [0, 2]), results
    if not force:
        assert any("already exists" in err for code, err in results if code == 2)
    with TraceReader(out) as r:  # one whole trace from one of the runs, readable end to end
        assert list(r.prompt_ids) in ([2, 17], [2, 18])
        assert r.n_steps == 40 and r.content_hash()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]


@pytest.mark.parametrize(
    "variant,multimodal", [("no_sharing", False), ("full_first", False), ("k_eq_v", True), ("moe", True)]
)
def test_record_input_ids_on_any_checkpoint(tmp_path, variant, multimodal):
    model = tiny_models.build(tmp_path / "m", variant, multimodal=multimodal)
    out = tmp_path / "y.h5"
    res = invoke("record", "--model", model, "--input-ids", "2,17,33", "--max-new-tokens", 12, "-o", out)
    assert res.exit_code == 0, res.output
    with TraceReader(out) as r:
        # 12 steps, or fewer when the model chose an EOS id
        assert r.n_steps == 12 or (r.n_steps < 12 and int(r.tokens()[-1]) in r.eos_token_ids)
        assert r.n_positions == 3 + r.n_steps - 1
        owners = [i for i, li in enumerate(r.layers) if li.kv_role != "reuses"]
        assert all(r.read("k", i).shape[0] == r.n_positions for i in owners)
        assert r.read("layer_out", len(r.layers) - 1).shape == (r.n_positions, 32)
