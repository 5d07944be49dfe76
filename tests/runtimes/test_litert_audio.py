"""`--runtime litert` on audio prompts: Gemma 4's audio tower exported by litert-torch 0.10.0
(audio_encoder.tflite at REF's clip length, audio_adapter.tflite for embed_audio), run by ai-edge-litert
on REF's own log-mel features, every audio site read from the interpreter's preserved tensors.

The audio golden (one clip of 308 mel frames, 77 soft tokens) is replayed at its max_seq (104). Every
audio site matches HF within float32's defaults (at most 6.1e-7 rel-L2, measured); the first divergence
is the text export's missing final soft-cap (docs/upstream/litert-torch-softcap.md), pinned by
test_litert.py. One upstream bug is pinned here: the adapter's export sample is 1536 wide, whatever
output_proj_dims is (docs/upstream/litert-torch-gemma4-audio-adapter.md)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (pip install -e '.[litert]')")
if importlib.util.find_spec("litert_torch") is None:  # not imported here: its TensorFlow costs each worker 4 s
    pytest.skip("litert-torch is not installed (pip install -e '.[litert]')", allow_module_level=True)

from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import audio as A  # noqa: E402
from gemma4_trace.replayer.runtimes.litert.spec import LITERT  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

pytestmark = pytest.mark.slow  # exports and converts programs; make test-fast skips it

ROOT = Path(__file__).resolve().parents[2]
AUDIO = golden_path("audio")  # max_seq 104: the text export shared by every replay here
WORST = 5e-6  # the measured worst audio site (soft tokens, 6.1e-7) with headroom; float32's default is 1e-4


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _audio_sites(path) -> dict:
    with TraceReader(path) as t:
        return {(k, layer): t.read(k, layer) for k, layer in t.kinds_present() if k.startswith("audio.")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("litert-audio") / "golden.h5"
    r = invoke("replay", AUDIO, "--runtime", "litert", "-o", out)
    assert r.exit_code == 0, r.output
    return out, r.stderr


def test_the_audio_golden_replays_with_every_audio_site_matching_hf(run):
    """Every audio site of the capture map is in the trace, at REF's rows (the clip's 77 real
    subsampled frames) and within WORST of HF; the soft tokens took the audio tokens' embeddings (the
    generated tokens are REF's); the first divergence is the text graph's missing soft-cap, after
    every tensor before the logits matched."""
    out, stderr = run
    declared = {(s.key, s.layer) for s in LITERT.sites(8, {"audio": 2}) if s.tower == "audio"}
    ref, got = _audio_sites(AUDIO), _audio_sites(out)
    assert set(got) == declared == set(ref) and len(declared) == 13
    for key, rows in ref.items():
        assert got[key].shape == rows.shape, key
        assert _rel(rows, got[key]) < WORST, (key, _rel(rows, got[key]))
    with TraceReader(AUDIO) as a, TraceReader(out) as b:
        assert list(a.tokens()) == list(b.tokens())
        assert "audio tower: audio_encoder.tflite at 308 mel frames a clip" in b.provenance["runtime"]
    r = invoke("diff", AUDIO, out, "--json")
    assert r.exit_code == 1, r.output
    first = json.loads(r.stdout)["first_divergence"]
    assert (first["kind"], first["step"]) == ("logits", 0), first
    # litert-torch's own adapter export fails on this model: the width used is said on stderr
    assert "audio_adapter.tflite (embed_audio) exported with the tower's output_proj_dims 48" in stderr


def test_the_audio_adapter_repro_script_still_shows_the_fixed_width():
    """Pinned: docs/upstream/litert_torch_gemma4_audio_adapter_repro.py (the adapter module run on
    the sample its own get_sample_inputs gives) exits 1 with the write-up's lines. When it exits 0,
    litert-torch sizes the adapter right: audio.py can stop passing the width itself (and saying so)."""
    script = ROOT / "docs" / "upstream" / "litert_torch_gemma4_audio_adapter_repro.py"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 1, p.stderr[-2000:]
    doc = (ROOT / "docs" / "upstream" / "litert-torch-gemma4-audio-adapter.md").read_text().splitlines()
    start = doc.index("    $ python docs/upstream/litert_torch_gemma4_audio_adapter_repro.py") + 1
    assert p.stdout.splitlines()[-3:] == [ln.strip() for ln in doc[start : start + 3]], p.stdout


def test_clips_that_do_not_fill_the_audio_slots_are_one_line(run, tmp_path):
    """A REF whose features mask gives fewer real frames than its prompt has audio tokens: one line,
    exit 2, no trace (the graphs are the cache's: the clip length is the golden's)."""
    bad = tmp_path / "bad.h5"
    shutil.copy(AUDIO, bad)
    with h5py.File(bad, "r+") as f:
        f["inputs/extra/input_features_mask"][0, 200:] = False
    out = tmp_path / "run.h5"
    r = invoke("replay", bad, "--runtime", "litert", "-o", out)
    r.stderr_bytes = b"".join(  # the adapter's note (said when the graphs load) aside
        ln for ln in r.stderr_bytes.splitlines(keepends=True) if not ln.startswith(b"note: litert: audio_adapter")
    )
    one_line_error(r, "the clips give 50 soft tokens for 77 audio-token slots", out=out)


def test_an_audio_export_failure_is_one_line_and_writes_nothing(run, tmp_path, monkeypatch):
    """The audio export fails (here: its child cannot import its module): one line, exit 2, no trace."""
    key = A.audio_key
    monkeypatch.setattr(A, "audio_key", lambda loaded, frames: {**key(loaded, frames), "test": str(tmp_path)})
    monkeypatch.setattr(A, "__name__", "gemma4_trace.no_such_module")
    out = tmp_path / "run.h5"
    r = invoke("replay", AUDIO, "--runtime", "litert", "-o", out)
    r.stderr_bytes = b"".join(
        ln for ln in r.stderr_bytes.splitlines(keepends=True) if not ln.startswith(b"exporting tiny-gemma4")
    )
    one_line_error(r, "litert-torch's Gemma 4 audio encoder export failed", "No module named", out=out)


CLIP = ROOT / "hf" / "tiny_audio_model" / "example.wav"  # the clip traces/golden/audio.h5 was recorded from


def test_litert_lm_replays_the_audio_golden_from_the_clips_waveform(tmp_path):
    """LiteRT-LM takes a clip as an audio file and computes its own log-mel features (docs/runtime-litert.md,
    "LiteRT-LM and audio"): the clip is --audio FILE (REF holds only HF's features; without it, one line
    before any export), the bundle litert-torch's export with its audio encoder, its adapter's width fixed
    (said on stderr and in the runtime's name). LiteRT-LM writes REF's 79-token audio run (measured:
    its conversation's token count); 5 of 6 tokens are REF's, decode step 1 a near tie under REF's logits
    (margin 0.113): `--runtime litert`, fed HF's features, gives all 6."""
    pytest.importorskip("litert_lm", reason="litert-lm-api is not installed (pip install -e '.[litert]')")
    out = tmp_path / "run.h5"
    r = invoke("replay", AUDIO, "--runtime", "litert-lm", "-o", out)
    one_line_error(r, "--runtime litert-lm takes an audio prompt as the clip's waveform", "--audio FILE", out=out)
    r = invoke("replay", AUDIO, "--runtime", "litert-lm", "--audio-features", "native", "--audio", CLIP, "-o", out)
    assert r.exit_code == 0, r.output
    assert "5/6 tokens agree" in r.stdout, r.stdout
    assert "audio: example.wav's waveform through its Conversation API, its own log-mel features" in r.stdout
    assert "audio_adapter.tflite (embed_audio) exported with the tower's output_proj_dims 48" in r.stderr
    d = invoke("diff", AUDIO, out, "--json")
    first = json.loads(d.stdout)["first_divergence"]
    assert (first["kind"], first["step"]) == ("token", 1), first
