"""`trace repro`: one layer at one step, recomputed by a repro.py that needs only numpy and torch.

repro.py runs in a subprocess with `python -S` (no site: the project's editable install is
not on the path), PYTHONPATH = the folder torch and numpy live in, cwd = the repro folder,
so it cannot import this project. Its own check (exit 0: recompute vs REF within 1e-5) is
re-checked here from the .npz files.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gemma4_trace.analysis.repro import write_repro
from gemma4_trace.recorder.golden import GOLDEN_DIR
from gemma4_trace.replayer.replay import replay_trace
from tests.support.cli import invoke, one_line_error

REF = GOLDEN_DIR / "window.h5"  # prompt 13 > sliding window 8; decode to position 35
SITE_PACKAGES = str(Path(torch.__file__).resolve().parents[1])
HOSTILE = "x'''\"\"\"\nimport os; os._exit(7) # \\"


def run_repro(folder: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": SITE_PACKAGES}
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import importlib.util as u; print(u.find_spec('gemma4_trace'))"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "None", "the project must not be importable where repro.py runs"
    return subprocess.run(
        [sys.executable, "-S", "repro.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# every layer type of the embedded model (all layers have a per-layer input): sliding and full
# layers that store K/V, sliding and full KV-sharing readers; prefill and decode steps
SITES = [
    (0, 0, "sliding_attention", "owns"),
    (20, 1, "sliding_attention", "owns"),
    (0, 2, "full_attention", "owns"),
    (9, 4, "full_attention", "stores"),
    (17, 6, "sliding_attention", "reuses"),
    (0, 7, "full_attention", "reuses"),
]


@pytest.mark.parametrize("step,layer,layer_type,role", SITES)
def test_repro_recomputes_refs_layer_without_the_project(tmp_path, step, layer, layer_type, role):
    out = tmp_path / "repro"
    line = write_repro(REF, REF, out, at=(step, layer))
    size = int(re.search(r"(\d+) bytes", line)[1])
    assert size == sum(f.stat().st_size for f in out.iterdir())
    assert size < 400_000  # one layer's worth (the whole embedded model's weights are several MB)
    with np.load(out / "weights.npz") as w:
        assert "q_proj" in w.files and "ple_gate" in w.files
        assert ("k_proj" in w.files) == (role != "reuses")  # a reader has no K/V weights of its own
    with np.load(out / "inputs.npz") as z:
        assert z["hidden"].shape[0] == (13 if step == 0 else 1)
        assert z["k_rows"].shape[0] == (13 if step == 0 else 13 + step)
    p = run_repro(out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"layer {layer} ({layer_type}, {role})" in p.stdout
    got = float(re.search(r"vs REF \(.*?\) layer_out: rel-L2 (\S+)", p.stdout)[1])
    assert got < 1e-5


def test_repro_fails_when_ref_output_is_not_reproduced(tmp_path):
    """The exit code is a real check: REF's recorded output nudged by 1e-3 -> exit 1."""
    out = tmp_path / "r"
    write_repro(REF, REF, out, at=(3, 5))
    with np.load(out / "outputs.npz") as z:
        outs = {k: z[k] for k in z.files}
    outs["ref_layer_out"] = outs["ref_layer_out"] * (1 + 1e-3)
    np.savez(out / "outputs.npz", **outs)
    p = run_repro(out)
    assert p.returncode == 1 and "does NOT match REF" in p.stdout


def make_hostile_name_window_bug(loaded, max_seq):
    from tests.support.bug_zoo import WindowOffByOne

    rt = WindowOffByOne(loaded, max_seq)
    rt.name = HOSTILE
    return rt


