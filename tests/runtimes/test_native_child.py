"""Native engines in a child process (replayer/child.py): ONNX Runtime (`--runtime onnx`,
`mobius`) and ExecuTorch (`executorch`, `executorch-int8`) run there, so a crash inside them is
one line naming the runtime, the phase and the signal, exit 2, no trace left, no child left.

A real crash in an engine is hard to provoke on purpose: the child's test hook
(GEMMA4_TRACE_TEST_NATIVE_CRASH=PHASE) makes it kill itself with SIGSEGV when asked to work in
PHASE, the same death a fault in the engine's C++ is. Kept cheap: the ONNX replays run a 1-layer
random Gemma 4 (its export takes seconds); the ExecuTorch ones run programs lowered from a small
module (no Gemma lowering: those cost minutes), standing in for the cached .pte files."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[onnx]')")

from gemma4_trace.replayer import child as NC  # noqa: E402
from gemma4_trace.replayer.runtimes.executorch_engine import ENGINE as EXECUTORCH_ENGINE  # noqa: E402
from gemma4_trace.replayer.runtimes.onnx_engine import ENGINE as ORT_ENGINE  # noqa: E402
from gemma4_trace.replayer.runtimes.onnx_engine import SESSION as ORT_SESSION  # noqa: E402
from gemma4_trace.traces.errors import TraceToolError  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

PROMPT = "2,17,33,40"
MAX_SEQ = 8
HAVE_EXECUTORCH = all(__import__("importlib.util").util.find_spec(m) is not None for m in ("executorch", "torchao"))
needs_executorch = pytest.mark.skipif(not HAVE_EXECUTORCH, reason="executorch is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 1-layer random Gemma 4, a trace of it (3 generated tokens) and its ONNX graphs in the cache."""
    from tests.support import tiny_models

    d = tmp_path_factory.mktemp("native")
    model = tiny_models.build(
        d / "model", num_hidden_layers=1, layer_types=[tiny_models.F], num_kv_shared_layers=0, use_double_wide_mlp=False
    )
    ref = d / "ref.h5"
    res = invoke("record", "--model", model, "--input-ids", PROMPT, "--max-new-tokens", "3", "-o", ref)
    assert res.exit_code == 0, res.output
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.runtimes import onnx as OR

    OR.exported(load_model(model), MAX_SEQ).close()  # the graphs into the session's artifact cache, once
    return model, ref


@pytest.fixture
def engines(monkeypatch):
    """The engine children started meanwhile (to check that none is left behind)."""
    started = []
    real = NC.Child.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        started.append(self.proc.pid)

    monkeypatch.setattr(NC.Child, "__init__", init)
    return started


def _gone(pid: int) -> bool:
    """Exited and reaped: no process, not even a zombie, has the pid."""
    return not os.path.exists(f"/proc/{pid}")


def _replay(tiny, out, runtime):
    model, ref = tiny
    return invoke("replay", ref, "--model", model, "--runtime", runtime, "--max-seq", MAX_SEQ, "-o", out)


def _ort_label():
    import onnxruntime

    return f"onnx (onnxruntime {onnxruntime.__version__})"


@pytest.mark.parametrize("phase", ["loading", "prefill", "decode step 2"])
def test_an_onnxruntime_crash_is_one_line_naming_the_phase(tiny, tmp_path, monkeypatch, engines, phase):
    monkeypatch.setenv(NC.CRASH_ENV, phase)
    out = tmp_path / "run.h5"
    line = one_line_error(_replay(tiny, out, "onnx"), out=out)
    assert line == f"error: {_ort_label()} crashed in {phase}: killed by SIGSEGV", line
    assert not list(tmp_path.iterdir())  # no trace, no partial file
    assert len(engines) == 1 and _gone(engines[0]), engines


def test_without_the_hook_the_same_replay_runs_and_leaves_no_child(tiny, tmp_path, engines):
    out = tmp_path / "run.h5"
    res = _replay(tiny, out, "onnx")
    assert res.exit_code == 0 and "3/3 tokens agree" in res.output, res.output
    assert len(engines) == 1 and _gone(engines[0]), engines


