"""A divergence inside the audio tower, for people: the sentence and the JSON name the clip, the
conformer layer and block, the frame within the clip and its time; each audio bug of the zoo gets
its own hint (diff/audio_hints.py) and no other, a clean replay none; the HTML report draws each
clip's log-mel spectrogram with the per-frame error strips under it. REF: the embedded audio model
on the demo clip and its first 60% (two clips, the second padded), as tests/test_static_audio.py."""

from __future__ import annotations

import base64
import json
import struct
from html.parser import HTMLParser

import numpy as np
import pytest

from gemma4_trace.diff import diff_traces
from gemma4_trace.diff.audio_hints import (
    AUDIO_CHUNK_CONTEXT,
    AUDIO_FRONT_END,
    AUDIO_HALF_STEP,
    AUDIO_LCONV,
    AUDIO_LOGIT_CAP,
)
from gemma4_trace.diff.audio_where import frame_ms
from gemma4_trace.traces import TraceReader
from tests.support.bug_zoo import AUDIO_BUGS
from tests.support.cli import invoke
from tests.support.diff_fixtures import copy_trace

# each planted audio bug -> the hint it must get
EXPECTED = {
    "audio_chunk_off_by_one": AUDIO_CHUNK_CONTEXT,
    "audio_no_left_context": AUDIO_CHUNK_CONTEXT,
    "audio_conv_centred": AUDIO_LCONV,
    "audio_no_logit_cap": AUDIO_LOGIT_CAP,
    "audio_ff1_full_step": AUDIO_HALF_STEP,
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """{"ref": REF, "clean": a clean static replay, <bug>: a replay with that planted bug}."""
    import soundfile

    from gemma4_trace.hf.model import DEMO_AUDIO
    from gemma4_trace.recorder.record import record_trace
    from gemma4_trace.replayer.replay import replay_trace

    d = tmp_path_factory.mktemp("audio-diff")
    wave, rate = soundfile.read(str(DEMO_AUDIO), dtype="float32")
    soundfile.write(str(d / "short.wav"), wave[: int(len(wave) * 0.6)], rate)
    out = {"ref": d / "ref.h5", "clean": d / "clean.h5"}
    record_trace(output=out["ref"], audios=[str(DEMO_AUDIO), str(d / "short.wav")], prompt="Transcribe the audio.",
                 max_new_tokens=3)  # fmt: skip
    replay_trace(out["ref"], out["clean"])
    for bug, (factory, _, _) in AUDIO_BUGS.items():
        out[bug] = d / f"{bug}.h5"
        replay_trace(out["ref"], out[bug], runtime=f"tests.support.bug_zoo:{factory}")
    return out


def _frames(path) -> tuple[int, ...]:
    with TraceReader(path) as r:
        return r.towers["audio"].item_rows


# ---------------------------------------------------------------- where
def test_a_planted_bug_is_named_by_clip_layer_block_and_frame(traces):
    res = invoke("diff", traces["ref"], traces["audio_conv_centred"])
    assert res.exit_code == 1, res.output
    first = res.stdout.splitlines()[0]
    assert first.startswith(
        "first divergence: prefill step 0, clip 1, audio layer 0, block lconv, frame 0 (0.00 s), channel 0: rel-L2 "
    ), first
    d = json.loads(invoke("diff", traces["ref"], traces["audio_conv_centred"], "--json").stdout)["first_divergence"]
    assert (d["tower"], d["kind"], d["layer"], d["position"]) == ("audio", "audio.lconv_out", 0, 0)
    assert (d["clip"], d["frame"], d["time_s"], d["block"]) == (1, 0, 0.0, "lconv")
    assert d["sentence"] == first


@pytest.mark.parametrize(
    "kind,layer,block", [("audio.lconv_out", 0, "block lconv"), ("audio.layer_out", 1, "block layer output")]
)
def test_a_frame_of_the_second_clip_has_its_clip_frame_and_time(traces, tmp_path, kind, layer, block):
    first = _frames(traces["ref"])[0]
    row = first + 17  # clip 2, its frame 17: 0.68 s into it

    def edit(k, l, s, rows):
        if (k, l) == (kind, layer):
            rows[row] += 1.0
        return rows

    run = tmp_path / "run.h5"
    copy_trace(traces["ref"], run, edit=edit)
    res = invoke("diff", traces["ref"], run, "--json")
    assert res.exit_code == 1, res.output
    d = json.loads(res.stdout)["first_divergence"]
    assert (d["kind"], d["layer"], d["position"]) == (kind, layer, row)
    assert (d["clip"], d["frame"], d["time_s"]) == (2, 17, 0.68)
    assert f"prefill step 0, clip 2, audio layer {layer}, {block}, frame 17 (0.68 s), channel " in d["sentence"]


def test_a_global_kind_names_the_tower_and_the_kind(traces, tmp_path):
    def edit(k, l, s, rows):
        if k == "audio.output_proj":
            rows[3] *= 2.0
        return rows

    run = tmp_path / "run.h5"
    copy_trace(traces["ref"], run, edit=edit)
    d = diff_traces(traces["ref"], run).first_divergence
    assert "clip 1, audio tower, kind output_proj, frame 3 (0.12 s)" in d.sentence
    assert d.to_json()["block"] == "output_proj"


def test_a_frame_lasts_the_configs_audio_ms_per_token_or_40_ms():
    assert frame_ms({}) == 40.0
    assert frame_ms({"audio_ms_per_token": 25}) == 25.0
    assert frame_ms({"audio_config": {"audio_ms_per_token": 80}}) == 80.0
    for bad in (True, -1, float("nan"), "40", 1e9):
        assert frame_ms({"audio_ms_per_token": bad}) == 40.0


# ---------------------------------------------------------------- hints
@pytest.mark.parametrize("bug", sorted(AUDIO_BUGS))
def test_each_planted_audio_bug_gets_its_hint_and_no_other(traces, bug):
    result = diff_traces(traces["ref"], traces[bug])
    _, _, (kind, layer) = AUDIO_BUGS[bug]
    assert (result.first_divergence.kind, result.first_divergence.layer) == (kind, layer)
    assert result.hint is not None, result.first_divergence.sentence
    assert result.hint.name == EXPECTED[bug], result.hint.evidence
    assert result.hint.evidence and "{" not in result.hint.evidence


def test_the_hints_say_what_the_frames_show(traces):
    chunk = diff_traces(traces["ref"], traces["audio_chunk_off_by_one"]).hint.evidence
    assert "each chunk's first frame (period 12: frames 0, 12, 24, 36, 48, 60, 72 of clip 1" in chunk
    assert "attention_chunk_size 12, attention_context_left 13" in chunk
    left = diff_traces(traces["ref"], traces["audio_no_left_context"]).hint.evidence
    assert "also at the first frame of every clip" in left
    cap = diff_traces(traces["ref"], traces["audio_no_logit_cap"]).hint.evidence
    assert "matches at the first frame of every clip" in cap and "attention_logit_cap 50" in cap
    ff1 = diff_traces(traces["ref"], traces["audio_ff1_full_step"]).hint.evidence
    assert "is REF's times 2 at every frame" in ff1 and "residual_weight 0.5" in ff1


def test_a_clean_replay_matches_with_no_hint(traces):
    result = diff_traces(traces["ref"], traces["clean"])
    assert result.match and result.hint is None and result.audio_map is None


def test_a_front_end_difference_at_every_frame_gets_the_front_end_hint(traces, tmp_path):
    def edit(k, l, s, rows):
        return rows * 1.01 + 0.01 if k == "audio.subsampled" else rows

    run = tmp_path / "run.h5"
    copy_trace(traces["ref"], run, edit=edit)
    result = diff_traces(traces["ref"], run)
    assert result.first_divergence.kind == "audio.subsampled"
    assert result.hint is not None and result.hint.name == AUDIO_FRONT_END
    assert "log-mel input_features are the same" in result.hint.evidence


def test_a_few_frames_off_is_no_front_end(traces, tmp_path):
    def edit(k, l, s, rows):
        if k == "audio.subsampled":
            rows[[5, 40]] += 1.0  # two frames, not every frame
        return rows

    run = tmp_path / "run.h5"
    copy_trace(traces["ref"], run, edit=edit)
    result = diff_traces(traces["ref"], run)
    assert result.first_divergence.kind == "audio.subsampled" and result.hint is None


# ---------------------------------------------------------------- the HTML report
class _Svg(HTMLParser):
    """The audio section's pictures: each clip's spectrogram and its strips' frame cells."""

    def __init__(self):
        super().__init__()
        self.clips, self.strip, self.h2 = [], None, []
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure" and a.get("class") == "audio-clip":
            self.clips.append({"clip": int(a["data-clip"]), "images": [], "strips": []})
        elif tag == "image" and a.get("class") == "spectrogram":
            self.clips[-1]["images"].append(a)
        elif tag == "g" and a.get("class") == "err-strip":
            self.strip = {"label": a["data-label"], "frames": []}
            self.clips[-1]["strips"].append(self.strip)
        elif tag == "rect" and self.strip is not None and "data-frame" in a:
            self.strip["frames"].append((int(a["data-frame"]), float(a["data-rel-l2"])))
        self._in_h2 = tag == "h2"

    def handle_endtag(self, tag):
        if tag == "g":
            self.strip = None

    def handle_data(self, data):
        if self._in_h2:
            self.h2.append(data)
            self._in_h2 = False


def _png_size(uri: str) -> tuple[int, int]:
    png = base64.b64decode(uri.removeprefix("data:image/png;base64,"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def test_the_report_draws_each_clips_spectrogram_and_error_strips(traces, tmp_path):
    out = tmp_path / "r.html"
    res = invoke("diff", traces["ref"], traces["audio_chunk_off_by_one"], "--report", out)
    assert res.exit_code == 1, res.output
    text = out.read_text()
    assert "http" not in text.split("</style>", 1)[1].replace("data:image/png", "")  # nothing fetched
    p = _Svg()
    p.feed(text)
    assert "Audio: error of audio.attn_out of layer 0 over each clip's frames" in p.h2
    assert ">aL0<" in text and ">aL1<" in text  # the audio tower's band of the heatmap
    frames = _frames(traces["ref"])
    with TraceReader(traces["ref"]) as r:
        mask = r.extra_input("input_features_mask")
        bins = r.extra_input("input_features").shape[2]
    assert [c["clip"] for c in p.clips] == [1, 2]
    for c, n, m in zip(p.clips, frames, mask):
        (image,) = c["images"]
        assert _png_size(image["href"]) == (int(m.sum()), bins)  # every valid mel frame, every bin
        labels = [s["label"] for s in c["strips"]]
        assert labels == ["L0 attn (first divergence)", "L0 layer output", "L1 layer output"]
        for s in c["strips"]:
            assert [f for f, _ in s["frames"]] == list(range(n))  # one value per frame
        errs = np.array([e for _, e in c["strips"][0]["frames"]])
        assert np.array_equal(np.flatnonzero(errs > 1e-4), np.arange(0, n, 12))  # the chunk starts
    assert 'class="first"' in text


def test_a_text_divergence_or_a_match_draws_no_audio(traces, tmp_path):
    out = tmp_path / "r.html"
    assert invoke("diff", traces["ref"], traces["clean"], "--report", out).exit_code == 0
    assert "Audio: error" not in out.read_text()


def test_features_that_do_not_fit_the_tower_give_no_picture_and_no_error(traces, tmp_path):
    import h5py

    ref, run = tmp_path / "ref.h5", tmp_path / "run.h5"
    for src, dst in ((traces["ref"], ref), (traces["audio_conv_centred"], run)):
        dst.write_bytes(src.read_bytes())
        with h5py.File(dst, "r+") as f:
            f["inputs/extra/input_features_mask"][...] = False  # no valid mel frame
    result = diff_traces(ref, run)
    assert result.first_divergence.kind == "audio.lconv_out" and result.audio_map is None


# ---------------------------------------------------------------- malformed
def test_a_tower_table_that_does_not_sum_to_the_rows_is_one_line_exit_2(traces, tmp_path):
    import h5py

    bad = tmp_path / "bad.h5"
    bad.write_bytes(traces["ref"].read_bytes())
    with h5py.File(bad, "r+") as f:
        rows = f["towers/audio/item_rows"][()]
        del f["towers/audio/item_rows"]
        f["towers/audio/item_rows"] = rows - 1
    for a, b in ((bad, traces["clean"]), (traces["ref"], bad)):
        res = invoke("diff", a, b)
        assert res.exit_code == 2, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "as its tower says" in lines[0], lines