def test_cli_repro_at_first_divergence_of_a_zoo_bug(tmp_path):
    """A sliding window off by one (float, bug zoo): the first divergence is layer 0's mask in
    prefill; the repro reproduces REF there and shows RUN's error. RUN's runtime name (a
    plug-in's choice, here with quotes, a newline and code) reaches repro.py only as data."""
    run = tmp_path / "run.h5"
    replay_trace(REF, run, runtime="tests.test_repro:make_hostile_name_window_bug")
    out = tmp_path / "repro"
    res = invoke("repro", str(REF), str(run), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "layer 0 (sliding_attention, owns, PLE) at step 0" in res.output
    p = run_repro(out)
    assert p.returncode == 0, p.stdout + p.stderr
    with np.load(out / "outputs.npz") as z:
        run_err = rel_l2(z["run_layer_out"], z["ref_layer_out"])
    assert run_err > 1e-2  # the bug is visible in the one layer
    printed = float(re.search(r"RUN vs REF layer_out: rel-L2 (\S+)", p.stdout)[1])
    assert printed == pytest.approx(run_err, rel=1e-3)
    assert "os._exit(7)" in p.stdout  # the name was printed as text, never executed
    # an existing repro is not replaced without --force
    again = invoke("repro", str(REF), str(run), "-o", str(out))
    assert again.exit_code == 2 and "--force" in again.output


def test_cli_repro_follows_a_baseline_and_reports_runs_excess_over_it(tmp_path):
    """A quantized RUN with a planted bug (layer LOW_LAYER at int4 in static-w8) against plain static-w8
    as BASE: without --baseline the first divergence is quantization noise before the layers (no
    repro there); with it, the site is the bug's layer, BASE's layer_out is written beside RUN's,
    and repro.py prints RUN's excess over BASE, as the .npz files give it."""
    pytest.importorskip("torchao")
    from tests.support.quant_bugs import LOW_LAYER

    base, run = tmp_path / "base.h5", tmp_path / "run.h5"
    replay_trace(REF, base, runtime="static-w8")
    replay_trace(REF, run, runtime="tests.support.quant_bugs:make_low_precision_layer__static_w8")
    plain = tmp_path / "plain"  # without --baseline: the quantization noise of the per-layer inputs is the site
    res = invoke("repro", str(REF), str(run), "-o", str(plain))
    assert res.exit_code == 0 and "per_layer_inputs at step 0" in res.output, res.output
    p = run_repro(plain)
    assert p.returncode == 0, p.stdout + p.stderr
    with np.load(plain / "outputs.npz") as z:
        ple_err = rel_l2(z["run_per_layer_inputs"], z["ref_per_layer_inputs"])
    assert float(re.search(r"RUN vs REF per_layer_inputs: rel-L2 (\S+)", p.stdout)[1]) == pytest.approx(ple_err, 1e-3)
    recompute = float(re.search(r"float recompute vs REF \(.*\) per_layer_inputs: rel-L2 (\S+)", p.stdout)[1])
    assert recompute < 1e-5 < ple_err
    out = tmp_path / "repro"
    res = invoke("repro", str(REF), str(run), "--baseline", str(base), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert f"layer {LOW_LAYER} (" in res.output
    p = run_repro(out)
    assert p.returncode == 0, p.stdout + p.stderr  # the float recompute still reproduces REF
    with np.load(out / "outputs.npz") as z:
        run_err = rel_l2(z["run_layer_out"], z["ref_layer_out"])
        base_err = rel_l2(z["base_layer_out"], z["ref_layer_out"])
    excess = float(re.search(r"RUN's excess over BASE: x(\S+) ", p.stdout)[1])
    assert excess == pytest.approx(run_err / base_err, rel=1e-2) and excess > 4  # beyond the envelope's factor
    assert re.search(r"BASE \(static-w8\) vs REF layer_out: rel-L2 ", p.stdout), p.stdout
    one_line_error(invoke("repro", str(REF), str(run), "--baseline", str(base), "-o", str(base)), "base.h5")


@pytest.mark.parametrize("kind", ["embeddings", "per_layer_inputs"])
@pytest.mark.parametrize("step", [0, 5])
def test_repro_of_the_tensors_before_the_layers_recomputes_ref(tmp_path, kind, step):
    """--at STEP,embeddings / STEP,per_layer_inputs: the token ids fed at the step (the prompt's, or
    REF's previous token in decode), their table rows, and the recompute within 1e-5 of REF."""
    run = tmp_path / "run.h5"
    replay_trace(REF, run, runtime="static")
    out = tmp_path / "repro"
    res = invoke("repro", str(REF), str(run), "--at", f"{step},{kind}", "-o", str(out))
    assert res.exit_code == 0 and f"{kind} at step {step}" in res.output, res.output
    p = run_repro(out)
    assert p.returncode == 0 and "recompute matches REF" in p.stdout, p.stdout + p.stderr
    # the last line says what exit 0 judges; the script carries no note about how it was written
    assert p.stdout.splitlines()[-1] == "recompute matches REF (exit 0): RUN's error above is RUN's own"
    source = (out / "repro.py").read_text()
    assert "__CONFIG__" not in source and "the writer" not in source
    with np.load(out / "inputs.npz") as z, np.load(out / "weights.npz") as w:
        ids, rows = z["token_ids"], w["embed_rows" if kind == "embeddings" else "ple_rows"]
    assert len(ids) == len(rows) == (13 if step == 0 else 1)
    one_line_error(invoke("repro", str(REF), str(run), "--at", f"{step},{kind}", "--onnx", "-o", str(tmp_path / "x")))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--at", "1;2"], "--at expects STEP,LAYER"),
        (["--at", "99,0"], "step 99 is outside"),
        (["--at", "0,8"], "layer 8 is outside"),
    ],
)
def test_cli_repro_refuses_bad_sites(tmp_path, args, message):
    res = invoke("repro", str(REF), str(REF), "-o", str(tmp_path / "r"), *args)
    assert res.exit_code == 2 and message in res.output
    assert not (tmp_path / "r").exists()


