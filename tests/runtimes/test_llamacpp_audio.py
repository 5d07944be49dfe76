"""`--runtime llama.cpp` on audio prompts: the project's mmproj conversion of the audio tower
(replayer/runtimes/llamacpp/gguf_mmproj_audio.py) run by llama.cpp's mtmd (gemma4a), its sites found by
position in the graph (llamacpp/mtmd_audio.py), the soft tokens decoded at the audio token slots
(llamacpp/audio.py); fed HF's features (--audio-features hf) or llama.cpp's own (native, --audio FILE)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("soundfile", reason="soundfile is not installed (pip install -e '.[audio]')")

from gemma4_trace.hf.model import load_model  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp import audio as AU  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp import gguf_mmproj as GM  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp import gguf_mmproj_audio as GA  # noqa: E402
from gemma4_trace.replayer.runtimes.registry import BY_NAME  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

MODEL = "hf/tiny_audio_model"
CLIP = "hf/tiny_audio_model/example.wav"  # the clip traces/golden/audio.h5 was recorded from
AUDIO = [k.key for k in S.TOWER_BY_NAME["audio"].kinds]
# worst per-frame rel-L2 against HF, --audio-features hf, measured on the audio golden (F32): 5.4e-4
# (subsampled: ggml's conv2d runs on an F16 im2col) .. 7.9e-4 (output_proj); about 2.5x allowed
HF_PROFILE = 2e-3


def _rows(x, y) -> np.ndarray:
    x, y = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
    return np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    """The audio golden replayed with HF's features and with llama.cpp's own: {mode: (summary, RUN,
    [(REF's features, llama.cpp's) per clip])}."""
    out, orig = {}, AU.prefill_audio
    for mode in ("hf", "native"):
        seen = []

        def keep(rt, *args, seen=seen):
            result = orig(rt, *args)
            seen.extend(rt.frontend)
            return result

        AU.prefill_audio = keep
        try:
            run = tmp_path_factory.mktemp("llama-audio") / f"{mode}.h5"
            more = {"audio": CLIP} if mode == "native" else {}
            summary = replay_trace(golden_path("audio"), run, runtime="llama.cpp", audio_features=mode, **more)
        finally:
            AU.prefill_audio = orig
        out[mode] = (summary, run, seen)
    return out


@pytest.mark.slow
def test_every_audio_site_is_captured_and_within_the_measured_profile(replays):
    summary, run, seen = replays["hf"]
    assert "its sites found by position in the graph, fed HF's log-mel features" in summary, summary
    assert "6/6 tokens agree" in summary, summary
    assert seen == []  # HF's features were written over mtmd's: none of its own read
    declared = {r.kind for r in BY_NAME["llama.cpp"].capture_map.rows if r.kind.startswith("audio.")}
    assert declared == set(AUDIO)
    with TraceReader(golden_path("audio")) as a, TraceReader(run) as b:
        for key in AUDIO:
            for site in S.sites_of(key, a.towers["audio"].layers):
                x, y = a.read(key, site.layer), b.read(key, site.layer)
                assert x.shape == y.shape == (77, *x.shape[1:]), (key, site.layer, y.shape)
                worst = float(_rows(x, y).max())
                assert 0 < worst < HF_PROFILE, (key, site.layer, worst)  # llama.cpp's own, near HF's
        assert list(b.tokens()) == list(a.tokens())


@pytest.mark.slow
def test_native_features_are_llamacpps_log_mel_with_its_floor(replays):
    """llama.cpp's own front end on the golden's clip: log(max(mel, 0.001)) where HF takes
    log(mel + 0.001) (docs/upstream/llamacpp-gemma4a-frontend.md): 2.6e-2 rel-L2 on this speech clip."""
    summary, run, seen = replays["native"]
    assert "fed llama.cpp's own log-mel of example.wav" in summary, summary
    ((ref, mine),) = seen
    assert ref.shape == mine.shape == (308, 128)
    rel = AU.rel_l2(ref, mine)
    assert 1e-2 < rel < 5e-2, rel  # measured 2.57e-2; below 1e-2: the floor was fixed upstream
    floored = np.log(np.maximum(np.exp(ref.astype(np.float64)) - 1e-3, 1e-3))  # REF undone to mel, floored
    assert AU.rel_l2(floored, mine) < 1e-3, AU.rel_l2(floored, mine)
    with TraceReader(golden_path("audio")) as a, TraceReader(run) as b:
        sub = float(_rows(a.read("audio.subsampled"), b.read("audio.subsampled")).max())
        assert HF_PROFILE < sub < 5e-2, sub  # measured 1.8e-2: the front end's difference, carried in


def test_the_audio_mmproj_holds_the_converters_names(tmp_path):
    """The writer's tensor names are those llama.cpp's converter gives the checkpoint's audio tensors
    (gguf's own name table for MMPROJ, on the converter's renaming), and the keys clip.cpp reads."""
    path = tmp_path / "mm.gguf"
    loaded = load_model(MODEL)
    GA.write(loaded, path)
    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 128)
    suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
    for hf in loaded.model.state_dict():
        if "audio_tower" not in hf and "embed_audio" not in hf:
            continue
        name = hf.replace("model.audio_tower.", "conformer.").replace(".linear.", ".")
        name += ".weight" if name.endswith("per_dim_scale") else ""
        assert table.get_name(name, try_suffixes=suffixes) in names, hf
    fields = {k: f.contents() for k, f in r.fields.items()}
    assert fields["clip.audio.projector_type"] == "gemma4a" and fields["clip.has_audio_encoder"] is True
    assert fields["clip.vision.projector_type"] == "gemma4v"  # both towers, as the converter writes them
    assert {k: fields[k] for k in ("clip.audio.block_count", "clip.audio.num_mel_bins")} == {
        "clip.audio.block_count": 2,
        "clip.audio.num_mel_bins": 128,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needle",
    [
        (("--audio-features", "native"), "--audio-features native needs the clip's waveform"),
        (("--audio", CLIP), "--audio FILE is the waveform for --audio-features native"),
        (("--audio-features", "native", "--audio", "hf/tiny_model/example.png"), "is not a readable audio file"),
    ],
    ids=["native-without-waveform", "waveform-with-hf", "not-audio"],
)
def test_bad_audio_input_is_one_line(tmp_path, args, needle):
    run = tmp_path / "run.h5"
    res = invoke("replay", golden_path("audio"), "--runtime", "llama.cpp", *args, "-o", run)
    one_line_error(res, needle, out=run)


@pytest.mark.slow
def test_another_clip_or_runtime_or_an_mmproj_without_audio_is_one_line(tmp_path):
    run = tmp_path / "run.h5"
    noisy = tmp_path / "noisy.wav"
    import soundfile as sf

    x, sr = sf.read(CLIP, dtype="float32")
    sf.write(noisy, x + np.random.default_rng(0).standard_normal(len(x)).astype(np.float32) * 0.05, sr)
    res = invoke("replay", golden_path("audio"), "--runtime", "llama.cpp", "--audio-features", "native",
                 "--audio", noisy, "-o", run)  # fmt: skip
    one_line_error(res, "is not the clip REF was recorded from", out=run)
    res = invoke("replay", golden_path("audio"), "--audio-features", "native", "-o", run)
    one_line_error(res, "--runtime static computes no audio features of its own (--audio-features native)", out=run)
    vision_only = tmp_path / "vision.gguf"
    GM.write(load_model(MODEL), vision_only)
    res = invoke("replay", golden_path("audio"), "--runtime", "llama.cpp", "--mmproj", vision_only, "-o", run)
    one_line_error(res, "the mmproj file has no audio encoder", out=run)


@pytest.mark.slow
def test_the_frontend_repro_script_still_shows_the_floor():
    """docs/upstream/llamacpp-gemma4a-frontend.md: exit 1 while mtmd floors with max (0 once fixed upstream)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "docs/upstream/llamacpp_gemma4a_frontend_repro.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "log(max(mel, 0.001)): rel-L2 2.7" in res.stdout, res.stdout
