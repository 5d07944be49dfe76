"""The registry of built-in runtimes (replayer/runtimes/registry.py) is the one place runtime facts
live: the README's table, the `--runtime` help, the early refusals and the adapters agree with it."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from gemma4_trace.replayer.runtimes import registry as R
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from tests.support import invoke

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_table_is_the_registrys():
    readme = (ROOT / "README.md").read_text()
    assert R.markdown_table() in readme, "the README follows the registry: python scripts/update_runtime_table.py"


def test_every_row_names_what_exists():
    from gemma4_trace.cli import main
    from gemma4_trace.diff.tolerances import profile_names

    for s in R.RUNTIMES:
        module, _, function = s.factory.partition(":")
        assert importlib.util.find_spec(module) is not None, s.name
        if all(importlib.util.find_spec(m) for m in s.needs):
            assert callable(getattr(importlib.import_module(module), function)), s.name
        assert s.doc is None or (ROOT / s.doc).is_file(), s.doc
        assert s.profile is None or s.profile in profile_names(), s.profile
        assert s.export is None or s.export in main.commands, s.export
        assert set(s.not_captured) <= set(S.KIND_NAMES), s.name
        assert s.extra is None or s.extra in _extras(), s.extra
        assert s.baseline is None or s.baseline.split()[0] in R.BY_NAME, s.baseline


def _extras() -> set[str]:
    from gemma4_trace.traces.inputs import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_the_gguf_types_are_llamacpps():
    pytest.importorskip("gguf")
    from gemma4_trace.replayer.runtimes.llamacpp.gguf_writer import GGUF_TYPES

    assert tuple(GGUF_TYPES) == R.BY_NAME["llama.cpp"].types == R.GGUF_TYPES


def test_the_replay_help_lists_every_runtime():
    from gemma4_trace.commands.replay import replay

    (option,) = [p for p in replay.params if p.name == "runtime"]
    for s in R.RUNTIMES:
        assert s.name in option.help, s.name
    assert "MODULE:FACTORY" in option.help
    assert "--runtime" in invoke("replay", "--help").output


@pytest.mark.parametrize(
    "text, name, gguf_type",
    [("static", "static", None), ("llama.cpp", "llama.cpp", "F32"), ("llama.cpp:Q4_K_M", "llama.cpp", "Q4_K_M")],
)
def test_the_runtime_text_is_parsed_once_into_a_choice(text, name, gguf_type):
    choice = R.parse_runtime(text)
    assert (choice.name, choice.type, choice.plugin, str(choice)) == (name, gguf_type, False, text)
    assert R.parse_runtime(choice) is choice
    plugin = R.parse_runtime("my_pkg.rt:make")
    assert plugin.plugin and plugin.spec is None and plugin.name == "my_pkg.rt:make"


@pytest.mark.parametrize(
    "text, words",
    [
        ("statc", "is not a runtime (did you mean 'static'?)"),
        ("llama.cpp:Q9", "unknown GGUF type 'Q9'"),
        ("onnx:", "--runtime 'onnx:': MODULE:FACTORY needs"),
        ("a-b.c:make", "MODULE:FACTORY needs a dotted module name"),
    ],
)
def test_a_bad_runtime_text_is_one_line(text, words):
    with pytest.raises(TraceToolError, match=words.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        R.parse_runtime(text)


def test_the_limits_of_a_runtime_are_refused_from_its_row():
    image = {"pixel_values": object()}
    for s in R.RUNTIMES:
        choice = R.parse_runtime(s.name)
        checks = [
            (s.text_only, dict(extra=image), "takes token ids only"),
            (s.float32_only, dict(dtype="bfloat16"), "runs in float32; REF was recorded in bfloat16"),
            (s.cpu_only, dict(device="cuda"), "runs on the CPU"),
        ]
        for refused, kw, words in checks:
            if refused:
                with pytest.raises(TraceToolError, match=words):
                    R.check_inputs(choice, **kw)
            else:
                R.check_inputs(choice, **kw)
    R.check_inputs(R.parse_runtime("my_pkg.rt:make"), extra=image, dtype="bfloat16", device="cuda")  # yours


def test_a_third_party_adapter_that_fails_to_start_is_one_line_naming_its_code(tmp_path, monkeypatch):
    """An adapter over another project's engine fails like a plug-in: one line naming where."""
    pytest.importorskip("onnxruntime")
    from gemma4_trace.recorder.golden import golden_path
    from tests.support import one_line_error

    def broken(loaded, max_seq, kinds=None):
        raise RuntimeError("no session today")

    monkeypatch.setattr("gemma4_trace.replayer.runtimes.onnx.OnnxRuntime", broken)
    out = tmp_path / "run.h5"
    line = one_line_error(invoke("replay", golden_path("short"), "--runtime", "onnx", "-o", out), out=out)
    assert line.startswith("error: runtime onnx failed to start at ") and "RuntimeError: no session today" in line
    assert "replayer/runtimes/onnx.py:" in line, line  # the adapter's line that failed


def test_the_capture_benchmark_measures_every_built_in_runtime_by_default():
    """benchmarks/bench_capture.py's default --runtimes: every registry row (llama.cpp at two
    types), then the --kinds selections docs/benchmarks.md names; each one parses to a choice."""
    from benchmarks.bench_capture import GGUF, every_runtime, parse

    names = every_runtime().split(",")
    choices = [parse(n) for n in names]
    assert {c.spec.name for c, _ in choices} == {s.name for s in R.RUNTIMES}
    assert {c.type for c, _ in choices if c.type} == set(GGUF)
    narrowed = {n for n, (_, kinds) in zip(names, choices) if kinds}
    assert {"litert:k+v", "llama.cpp:Q4_K_M:layer_out"} <= narrowed
    assert dict(zip(names, choices))["litert:k+v"][1] == ("k", "v")