def test_cli_repro_of_a_match_asks_for_a_site(tmp_path):
    res = invoke("repro", str(REF), str(REF), "-o", str(tmp_path / "r"))
    assert res.exit_code == 2 and "no divergence" in res.output


# --onnx: a sliding layer in prefill, a full layer that stores K/V in decode, a KV-sharing
# (reusing) sliding layer in decode
ONNX_SITES = [(0, 0, "sliding_attention"), (9, 4, "full_attention"), (17, 6, "sliding_attention")]


@pytest.mark.parametrize("step,layer,layer_type", ONNX_SITES)
def test_repro_onnx_layer_matches_ref_in_onnxruntime(tmp_path, step, layer, layer_type):
    """layer.onnx, fed inputs.npz, gives REF's layer output in onnxruntime (rel-L2 < 1e-5),
    and repro.py (without the project) runs it and prints the same check."""
    ort = pytest.importorskip("onnxruntime")
    from gemma4_trace.analysis.repro import onnx_feeds

    out = tmp_path / "repro"
    res = invoke("repro", str(REF), str(REF), "--at", f"{step},{layer}", "--onnx", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "in 5 files" in res.output and (out / "layer.onnx").is_file()
    session = ort.InferenceSession(str(out / "layer.onnx"), providers=["CPUExecutionProvider"])
    with np.load(out / "inputs.npz") as z:
        inputs = {k: z[k] for k in z.files}
    feeds = onnx_feeds(inputs)
    assert sorted(i.name for i in session.get_inputs()) == sorted(feeds)
    got = session.run(["layer_out"], feeds)[0]
    with np.load(out / "outputs.npz") as z:
        err = rel_l2(got, z["ref_layer_out"])
    assert err < 1e-5
    p = run_repro(out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"layer {layer} ({layer_type}" in p.stdout
    printed = float(re.search(r"onnxruntime layer.onnx vs REF layer_out: rel-L2 (\S+)", p.stdout)[1])
    assert printed == pytest.approx(err, rel=1e-2, abs=1e-9)


def test_repro_onnx_refused_without_the_extra_and_stale_graph_removed(tmp_path, monkeypatch):
    out = tmp_path / "r"
    res = invoke("repro", str(REF), str(REF), "--at", "0,0", "-o", str(out))
    assert res.exit_code == 0 and not (out / "layer.onnx").exists()
    (out / "layer.onnx").write_bytes(b"stale")  # a graph of another site: --force without --onnx drops it
    assert invoke("repro", str(REF), str(REF), "--at", "3,5", "-o", str(out), "--force").exit_code == 0
    assert not (out / "layer.onnx").exists()
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript -> ImportError
    res = invoke("repro", str(REF), str(REF), "--at", "0,0", "--onnx", "-o", str(tmp_path / "n"))
    one_line_error(res, "trace repro --onnx needs onnx and onnxscript: install the extra [onnx]")
    assert not (tmp_path / "n").exists()
