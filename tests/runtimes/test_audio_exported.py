"""The audio tower on the exported runtimes: onnx, executorch (and its int8 modes) and openvino (and
its compressed modes) run the static runtime's port of the tower as a graph of their engine
(replayer/functional.py's AudioGraph: audio.onnx, audio.pte, audio.xml, one per (clips, mel frames),
kept in the artifact cache), never the host's Python port; their capture maps declare the audio
sites and a replay holds exactly those. Every runtime whose capture map declares none refuses an
audio REF in one line before the model loads.

REF: the audio golden (the embedded audio model on its demo clip: 308 mel frames, 77 soft tokens,
max_seq 104). The replays of third-party engines are slow (each exports or lowers the step graphs
of the embedded model); each runtime replays once per module. The ExecuTorch modes run the audio
program alone (TOWER_ONLY): a whole replay would lower their text programs at max_seq 104 as well,
minutes each (the int8 one 8 minutes on 2 cores), for the text path tests/runtimes/test_executorch.py
covers; the soft tokens' merge into the prompt is the host's, as in the onnx and openvino replays."""

from __future__ import annotations

import importlib.util
import shutil
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from gemma4_trace.diff import diff_traces
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.runtimes import registry as R
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error

AUDIO = golden_path("audio")
AUDIO_KINDS = {k.key for k in S.TOWER_BY_NAME["audio"].kinds}
# the worst audio site's max rel-L2 against HF (the golden), measured: onnx 8.2e-7, openvino 1.0e-6,
# executorch 1.3e-6 (each at the soft tokens); float32's own rounding, 10x headroom
FLOAT_BOUND = 1e-5
# quantized, the worst row of any audio site, measured: executorch-int8 9.4e-2 (its PyTorch reference
# 1.0e-1), openvino-int8 3.6e-2 (its -dq baseline 2.9e-2), each at the soft tokens; loose bounds, above
# the float graphs' rounding (the rounding is the engine's quantized tower, not the host's float port)
QUANT_BOUNDS = {"executorch-int8": (1e-3, 0.3), "openvino-int8": (1e-3, 0.1)}


def _missing(spec: R.RuntimeSpec) -> list[str]:
    missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
    return missing + [program for program, _ in spec.tools if shutil.which(program) is None]


def _need(name: str) -> R.RuntimeSpec:
    spec = R.BY_NAME[name]
    missing = _missing(spec)
    if missing:
        pytest.skip(f"--runtime {name} needs {', '.join(missing)} (pip install -e '.[{spec.extra}]')")
    return spec


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    """name -> (RUN.h5, summary line): each runtime's replay of the audio golden, once per module. The
    float runtimes replay with the host's port of the tower made to fail: their audio runs in the engine."""
    from gemma4_trace.replayer.static_audio import StaticAudio

    folder, done = tmp_path_factory.mktemp("audio_exported"), {}

    def replay(name: str):
        if name not in done:
            out = folder / f"{name}.h5"
            with pytest.MonkeyPatch.context() as mp:
                if R.BY_NAME[name].precision == "float32" and R.BY_NAME[name].third_party:

                    def no_port(*a, **k):
                        raise AssertionError(f"--runtime {name} ran the host's port of the audio tower")

                    mp.setattr(StaticAudio, "encode", no_port)
                res = invoke("replay", AUDIO, "--runtime", name, "-o", out)
            assert res.exit_code == 0, res.output
            done[name] = (out, res.output)
        return done[name]

    return replay


class Rows:
    """A probe that keeps each audio site's rows: {(kind, layer): array}."""

    def __init__(self):
        self.got = {}

    def tensor(self, kind, value, layer=None, tower="text"):
        self.got[(f"{tower}.{kind}", layer)] = value.detach().numpy().copy()


# the rows whose whole replay of the audio golden lowers their text programs at its max_seq (module
# docstring): their audio program is run alone, on the golden's features, by the runtime the registry makes
TOWER_ONLY = ("executorch", "executorch-int8", "executorch-int8-reference")


