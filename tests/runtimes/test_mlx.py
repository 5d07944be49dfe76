"""`--runtime mlx` and its quantized variants (REF's checkpoint loaded by mlx-lm, run through its own
Gemma 4 modules and caches on MLX's CPU backend, in the child; an image prompt's vision tower run by
mlx-vlm's own Gemma 4 vision model; extra gemma4-trace[mlx])."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[mlx]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes import mlx as M  # noqa: E402
from gemma4_trace.traces.errors import TraceToolError  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import float_differences, invoke, one_line_error, without_progress  # noqa: E402

pytestmark = pytest.mark.slow  # loads a second engine per replay; make test-fast skips it

MODES = ("mlx", "mlx-q8", "mlx-q8-dq", "mlx-q4", "mlx-q4-dq")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlx")
    out = {"ref": golden_path("window"), "dir": d}  # 24 steps: past the sliding window (mlx-lm's ring buffer)
    M._SAID.clear()  # the loading line is said once per process: as in a process of its own
    for mode in MODES:
        out[mode] = d / f"{mode}.h5"
        r = invoke("replay", out["ref"], "--runtime", mode, "-o", out[mode])
        assert r.exit_code == 0, r.output
        out[mode + ":run"] = r
    r = invoke("replay", out["ref"], "--runtime", "mlx", "--free-running", "-o", d / "free.h5")
    assert r.exit_code == 0, r.output
    out["free"] = d / "free.h5"
    return out


def test_float_replay_matches_hf_with_every_kind_mlx_lm_exposes(runs):
    ref, run = runs["ref"], runs["mlx"]
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    r = runs["mlx:run"]
    assert "24/24 tokens agree" in r.stdout
    # the two config fixes, said once each on stderr and kept in the provenance
    said = [ln for ln in r.stderr.splitlines() if "config.json fixed for mlx-lm" in ln]
    assert len(said) == 1, r.stderr
    assert "top-level vocab_size set to text_config's 680" in said[0]
    assert "global_head_dim set to the full layers' head_dim 32" in said[0]
    with TraceReader(ref) as a, TraceReader(run) as b:
        runtime = b.provenance["runtime"]
        assert runtime.startswith("mlx (mlx 0.32.4, mlx-lm 0.32.2, CPU; float32; config fixed: ")
        worst, differ = float_differences(a, b)
        # MLX's CPU kernels are not torch's: real, float32-sized differences in most tensors
        assert differ >= 10 and 1e-8 < worst < 1e-5, (differ, worst)


def test_free_running_generates_the_reference_tokens(runs):
    with TraceReader(runs["ref"]) as a, TraceReader(runs["free"]) as b:
        assert b.mode == "free-running"
        assert list(b.tokens()) == list(a.tokens())


def test_quantized_replays_diverge_from_hf_and_stay_within_their_baseline(runs):
    ref = runs["ref"]
    for bits in (8, 4):
        mode = f"mlx-q{bits}"
        with TraceReader(runs[mode]) as b, TraceReader(runs[mode + "-dq"]) as c:
            assert f"{bits}-bit affine, group size 64;" in b.provenance["runtime"]
            assert "dequantized into float32 weights" in c.provenance["runtime"]
            assert "layers quantized, 8 kept float" in b.provenance["runtime"]  # 8-wide inputs stay float
        first = diff_traces(ref, runs[mode]).to_json()["first_divergence"]
        assert first is not None and first["kind"] == "embeddings", (mode, first)  # the quantized table
        res = diff_traces(ref, runs[mode], baseline_path=runs[mode + "-dq"])
        assert res.match, (mode, res.to_json()["first_divergence"])
        # the quantized kernels against the same weights in float kernels: rounding-sized
        res = diff_traces(runs[mode + "-dq"], runs[mode])
        assert res.match, (mode, res.to_json()["first_divergence"])


def test_the_config_fixes_and_what_no_fix_can_make_readable():
    cfg = json.loads((golden_path("short").parents[2] / "hf/tiny_model/config.json").read_text())
    fixed, fixes = M.fixed_config(cfg)
    assert fixed["vocab_size"] == 680 and fixed["text_config"]["global_head_dim"] == 32 and len(fixes) == 2
    assert cfg.get("vocab_size") is None  # the original is not touched
    again, none = M.fixed_config(fixed)
    assert again == fixed and none == []
    bad = json.loads(json.dumps(cfg))
    bad["text_config"]["per_layer_config"]["0"] = {"head_dim": 32}  # layer 0 is sliding
    with pytest.raises(TraceToolError, match="overrides a sliding layer"):
        M.fixed_config(bad)


def test_refusals_come_before_any_model_loads(tmp_path, monkeypatch):
    out = tmp_path / "o.h5"
    r = invoke("replay", golden_path("short"), "--runtime", "mlx-q4", "--isolate", "-o", out)
    one_line_error(r, "does not support --isolate", out=out)
    import shutil

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "g++" else real(name, *a, **k))
    monkeypatch.setattr("gemma4_trace.hf.model.load_model", _no_model_load)
    r = invoke("replay", golden_path("short"), "--runtime", "mlx", "-o", out)
    one_line_error(r, "--runtime mlx needs g++, which is not on PATH", "apt install g++", out=out)


def _no_model_load(*a, **k):
    raise AssertionError("the model was loaded before the refusal")


def test_a_crash_in_mlx_is_one_line_and_leaves_no_trace(tmp_path, monkeypatch):
    monkeypatch.setattr("gemma4_trace.replayer.runtimes.mlx._SAID", set())  # as in a process of its own
    out = tmp_path / "crash.h5"
    crash = {"GEMMA4_TRACE_TEST_NATIVE_CRASH": "attn_out@3"}
    r = invoke("replay", golden_path("short"), "--runtime", "mlx", "-o", out, env=crash)
    # the loading line (what was fixed), then the one error line
    loading, error = without_progress(r.stderr.splitlines())[-2:]
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
    assert loading.startswith("mlx: loading with mlx-lm"), r.stderr
    assert error.startswith("error: mlx (mlx 0.32.4, mlx-lm 0.32.2) crashed in prefill after layer 3 attn_out: ")
    assert "SIGABRT" in error, error


def test_mlx_lm_still_misreads_the_two_config_fields(tmp_path):
    """docs/upstream/mlx-lm-gemma4-config.md: the unpatched checkpoint fails on the vocabulary,
    with vocab_size patched on the full layers' head_dim; both patched, it loads."""
    import shutil
    import subprocess
    import sys

    from gemma4_trace.hf.model import resolve_model_dir

    embedded = resolve_model_dir(None)[0]
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(embedded / name, tmp_path / name)
    code = """
import sys
from pathlib import Path
from mlx_lm.utils import load_model
try:
    load_model(Path(sys.argv[1]))
    print("loaded")
except ValueError as e:
    print(e)
"""

    def load():
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
        return r.stdout.strip().splitlines()[-1]

    cfg = json.loads((embedded / "config.json").read_text())
    assert load() == (
        "Expected shape (262144, 64) but received shape (680, 64) for parameter "
        "language_model.model.embed_tokens.weight"
    )
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 680}))
    assert load().startswith("Expected shape (2048, 64) but received shape (128, 64) for parameter ")
    (tmp_path / "config.json").write_text(json.dumps(M.fixed_config(cfg)[0]))
    assert load() == "loaded"