def test_the_child_runs_a_session_bit_identically_to_one_in_process(tiny):
    """The same graph, inputs and session options in the child and here: the same bits."""
    import onnxruntime as ort

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer import functional as F
    from gemma4_trace.replayer.runtimes import onnx as OR

    loaded = load_model(tiny[0])
    host = F.FunctionalKV(loaded, MAX_SEQ)
    rng = np.random.default_rng(0)
    feeds = {n: a.cpu().numpy() for n, a in zip(F.PREFILL_INPUTS, host.prepare_prefill([2, 17, 33, 40], {}))}
    for n in F.cache_names(host):
        info = host.infos[int(n[1:3])]
        feeds[n] = rng.standard_normal((1, info.num_kv_heads, MAX_SEQ, info.head_dim), dtype=np.float32)
    art = OR.exported(loaded, MAX_SEQ)
    path = art.path / "prefill.onnx"
    engine = NC.Child("onnx (test)", ORT_ENGINE)
    try:
        (inputs, outputs) = engine.call("load", {"prefill": str(path)}, ORT_SESSION, phase="loading")[1]["prefill"]
        got = engine.call("run", "prefill", feeds, phase="prefill")[1]
        opts = ort.SessionOptions()
        opts.log_severity_level = ORT_SESSION["log_severity_level"]
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        want = sess.run(None, feeds)
    finally:
        engine.close()
        art.close()
    assert [i.name for i in sess.get_inputs()] == [n for n, _ in inputs]
    assert [o.name for o in sess.get_outputs()] == outputs and len(got) == len(want) > 10
    for name, a, b in zip(outputs, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert _gone(engine.proc.pid)


def test_an_error_the_engine_reports_is_one_line_and_the_child_lives_on(tiny):
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.runtimes import onnx as OR

    art = OR.exported(load_model(tiny[0]), MAX_SEQ)
    engine = NC.Child("onnx (test)", ORT_ENGINE)
    try:
        engine.call("load", {"decode": str(art.path / "decode.onnx")}, ORT_SESSION, phase="loading")
        with pytest.raises(TraceToolError) as e:
            engine.call("run", "decode", {"token": np.zeros((1, 1), dtype=np.int64)}, phase="decode step 1")
        assert str(e.value).startswith("onnx (test) failed in decode step 1: ValueError: Required inputs"), e.value
        assert "\n" not in str(e.value)
        with pytest.raises(TraceToolError, match=r"failed in loading: .*NoSuchFile"):
            engine.call("load", {"x": str(art.path / "missing.onnx")}, ORT_SESSION, phase="loading")
        assert engine.proc.poll() is None
    finally:
        engine.close()
        art.close()
    assert _gone(engine.proc.pid)


# ---- ExecuTorch: small stand-in programs, no Gemma lowering --------------------------------------------


@pytest.fixture(scope="module")
def pte(tmp_path_factory):
    """A small float program lowered to XNNPACK (a linear layer, GELU, a sum): a few seconds."""
    if not HAVE_EXECUTORCH:
        pytest.skip("executorch is not installed")
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(16, 32)

        def forward(self, x, y):
            h = torch.nn.functional.gelu(self.lin(x))
            return h, h.sum(-1) + y

    example = (torch.randn(4, 16), torch.randn(4))
    program = torch.export.export(Small().eval(), example, strict=False)
    d = tmp_path_factory.mktemp("pte")
    path = d / "small.pte"
    path.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    return path


@needs_executorch
def test_the_child_runs_an_executorch_program_bit_identically_to_one_in_process(pte):
    import torch
    from executorch.runtime import Runtime

    x = np.random.default_rng(1).standard_normal((4, 16), dtype=np.float32)
    y = np.arange(4, dtype=np.float32)
    engine = NC.Child("executorch (test)", EXECUTORCH_ENGINE)
    try:
        engine.call("load", {"small": str(pte)}, {}, phase="loading")
        got = engine.call("run", "small", [x, y], phase="prefill")[1]
    finally:
        engine.close()
    method = Runtime.get().load_program(pte).load_method("forward")
    want = [t.clone().numpy() for t in method.execute([torch.from_numpy(x), torch.from_numpy(y)])]
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert _gone(engine.proc.pid)


@needs_executorch
@pytest.mark.parametrize(("runtime", "phase"), [("executorch", "prefill"), ("executorch-int8", "loading")])
def test_an_executorch_crash_is_one_line_naming_the_phase(tiny, pte, tmp_path, monkeypatch, engines, runtime, phase):
    """The runtime loads stand-in programs from a fake cache entry (the crash comes before any runs).
    executorch-int8 loads at the first prefill, after calibrating on its prompt: `loading`."""
    import shutil

    from gemma4_trace.replayer.artifacts import Artifact
    from gemma4_trace.replayer.runtimes import executorch as ET

    folder = tmp_path / "programs"
    folder.mkdir()
    for n in ET.PROGRAMS:
        shutil.copyfile(pte, folder / f"{n}.pte")
    monkeypatch.setattr(ET, "cached_programs", lambda *a, **k: Artifact(folder, "cached"))
    monkeypatch.setenv(NC.CRASH_ENV, phase)
    out = tmp_path / "run.h5"
    line = one_line_error(_replay(tiny, out, runtime), out=out)
    version = ET._versions()["executorch"]
    assert line == f"error: {runtime} (ExecuTorch {version}, XNNPACK) crashed in {phase}: killed by SIGSEGV", line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["programs"]  # no trace, no partial file
    assert len(engines) == 1 and _gone(engines[0]), engines


@needs_executorch
def test_the_reference_runs_in_process(tiny, tmp_path, monkeypatch, engines):
    """executorch-int8-reference runs PyTorch (no native engine): no child, and the hook is moot."""
    monkeypatch.setenv(NC.CRASH_ENV, "prefill")
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.runtimes import executorch as ET

    rt = ET.ExecuTorchRuntime(load_model(tiny[0]), MAX_SEQ, "executorch-int8-reference")
    assert rt.child is None and engines == []