@pytest.fixture(scope="module")
def towers():
    """name -> {(kind, layer): rows} of the audio sites the runtime's audio program reported, once per module."""
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.core import make_runtime

    done = {}
    with TraceReader(AUDIO) as r:
        feats, mask = (torch.from_numpy(r.extra_input(k)) for k in ("input_features", "input_features_mask"))
        max_seq = r.n_positions

    def tower(name: str) -> dict:
        if name not in done:
            rt = make_runtime(R.parse_runtime(name), load_model(audio=True), max_seq)
            try:
                rows = Rows()
                rt.encode_audio(feats, mask, rows)
            finally:
                rt.close()
            done[name] = rows.got
        return done[name]

    return tower


def _audio_errors(run) -> dict:
    """{(kind, layer): the worst row's rel-L2} of every audio site of RUN (a trace, or the rows of
    `towers`) against the golden."""
    out = {}
    with TraceReader(AUDIO) as a, TraceReader(run) if not isinstance(run, dict) else nullcontext(run) as b:
        for kind, layer in a.kinds_present():
            if kind in AUDIO_KINDS:
                got = b[(kind, layer)] if isinstance(b, dict) else b.read(kind, layer)
                want, got = a.read(kind, layer).astype(np.float64), got.astype(np.float64)
                rel = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
                out[(kind, layer)] = float(rel.max())
    return out


# ---------------------------------------------------------------- the graph (fast)
def test_the_audio_graph_is_the_ports_on_padded_clips():
    """AudioGraph (every site with its padding frames) stripped by strip_audio gives the port's own
    sites and soft tokens, bit for bit: two clips, the second the first's 184 frames, padded."""
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer import functional as F

    with TraceReader(AUDIO) as r:
        feats = torch.from_numpy(r.extra_input("input_features"))
    n = 184
    feats = torch.cat([feats, torch.cat([feats[:, :n], torch.zeros_like(feats[:, n:])], dim=1)])
    mask = torch.ones(feats.shape[:2], dtype=torch.bool)
    mask[1, n:] = False
    rt = F.FunctionalKV(load_model("hf/tiny_audio_model"), 1)

    class Rows:
        def __init__(self):
            self.got = {}

        def tensor(self, kind, value, layer=None, tower="text"):
            self.got[(f"{tower}.{kind}", layer)] = value.detach().clone()

    port, ours = Rows(), Rows()
    want = rt.encode_audio(feats, mask, port)
    g = F.tower_graph(rt, "audio")
    with torch.no_grad():
        values = g(feats, mask)
    outs = dict(zip(g.names, (t.numpy() for t in values)))
    soft = F.strip_audio(outs, ours)
    assert want.shape == soft.shape == (77 + n // 4, 64)
    assert torch.equal(soft, want)
    assert set(ours.got) == set(port.got) and {k for k, _ in port.got} == AUDIO_KINDS
    for site, value in port.got.items():
        assert torch.equal(ours.got[site], value), site


def test_the_exported_runtimes_capture_the_audio_tower_and_the_others_refuse_it():
    """What runs the audio tower is what its capture map declares (RuntimeSpec.runs_audio); an audio
    REF for any other is one line before the model loads, naming those that run it."""
    runs = {s.name for s in R.RUNTIMES if s.runs_audio}
    assert {"static", "onnx", "executorch", "executorch-int8", "openvino", "openvino-int4-dq"} <= runs
    for name in ("onnx", "executorch-int8-reference", "openvino-int8"):
        assert R.BY_NAME[name].kinds_text() == "all kinds; the vision and audio towers' too", name
    audio = {"input_features": np.zeros((1, 8, 128), np.float32), "input_features_mask": np.ones((1, 8), bool)}
    for spec in R.RUNTIMES:
        choice = R.parse_runtime(spec.name)
        if spec.runs_audio:
            R.check_inputs(choice, extra=audio, dtype="float32")
            continue
        with pytest.raises(TraceToolError) as e:
            R.check_inputs(choice, extra=audio, dtype="float32")
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"--runtime {spec.name} runs no audio tower (it captures "), line
        assert line.endswith(f"replay an audio REF with {', '.join(s.name for s in R.RUNTIMES if s.runs_audio)}")