def test_the_loading_line_and_the_config_fixes_are_said_once_per_process(tmp_path, monkeypatch):
    """A sweep loads the runtime for every prompt: the loading line, with what was fixed in
    config.json, is written the first time only."""
    monkeypatch.setattr("gemma4_trace.replayer.runtimes.mlx._SAID", set())
    first = invoke("replay", golden_path("short"), "--runtime", "mlx", "-o", tmp_path / "a.h5")
    again = invoke("replay", golden_path("short"), "--runtime", "mlx", "-o", tmp_path / "b.h5")
    assert first.exit_code == 0 and again.exit_code == 0, (first.output, again.output)
    assert first.stderr.count("mlx: loading with mlx-lm") == 1 and "config.json fixed for mlx-lm" in first.stderr
    assert "loading with mlx-lm" not in again.stderr and "config.json fixed" not in again.stderr, again.stderr
    with TraceReader(tmp_path / "b.h5") as t:  # the trace still says what was fixed
        assert "config fixed:" in t.provenance["runtime"]


# ------------------------------------------------------------------ image prompts: mlx-vlm's vision tower
IMAGE_MODES = ("mlx", "mlx-q4", "mlx-q4-dq")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """The two image goldens replayed by --runtime mlx (the first also by mlx-q4 and its baseline)."""
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[mlx]')")
    d = tmp_path_factory.mktemp("mlx-images")
    M._SAID.clear()  # as in a process of its own: the lines said once are said
    out = {}
    for name, modes in (("image", IMAGE_MODES), ("two_images", ("mlx",))):
        for mode in modes:
            run = d / f"{name}-{mode}.h5"
            r = invoke("replay", golden_path(name), "--runtime", mode, "-o", run)
            assert r.exit_code == 0, r.output
            out[name, mode], out[name, mode, "run"] = run, r
    return out


