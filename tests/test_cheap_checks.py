"""Arguments that can be checked without a model are checked before one loads (issue 21):
a typo'd runtime, a missing extra, --isolate on a runtime without it, a bad MODULE:FACTORY."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from gemma4_trace.recorder import golden
from tests.support.cli import invoke, one_line_error

REF = str(golden.golden_path("short"))


@pytest.fixture
def no_model(monkeypatch):
    """Every model loader replaced by one that records being called."""
    import gemma4_trace.hf.model as hf_model
    import gemma4_trace.replayer.replay as replay

    calls = []

    def loader(*a, **k):
        calls.append(a)
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hf_model, "load_model", loader)
    monkeypatch.setattr(replay, "load_for_reference", loader)
    return calls


def _refused(args, needle, tmp_path):
    """`trace ARGS -o OUT`: the shared check of a refusal (tests/support/cli.py), nothing written at OUT."""
    out = tmp_path / "out.h5"
    return one_line_error(invoke(*args, "-o", out), needle, out=out)


def test_a_typo_in_runtime_is_refused_before_the_model_loads(no_model, tmp_path):
    line = _refused(["replay", REF, "--runtime", "statc"], "is not a runtime (did you mean 'static'?)", tmp_path)
    assert "static-w8" in line and "MODULE:FACTORY" in line
    _refused(["replay", REF, "--runtime", "static-w4"], "did you mean 'static-w8'?", tmp_path)
    assert no_model == []


def test_a_typo_is_refused_without_importing_torch(tmp_path):
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom gemma4_trace.cli import main\n"
        f"r = CliRunner().invoke(main, ['replay', {REF!r}, '--runtime', 'statc', '-o', {str(tmp_path / 'o.h5')!r}])\n"
        "print(r.exit_code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    assert out == ["2", "False", "False"]


def test_isolate_on_a_runtime_without_it_is_refused_first(no_model, tmp_path):
    for name in ("onnx", "tico", "tico-quant"):
        _refused(
            ["replay", REF, "--runtime", name, "--isolate"], f"runtime {name} does not support --isolate", tmp_path
        )
    assert no_model == []


def test_a_missing_extra_is_named_before_the_model_loads(no_model, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    gone = {"torchao", "onnxruntime", "tico", "accelerate", "onnxscript"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))
    _refused(
        ["replay", REF, "--runtime", "static-w8"],
        "--runtime static-w8 needs torchao, which is not installed: install the extra [quant] "
        "(from a checkout: pip install -e '.[quant]')",
        tmp_path,
    )
    _refused(
        ["replay", REF, "--runtime", "onnx"],
        "needs onnxruntime, onnxscript, which is not installed: install the extra [onnx] "
        "(from a checkout: pip install -e '.[onnx]')",
        tmp_path,
    )
    _refused(["replay", REF, "--runtime", "tico-quant"], "needs tico", tmp_path)
    _refused(["record", "--device-map", "auto"], "--device-map needs accelerate, which is not installed", tmp_path)
    r = invoke("export-onnx", "--max-seq", "16", "-o", str(tmp_path / "g"))
    assert r.exit_code == 2 and "trace export-onnx needs onnxruntime, onnxscript" in r.output, r.output
    assert no_model == []


def test_module_factory_syntax_and_module_are_checked_first(no_model, tmp_path, monkeypatch):
    _refused(["replay", REF, "--runtime", "my-pkg.rt:make"], "MODULE:FACTORY needs a dotted module name", tmp_path)
    _refused(["replay", REF, "--runtime", "pkg.rt:"], "MODULE:FACTORY needs", tmp_path)
    _refused(
        ["replay", REF, "--runtime", "no_such_pkg_21.rt:make"],
        "cannot import runtime plug-in module 'no_such_pkg_21.rt'",
        tmp_path,
    )
    assert no_model == []
    # a module in the current folder is found, as the replay imports it (then the model loads)
    (tmp_path / "my_rt_21.py").write_text("def make(loaded, max_seq):\n    raise RuntimeError('started')\n")
    monkeypatch.chdir(tmp_path)
    r = invoke("replay", REF, "--runtime", "my_rt_21:make", "-o", str(tmp_path / "o.h5"))
    assert r.exit_code == 2 and "a model was loaded" in r.output and no_model, r.output  # past the checks


def test_a_missing_model_folder_is_refused_before_torch(no_model, tmp_path):
    _refused(["replay", REF, "--model", str(tmp_path / "nope")], "does not exist", tmp_path)
    assert no_model == []
