"""`--runtime mlx*` on audio prompts: mlx-vlm's own Gemma 4 audio encoder and embed_audio
(replayer/runtimes/mlx_audio.py), loaded from the same fixed folder as mlx-lm's text model, fed REF's
log-mel features (HF's), every audio site tapped, the valid frames' soft tokens merged at the
audio-token slots of mlx-lm's text model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[mlx]')")
pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install -e '.[mlx]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes import mlx as M  # noqa: E402
from gemma4_trace.replayer.runtimes.registry import BY_NAME  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error, without_progress  # noqa: E402

pytestmark = pytest.mark.slow  # a second engine per replay (mlx-lm and mlx-vlm in the child)

AUDIO = [k.key for k in S.TOWER_BY_NAME["audio"].kinds]
# worst per-frame rel-L2 against HF on the audio golden (float32, MLX's CPU kernels): 5.8e-7
# (layer 0's lconv_out) .. 1.0e-6 (soft_tokens); the whole tensors 3.4e-7 .. 6.0e-7: about 5x allowed
PROFILE = 5e-6
CLIP = Path(__file__).resolve().parents[2] / "hf/tiny_audio_model/example.wav"  # the audio golden's clip


def _rows(x, y) -> np.ndarray:
    x, y = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
    return np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The audio golden replayed by mlx and mlx-q8 (and its baseline), and a two-clip REF (its first
    clip padded in the batch) by mlx."""
    d = tmp_path_factory.mktemp("mlx-audio")
    M._SAID.clear()  # as in a process of its own: the lines said once are said
    out = {}
    for mode in ("mlx", "mlx-q8", "mlx-q8-dq"):
        out[mode] = d / f"{mode}.h5"
        r = invoke("replay", golden_path("audio"), "--runtime", mode, "-o", out[mode])
        assert r.exit_code == 0, r.output
        out[mode, "run"] = r
    import soundfile

    wave, rate = soundfile.read(str(CLIP), dtype="float32")
    soundfile.write(str(d / "short.wav"), wave[: int(len(wave) * 0.6)], rate)
    ref = out["two"] = d / "two.h5"
    args = ("--audio", d / "short.wav", "--audio", CLIP, "--max-new-tokens", "3")
    r = invoke("record", *args, "--prompt", "Transcribe the audio.", "-o", ref)
    assert r.exit_code == 0, r.output
    r = invoke("replay", ref, "--runtime", "mlx", "-o", d / "two-mlx.h5")
    assert r.exit_code == 0, r.output
    out["two-mlx"] = d / "two-mlx.h5"
    return out


def test_the_audio_golden_replays_with_every_audio_site_within_the_measured_profile(runs):
    ref, run = golden_path("audio"), runs["mlx"]
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    declared = {r.kind for r in BY_NAME["mlx"].capture_map.rows if r.kind.startswith("audio.")}
    assert declared == set(AUDIO)
    with TraceReader(ref) as a, TraceReader(run) as b:
        assert "; audio tower: mlx-vlm 0.7.10, float32; config fixed: " in b.provenance["runtime"]
        sites = [(k, s.layer) for k in AUDIO for s in S.sites_of(k, a.towers["audio"].layers)]
        assert len(sites) == 13  # subsampled, 2 layers x 5 kinds, output_proj, soft_tokens
        for key, layer in sites:
            x, y = a.read(key, layer), b.read(key, layer)
            assert x.shape == y.shape == (77, *x.shape[1:]), (key, layer, y.shape)
            worst = float(_rows(x, y).max())
            assert 1e-9 < worst < PROFILE, (key, layer, worst)  # MLX's own kernels, near HF's
        assert list(b.tokens()) == list(a.tokens())
    r = runs["mlx", "run"]
    said = [ln for ln in r.stderr.splitlines() if "the clip's audio tower: mlx-vlm's Gemma 4" in ln]
    assert len(said) == 1 and "fed REF's log-mel features (HF's feature extractor's" in said[0], r.stderr
    assert "6/6 tokens agree" in r.stdout, r.stdout


def test_a_padded_clip_keeps_its_valid_frames_and_the_next_clip_its_own_slots(runs):
    """Two clips, the first padded in the batch: every audio site holds the valid frames, clip after
    clip (46 + 77), and the soft tokens land at their own clip's slots (the diff matches)."""
    res = diff_traces(runs["two"], runs["two-mlx"])
    assert res.match, res.to_json()["first_divergence"]
    with TraceReader(runs["two"]) as a, TraceReader(runs["two-mlx"]) as b:
        assert a.read("audio.soft_tokens", None).shape[0] == b.read("audio.soft_tokens", None).shape[0] == 46 + 77
        for key in AUDIO:
            for site in S.sites_of(key, 2):
                assert float(_rows(a.read(key, site.layer), b.read(key, site.layer)).max()) < PROFILE, (key, site)