def _vision_rel_l2(ref, run) -> dict:
    """{(kind, layer): rel-L2 of RUN's tensor against REF's} over the vision tower's sites (every one
    REF has must be in RUN, of the same shape: the real patches' rows, image after image)."""
    import numpy as np

    with TraceReader(ref) as a, TraceReader(run) as b:
        want = sorted((k, n) for k, n in a.kinds_present() if k.startswith("vision."))
        got = sorted((k, n) for k, n in b.kinds_present() if k.startswith("vision."))
        assert got == want and len(want) == 15, (got, want)  # 2 layers x 6 kinds + patches, pooled, soft
        out = {}
        for kind, layer in want:
            x, y = a.read(kind, layer).astype(np.float64), b.read(kind, layer).astype(np.float64)
            assert x.shape == y.shape, (kind, layer, x.shape, y.shape)
            out[kind, layer] = float(np.linalg.norm(x - y) / np.linalg.norm(x))
        return out


@pytest.mark.parametrize("name", ["image", "two_images"])
def test_image_prompts_run_mlx_vlms_vision_tower_and_match_hf_at_every_vision_site(images, name):
    ref, run = golden_path(name), images[name, "mlx"]
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    rel = _vision_rel_l2(ref, run)
    # MLX's own kernels, not a copy of HF's tensors: every site differs, by float32's rounding
    assert all(1e-9 < r < 1e-6 for r in rel.values()), rel
    with TraceReader(run) as t:
        assert "; vision tower: mlx-vlm 0.7.10, float32; config fixed: " in t.provenance["runtime"]
        rows = {k: len(t.read(k, None)) for k in ("vision.patch_embeddings", "vision.soft_tokens")}
    # the real patches only (image: 256 of a 280-patch budget; two_images: 256 + 280), and their pooled tokens
    assert rows == (
        {"vision.patch_embeddings": 256, "vision.soft_tokens": 64}
        if name == "image"
        else {"vision.patch_embeddings": 536, "vision.soft_tokens": 134}
    ), rows
    r = images[name, "mlx", "run"]
    assert "11/11 tokens agree" in r.stdout or "8/8 tokens agree" in r.stdout, r.stdout
    if name == "image":  # said once per process, openly: mlx-vlm reads the same fixed config.json
        said = [ln for ln in r.stderr.splitlines() if "vision tower: mlx-vlm's Gemma 4" in ln]
        assert len(said) == 1 and "without global_head_dim it refuses the checkpoint" in said[0], r.stderr


def test_a_quantized_text_model_takes_the_float_vision_tower_and_stays_within_its_baseline(images):
    ref, q4, dq = golden_path("image"), images["image", "mlx-q4"], images["image", "mlx-q4-dq"]
    first = diff_traces(ref, q4).to_json()["first_divergence"]
    assert first is not None and first["kind"] == "embeddings", first  # the quantized table, not the tower
    assert diff_traces(ref, q4, baseline_path=dq).match
    # mlx-lm quantizes the text model only: the vision tower is mlx-vlm's float32 one in all three runs
    assert _vision_rel_l2(images["image", "mlx"], q4) == _vision_rel_l2(images["image", "mlx"], dq)
    assert set(_vision_rel_l2(images["image", "mlx"], q4).values()) == {0.0}


