"""`trace record --audio`: the audio tower's sites, recorded where HF computes them (hf/sites.py),
padding frames dropped, clip after clip; each kind checked against what HF does with it next (the
soft tokens are the embeddings' audio rows, embed_audio of output_proj, ...), on the audio golden
and on fresh recordings; and every kind of bad clip refused in one line before anything is written."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import soundfile as sf
import torch

from gemma4_trace.hf.model import DEMO_AUDIO, DEMO_AUDIO_PROMPT
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.recorder.record import record_trace
from gemma4_trace.traces import TraceReader
from tests.support.cli import invoke, one_line_error

AUDIO_KINDS = ["subsampled", "ff1_out", "attn_out", "lconv_out", "ff2_out", "layer_out", "output_proj", "soft_tokens"]


@pytest.fixture(scope="module")
def lm():
    from gemma4_trace.hf.model import load_model

    return load_model(audio=True)


def audio(r: TraceReader, kind: str, layer: int | None = None) -> np.ndarray:
    return r.read(f"audio.{kind}", layer)


def test_the_golden_holds_the_tower_frame_by_frame():
    with TraceReader(golden_path("audio")) as r:
        t = r.towers["audio"]
        mask = r.extra_inputs()["input_features_mask"]
        frames = int(mask[0, ::2][::2].sum())  # two stride-2 convolutions
        assert t.item_rows == t.item_tokens == (frames,) and frames == 77  # 3.08 s at 25 frames a second
        assert (t.layers, t.hidden, t.heads, t.head_dim) == (2, 32, 2, 16)
        assert {f"audio.{k}" for k in AUDIO_KINDS} <= {k for k, _ in r.kinds_present()}
        assert audio(r, "layer_out", 1).shape == (77, 32) and audio(r, "output_proj").shape == (77, 48)
        assert r.extra_inputs()["input_features"].shape == (1, mask.shape[1], 128)


def test_the_soft_tokens_are_the_embeddings_audio_rows_and_embed_audio_of_the_projection(lm):
    with TraceReader(golden_path("audio")) as r:
        ids = np.asarray(r.prompt_ids)
        slots = ids == lm.model.config.audio_token_id
        soft = audio(r, "soft_tokens")
        assert slots.sum() == len(soft) == 77
        assert np.array_equal(r.read("embeddings")[: len(ids)][slots], soft)  # merged unscaled, as they are
        with torch.no_grad():
            again = lm.model.model.embed_audio(inputs_embeds=torch.from_numpy(audio(r, "output_proj"))[None])[0]
        np.testing.assert_allclose(again.numpy(), soft, rtol=0, atol=1e-6)


def test_each_block_feeds_the_next_as_hf_computes_it(lm):
    """The layer's blocks in order: lconv1d of (ff1_out + norm_post_attn(attn_out)) is lconv_out, and
    feed_forward2 of lconv_out is ff2_out: a site recorded from the wrong module breaks the chain."""
    layer = lm.model.model.audio_tower.layers[1]
    with TraceReader(golden_path("audio")) as r, torch.no_grad():
        ff1, attn = (torch.from_numpy(audio(r, k, 1))[None] for k in ("ff1_out", "attn_out"))
        lconv = layer.lconv1d(layer.norm_post_attn(attn) + ff1)
        np.testing.assert_allclose(lconv[0].numpy(), audio(r, "lconv_out", 1), rtol=0, atol=1e-5)
        ff2 = layer.feed_forward2(torch.from_numpy(audio(r, "lconv_out", 1))[None])
        np.testing.assert_allclose(ff2[0].numpy(), audio(r, "ff2_out", 1), rtol=0, atol=1e-5)


def _clip(path, seconds: float, rate: int = 16000, channels: int = 1, seed: int = 0, subtype="PCM_16"):
    """Speech-like noise: a few formant tones under an envelope, with some noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave = sum(np.sin(2 * np.pi * f * t) for f in (220, 700, 1200)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    wave = 0.2 * wave / 3 + 0.02 * rng.standard_normal(t.size)
    sf.write(path, np.repeat(wave[:, None], channels, axis=1).astype(np.float32), rate, subtype=subtype)
    return str(path)


def test_two_clips_are_rows_clip_after_clip_each_as_it_is_alone(tmp_path):
    """The padded clip's rows are its own: recorded with a longer clip beside it (HF pads it to the
    longer one's frames), they are what it gives alone, padding frames dropped."""
    short = _clip(tmp_path / "short.wav", 1.0, seed=1)
    both, alone = tmp_path / "both.h5", tmp_path / "alone.h5"
    record_trace(output=both, prompt="Compare.", audios=[str(DEMO_AUDIO), short], max_new_tokens=2)
    record_trace(output=alone, prompt="Compare.", audios=[short], max_new_tokens=2)
    with TraceReader(both) as b, TraceReader(alone) as a:
        first, second = b.towers["audio"].item_rows
        assert (first, second) == (77, a.towers["audio"].item_rows[0]) and second == 25
        for kind, layer in (("subsampled", None), ("lconv_out", 0), ("layer_out", 1), ("soft_tokens", None)):
            np.testing.assert_allclose(audio(b, kind, layer)[first:], audio(a, kind, layer), rtol=0, atol=2e-5)


def test_the_cli_records_the_demo_clip_with_the_embedded_audio_model(tmp_path):
    out = tmp_path / "a.h5"
    r = invoke("record", "--audio", str(DEMO_AUDIO), "--max-new-tokens", "2", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "resampled from 22050 Hz to 16000 Hz (3.08 s)" in r.stdout
    with TraceReader(out) as t:
        assert t.prompt_text == DEMO_AUDIO_PROMPT and t.provenance["model_name"] == "tiny-gemma4-audio (embedded)"
        np.testing.assert_array_equal(
            audio(t, "soft_tokens"), TraceReader(golden_path("audio")).read("audio.soft_tokens")
        )


def test_a_multichannel_high_rate_clip_is_mixed_down_and_resampled_with_a_note(tmp_path):
    wav = _clip(tmp_path / "eight.wav", 0.5, rate=192000, channels=8)
    r = invoke("record", "--audio", wav, "--prompt", "Hi", "--max-new-tokens", "1", "-o", str(tmp_path / "o.h5"))
    assert r.exit_code == 0, r.output
    assert "8 channels mixed down to mono, resampled from 192000 Hz to 16000 Hz (0.50 s)" in r.stdout
    low = _clip(tmp_path / "low.wav", 0.5, rate=8000)
    r = invoke("record", "--audio", low, "--prompt", "Hi", "--max-new-tokens", "1", "-o", str(tmp_path / "p.h5"))
    assert r.exit_code == 0 and "resampled from 8000 Hz to 16000 Hz" in r.stdout, r.output


def _bad_files(tmp_path) -> dict:
    d = tmp_path
    (d / "text.wav").write_text("this is not audio\n" * 20)
    good = _clip(d / "good.wav", 1.0)
    data = open(good, "rb").read()
    (d / "truncated.wav").write_bytes(data[: len(data) // 3])
    sf.write(d / "empty.wav", np.zeros((0, 1), np.float32), 16000)
    nan = np.zeros(1600, np.float32)
    nan[100] = math.nan
    sf.write(d / "nan.wav", nan, 16000, subtype="FLOAT")
    inf = np.zeros(1600, np.float32)
    inf[5] = math.inf
    sf.write(d / "inf.wav", inf, 16000, subtype="FLOAT")
    # a FLAC header (STREAMINFO) that claims two hours: refused from the header, nothing decoded
    sf.write(d / "long.flac", np.zeros(16000, np.float32), 16000)
    raw = bytearray((d / "long.flac").read_bytes())
    fields = int.from_bytes(raw[18:26], "big")  # rate (20 bits), channels, bits, total samples (36 bits)
    raw[18:26] = ((fields >> 36 << 36) | (2 * 3600 * 16000)).to_bytes(8, "big")
    (d / "long.flac").write_bytes(bytes(raw))
    flac = open(_clip(d / "good.flac", 1.0), "rb").read()
    (d / "truncated.flac").write_bytes(flac[: len(flac) // 3])
    os.mkfifo(d / "fifo.wav")
    (d / "folder.wav").mkdir()
    return {
        "text.wav": "is not a readable audio file",
        "truncated.wav": "is truncated: its header claims 32000 bytes of samples",
        "truncated.flac": "cannot be decoded",
        "empty.wav": "holds no samples (0 s)",
        "nan.wav": "holds NaN or infinite samples",
        "inf.wav": "holds NaN or infinite samples",
        "long.flac": "is 7200.0 s long, more than the 30 s the feature extractor takes",
        "fifo.wav": "is not a regular file",
        "folder.wav": "is not a regular file",
        "missing.wav": "does not exist",
    }


def test_bad_clips_are_one_line_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short names: the line shows a long path shortened
    for name, needle in _bad_files(tmp_path).items():
        out = f"{name}.h5"
        r = invoke("record", "--audio", name, "--prompt", "Hi", "-o", out)
        one_line_error(r, f"audio {name} ", needle, out=out)


def test_a_model_without_an_audio_tower_refuses_audio(tmp_path):
    from gemma4_trace.hf.model import embedded_model_dir

    out = tmp_path / "o.h5"
    r = invoke(
        "record", "--model", str(embedded_model_dir()), "--audio", str(DEMO_AUDIO), "--prompt", "Hi", "-o", str(out)
    )
    one_line_error(r, "has no audio tower; it cannot take --audio", out=out)


def test_the_audio_projection_repro_script_still_fails():
    """docs/upstream/transformers-gemma4-audio-proj-size.md: fails once transformers sizes the linear right."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "docs/upstream/transformers_gemma4_audio_proj_repro.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "input_proj_linear.in_features = 8; the subsampled frames are 128 wide" in r.stdout
    assert "mat1 and mat2 shapes cannot be multiplied (10x128 and 8x32)" in r.stdout


@pytest.mark.slow
def test_the_embedded_audio_model_rebuilds_bit_identical(tmp_path):
    """scripts/build_tiny_audio_model.py writes the checked-in weights and speech clip again (espeak-ng's)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from gemma4_trace.hf.model import embedded_audio_model_dir

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it)")
    script = Path(__file__).resolve().parents[1] / "scripts/build_tiny_audio_model.py"
    r = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("model.safetensors", "example.wav", "config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (embedded_audio_model_dir() / name).read_bytes(), name
