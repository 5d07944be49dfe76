"""`--runtime mobius`: mobius-onnx's own ONNX Gemma 4 (extra gemma4-trace[mobius]), and the
cheap refusals of runtimes that cannot run (before the model loads or anything is exported)."""

import importlib.util

import numpy as np
import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer import artifacts
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

HAVE_MOBIUS = all(importlib.util.find_spec(m) for m in ("mobius", "onnxruntime", "onnx_ir"))
needs_mobius = pytest.mark.skipif(not HAVE_MOBIUS, reason="mobius-onnx is not installed (pip install -e '.[mobius]')")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Into one fresh cache: the short golden replayed twice, and two prompts with special ids
    recorded from HF and replayed (7 = begin-of-image, 12 = the audio placeholder)."""
    if not HAVE_MOBIUS:
        pytest.skip("mobius-onnx is not installed")
    tmp = tmp_path_factory.mktemp("mobius")
    cache, out = tmp / "cache", {}
    for i in range(2):
        out[f"short{i}"] = invoke(
            "replay", golden_path("short"), "--runtime", "mobius", "--cache-dir", cache, "-o", tmp / f"short{i}.h5"
        )
    for name, ids in (("boi", "2,100,7,200,300,400"), ("audio", "2,100,12,200,300,400")):
        rec = invoke("record", "--input-ids", ids, "--max-new-tokens", "2", "-o", tmp / f"{name}.h5")
        assert rec.exit_code == 0, rec.output
        out[name] = invoke(
            "replay", tmp / f"{name}.h5", "--runtime", "mobius", "--cache-dir", cache, "-o", tmp / f"m_{name}.h5"
        )
    artifacts.configure()
    return tmp, cache, out


@needs_mobius
def test_mobius_matches_hf_on_the_short_golden(runs):
    from gemma4_trace.diff import diff_traces

    tmp, _, out = runs
    assert out["short0"].exit_code == 0, out["short0"].output
    assert "3/3 tokens agree" in out["short0"].output
    res = diff_traces(golden_path("short"), tmp / "short0.h5")
    assert res.match, res.to_json()["first_divergence"]
    with TraceReader(golden_path("short")) as ref, TraceReader(tmp / "short0.h5") as run:
        assert run.provenance["runtime"] == "mobius (mobius-onnx 0.1.0, onnxruntime 1.32.0, CPU)"
        got = set(run.kinds_present())  # its capture map's sites (tests/runtimes/test_conformance.py)
        worst = 0.0
        # an independent implementation: float32-rounding-sized differences only
        for kind, layer in got - {("token", None)}:
            x, y = ref.read(kind, layer).astype(np.float64), run.read(kind, layer)
            assert x.shape == y.shape, (kind, layer)
            worst = max(worst, np.linalg.norm(x - y) / np.linalg.norm(x))
        assert 1e-8 < worst < 1e-5, worst


@needs_mobius
def test_second_replay_uses_the_cached_graph(runs):
    tmp, cache, out = runs
    said = [out[f"short{i}"].stderr.count("building mobius's ONNX Gemma 4") for i in range(2)]
    assert said == [1, 0]
    assert len(list((cache / "mobius").iterdir())) == 1
    with TraceReader(tmp / "short0.h5") as a, TraceReader(tmp / "short1.h5") as b:
        for kind, layer in a.kinds_present():
            assert np.array_equal(a.read(kind, layer), b.read(kind, layer)), (kind, layer)
    for name in ("boi", "audio"):  # the other prompts ran the same cached graph
        assert out[name].exit_code == 0 and "building mobius" not in out[name].stderr


@needs_mobius
def test_the_audio_placeholder_is_embedded_as_itself_by_mobius(runs):
    """HF's Gemma4ForConditionalGeneration embeds a multimodal placeholder id (image, video,
    audio) as the pad token; mobius's text decoder embeds the audio placeholder (12) as token 12.
    Begin-of-image (7) is an ordinary token to both. docs/runtime-mobius.md tells the story."""
    import safetensors.numpy

    from gemma4_trace.diff import diff_traces
    from gemma4_trace.hf.model import embedded_model_dir

    tmp, _, _ = runs
    assert diff_traces(tmp / "boi.h5", tmp / "m_boi.h5").match
    first = diff_traces(tmp / "audio.h5", tmp / "m_audio.h5").to_json()["first_divergence"]
    assert (first["step"], first["kind"], first["position"]) == (0, "embeddings", 2)
    weights = safetensors.numpy.load_file(embedded_model_dir() / "model.safetensors")
    table = next(v for k, v in weights.items() if k.endswith("language_model.embed_tokens.weight"))
    scale = table.shape[1] ** 0.5
    with TraceReader(tmp / "audio.h5") as ref, TraceReader(tmp / "m_audio.h5") as run:
        e_ref, e_run = ref.read("embeddings", None), run.read("embeddings", None)
        np.testing.assert_allclose(e_ref[2], scale * table[0], rtol=1e-6)  # HF: the pad row
        np.testing.assert_allclose(e_run[2], scale * table[12], rtol=1e-6)  # mobius: the id's own row
        others = [p for p in range(len(e_ref)) if p != 2]
        np.testing.assert_allclose(e_run[others], e_ref[others], rtol=1e-6)


@needs_mobius
def test_an_image_prompt_is_refused(runs, tmp_path):
    _, cache, _ = runs  # the built graph is cached: the refusal is the only line
    res = invoke("replay", golden_path("image"), "--runtime", "mobius", "--cache-dir", cache, "-o", tmp_path / "run.h5")
    one_line_error(res, "takes token ids only", out=tmp_path / "run.h5")


# ---- refusals before slow work --------------------------------------------------------------


@pytest.fixture
def nothing_slow(monkeypatch):
    """Any model load, ONNX export or mobius build fails the test: a refusal must come first."""

    def refuse(*a, **k):
        raise AssertionError("slow work started before the refusal")

    monkeypatch.setattr("gemma4_trace.hf.model.load_model", refuse)
    monkeypatch.setattr("gemma4_trace.hf.model.load_for_reference", refuse, raising=False)
    for adapter in ("mobius", "onnx"):
        monkeypatch.setattr(f"gemma4_trace.replayer.runtimes.{adapter}.artifact_folder", refuse)


def _replay(tmp_path, *args):
    return invoke("replay", golden_path("short"), "-o", tmp_path / "run.h5", *args)


def test_isolate_is_refused_by_every_built_in_that_cannot(tmp_path, nothing_slow):
    from gemma4_trace.replayer.runtimes.registry import RUNTIMES

    names = [s.name for s in RUNTIMES if not s.isolation and all(importlib.util.find_spec(m) for m in s.needs)]
    assert {"onnx", "mobius"} <= set(names) or not HAVE_MOBIUS
    for name in names:
        res = _replay(tmp_path, "--runtime", name, "--isolate")
        one_line_error(res, f"runtime {name} does not support --isolate", out=tmp_path / "run.h5")


@pytest.mark.parametrize(
    "spec, words",
    [("mobious", ["is not a runtime", "did you mean 'mobius'"]), ("onxx", ["is not a runtime", "did you mean 'onnx'"])],
)
def test_an_unknown_runtime_is_refused(tmp_path, nothing_slow, spec, words):
    one_line_error(_replay(tmp_path, "--runtime", spec), *words, out=tmp_path / "run.h5")


@pytest.mark.parametrize("name, module", [("mobius", "mobius"), ("onnx", "onnxscript"), ("mobius", "onnx_ir")])
def test_a_missing_extra_is_refused(tmp_path, nothing_slow, monkeypatch, name, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    res = _replay(tmp_path, "--runtime", name)
    extra = "mobius" if name == "mobius" else "onnx"
    one_line_error(res, f"--runtime {name} needs {module}", f"install the extra [{extra}]", out=tmp_path / "run.h5")


def test_export_onnx_refuses_a_missing_extra_before_exporting(tmp_path, nothing_slow, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "onnxscript" else real(m, *a))
    one_line_error(invoke("export-onnx", "--max-seq", "16", "-o", tmp_path / "g"), "onnxscript")
    assert not (tmp_path / "g").exists()