def test_without_hfs_image_mask_mlx_lm_diverges_at_the_first_image_token(tmp_path, monkeypatch):
    """The text model attends within an image both ways on sliding layers (use_bidirectional_attention
    "vision"); mlx-lm builds causal masks only, so the replay hands it HF's for the prefill. With
    mlx-lm's own masks the diff finds it: layer 0 (sliding), attn_out, at the first image token."""
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[mlx]')")
    import numpy as np

    no_block = lambda types: np.full(types.size, -1)  # noqa: E731 - no image block: causal
    monkeypatch.setattr("gemma4_trace.replayer.ops.image_blocks", no_block)
    out = tmp_path / "causal.h5"
    r = invoke("replay", golden_path("image"), "--runtime", "mlx", "--kinds", "attn_out,layer_out", "-o", out)
    assert r.exit_code == 0, r.output
    first = diff_traces(golden_path("image"), out).to_json()["first_divergence"]
    assert (first["step"], first["layer"], first["kind"], first["position"]) == (0, 0, "attn_out", 4), first
    with TraceReader(golden_path("image")) as t:
        assert int(t.prompt_ids[4]) == t.model_config["image_token_id"] != int(t.prompt_ids[3])


def test_kinds_narrow_what_is_tapped_in_both_towers(tmp_path):
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[mlx]')")
    out = tmp_path / "some.h5"
    kinds = "vision.q,vision.soft_tokens,layer_out"
    r = invoke("replay", golden_path("image"), "--runtime", "mlx", "--kinds", kinds, "-o", out)
    assert r.exit_code == 0, r.output
    with TraceReader(out) as t:
        assert {k for k, _ in t.kinds_present()} == {"vision.q", "vision.soft_tokens", "layer_out", "logits", "token"}
        assert {n for k, n in t.kinds_present() if k == "vision.q"} == {0, 1}
    assert diff_traces(golden_path("image"), out).match


def test_an_image_prompt_without_mlx_vlm_is_one_line_before_anything_loads(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlx_vlm" else real(name, *a))
    monkeypatch.setattr("gemma4_trace.hf.model.load_model", _no_model_load)
    out = tmp_path / "o.h5"
    r = invoke("replay", golden_path("image"), "--runtime", "mlx-q8", "-o", out)
    one_line_error(
        r, "--runtime mlx-q8 runs an image prompt's vision tower with mlx_vlm, which is not installed", out=out
    )
    assert "pip install -e '.[mlx]'" in r.stderr


def test_mlx_vlm_still_misreads_global_head_dim(tmp_path):
    """docs/upstream/mlx-lm-gemma4-config.md, "mlx-vlm 0.7.10 reads global_head_dim the same way":
    the unpatched checkpoint fails on the full layers' head_dim (the vocabulary it reads right); with
    global_head_dim set, it loads."""
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[mlx]')")
    import shutil
    import subprocess
    import sys

    from gemma4_trace.hf.model import resolve_model_dir

    embedded = resolve_model_dir(None)[0]
    cfg = json.loads((embedded / "config.json").read_text())
    fixed = json.loads(json.dumps(cfg))
    fixed["text_config"]["global_head_dim"] = 32  # that fix alone
    for name, config in (("plain", cfg), ("fixed", fixed)):
        (tmp_path / name).mkdir()
        shutil.copyfile(embedded / "model.safetensors", tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    code = """
import sys
from pathlib import Path
from mlx_vlm.utils import load_model
for folder in sys.argv[1:]:
    try:
        load_model(Path(folder), lazy=True)
        print("loaded")
    except ValueError as e:
        print(e)
"""
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "plain"), str(tmp_path / "fixed")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.stdout.strip().splitlines()[-2:] == [
        "Expected shape (2048, 64) but received shape (128, 64) for parameter "
        "language_model.model.layers.2.self_attn.q_proj.weight",
        "loaded",
    ], r.stdout + r.stderr