def test_mlx_q8_quantizes_the_text_model_only_and_stays_within_its_baseline(runs):
    ref = golden_path("audio")
    first = diff_traces(ref, runs["mlx-q8"]).to_json()["first_divergence"]
    assert first is not None and first["kind"] == "embeddings", first  # the quantized table, not the tower
    assert diff_traces(ref, runs["mlx-q8"], baseline_path=runs["mlx-q8-dq"]).match
    with TraceReader(runs["mlx"]) as a, TraceReader(runs["mlx-q8"]) as b:
        for key in AUDIO:  # mlx-vlm's float32 tower in every mode: bit-identical audio sites
            for site in S.sites_of(key, 2):
                assert np.array_equal(a.read(key, site.layer), b.read(key, site.layer)), (key, site)


def test_kinds_narrow_what_is_tapped_in_the_audio_tower(tmp_path):
    out = tmp_path / "some.h5"
    r = invoke("replay", golden_path("audio"), "--runtime", "mlx", "--kinds", "audio.lconv_out,layer_out", "-o", out)
    assert r.exit_code == 0, r.output
    with TraceReader(out) as t:
        assert {k for k, _ in t.kinds_present()} == {"audio.lconv_out", "layer_out", "logits", "token"}
    assert diff_traces(golden_path("audio"), out).match


def test_a_checkpoint_mlx_vlm_loads_without_an_audio_tower_is_one_line(tmp_path, monkeypatch):
    """The audio REF on a checkpoint whose config.json mlx-vlm reads with "audio_config": null (HF's
    model has its audio tower): mlx-vlm's load builds no audio tower (its sanitize drops the audio
    weights), and the child refuses in one line. (Without the key at all, mlx-vlm 0.7.10 builds its
    default 12-layer tower and fails on the missing weights: one line too.)"""
    real = M.fixed_config

    def without_audio(cfg):
        fixed, fixes = real(cfg)
        fixed["audio_config"] = None
        return fixed, fixes

    monkeypatch.setattr(M, "fixed_config", without_audio)
    out = tmp_path / "o.h5"
    r = invoke("replay", golden_path("audio"), "--runtime", "mlx", "-o", out)
    # after the loading lines said once per process (if this process has not said them yet): one error line
    lines = [ln for ln in without_progress(r.stderr.splitlines()) if not ln.startswith("mlx: ")]
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not out.exists(), r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: mlx (mlx 0.32.4, mlx-lm 0.32.2) "), r.stderr
    assert "mlx-vlm loads this checkpoint without an audio tower" in lines[0], r.stderr


def test_an_audio_prompt_without_mlx_vlm_is_one_line_before_anything_loads(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlx_vlm" else real(name, *a))
    monkeypatch.setattr("gemma4_trace.hf.model.load_model", _no_model_load)
    out = tmp_path / "o.h5"
    r = invoke("replay", golden_path("audio"), "--runtime", "mlx", "-o", out)
    one_line_error(r, "--runtime mlx runs an", "with mlx_vlm, which is not installed", out=out)


def _no_model_load(*a, **k):
    raise AssertionError("the model was loaded before the refusal")


def test_the_padding_repro_script_still_shows_mlx_vlms_merge_bug():
    """docs/upstream/mlx-vlm-gemma4-audio-padding.md: mlx-vlm's get_input_embeddings scatters the
    padding frames too: the second clip's slots get the first clip's zeros. Fails once mlx-vlm strips
    them (then the report, docs/runtime-mlx.md and this test are updated)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "docs/upstream/mlx_vlm_gemma4_audio_padding_repro.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 1, r.stdout + r.stderr
    assert lines[0] == "clips: mel frames [99, 199] (padded to 199)", lines
    assert lines[1].startswith("clip 0: 25 soft tokens") and lines[1].endswith("rows of zeros 0"), lines
    clip1 = lines[2]
    assert clip1.startswith("clip 1: 50 soft tokens") and clip1.endswith("rows of zeros 25"), lines
    assert float(clip1.split("rel-L2 ")[1].split(";")[0]) > 0.1, lines
    assert lines[-1] == "BUG: mlx-vlm merges the padding frames", lines