@pytest.mark.parametrize("name", [s.name for s in R.RUNTIMES if not s.runs_audio])
def test_trace_replay_of_an_audio_ref_is_refused_before_the_model_loads(name, tmp_path):
    spec = R.BY_NAME[name]
    if _missing(spec):
        pytest.skip(f"--runtime {name} is not installed: check_available refuses it first")
    out = tmp_path / "run.h5"
    one_line_error(
        invoke("replay", AUDIO, "--runtime", name, "-o", out), f"--runtime {name} runs no audio tower", out=out
    )


# ---------------------------------------------------------------- the replays (slow)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["onnx", "openvino", "executorch"])
def test_an_exported_runtime_runs_the_audio_tower_within_float32s_rounding(name, replays, towers):
    spec = _need(name)
    if name in TOWER_ONLY:
        run = towers(name)
    else:
        run, summary = replays(name)
        assert "6/6 tokens agree" in summary, summary
        res = diff_traces(AUDIO, run, tolerances_path=spec.profile)
        assert res.match, res.to_json()["first_divergence"]
    errors = _audio_errors(run)
    assert {k for k, _ in errors} == AUDIO_KINDS and len(errors) == 13
    assert max(errors.values()) < FLOAT_BOUND, errors


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(QUANT_BOUNDS))
def test_a_quantized_runtime_runs_the_audio_tower_quantized(name, replays, towers):
    """The tower's graph quantized as its steps are (executorch-int8: PT2E calibrated on REF's own
    features; openvino-int8: NNCF's weight compression): every audio site, off HF by the rounding."""
    _need(name)
    if name in TOWER_ONLY:
        run = towers(name)
    else:
        run, summary = replays(name)
        assert "tokens agree" in summary, summary
    errors = _audio_errors(run)
    assert {k for k, _ in errors} == AUDIO_KINDS and len(errors) == 13
    low, high = QUANT_BOUNDS[name]
    assert low < max(errors.values()) < high, errors


def _audio_rows() -> list:
    """The rows that run the audio tower and report its sites (a tokens-only engine that takes the clip
    holds none: its replay is tests/runtimes/test_litert_audio.py's); those of a third-party engine are slow."""
    return [
        pytest.param(s.name, id=s.name, marks=[pytest.mark.slow] if s.third_party else [])
        for s in R.RUNTIMES
        if s.runs_audio and not s.tokens_only
    ]


@pytest.mark.parametrize("name", _audio_rows())
def test_an_audio_replay_holds_exactly_the_sites_its_capture_map_declares(name, replays, towers):
    """As tests/runtimes/test_conformance.py on the short golden: the sites of the model (HF records
    them all) that the row's map declares, the audio tower's among them, and nothing else (the
    TOWER_ONLY rows: the audio sites their program reports, and the map's audio sites)."""
    spec = _need(name)
    with TraceReader(AUDIO) as a:
        model = set(a.kinds_present())
        layers = {t: info.layers for t, info in a.towers.items()}
        declared = {(s.key, s.layer) for s in spec.capture_map.sites(len(a.layers), layers)}
    want = declared & model
    if name in TOWER_ONLY:
        got, want = set(towers(name)), {(k, layer) for k, layer in want if k in AUDIO_KINDS}
    else:
        with TraceReader(replays(name)[0]) as b:
            got = set(b.kinds_present())
    assert {k for k, _ in want} >= AUDIO_KINDS
    assert got == want, (
        f"{name}: in its trace, not in its capture map: {sorted(got - want, key=str)}; "
        f"in its map, not in its trace: {sorted(want - got, key=str)}"
    )
