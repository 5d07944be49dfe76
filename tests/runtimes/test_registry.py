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
from tests.support.cli import invoke

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
        assert s.export is None or s.export.alias in main.commands, s.export
        for where in (s.export and s.export.function, s.recipe):  # the facets' functions exist
            if where and all(importlib.util.find_spec(m) for m in s.needs):
                module, _, function = where.partition(":")
                assert callable(getattr(importlib.import_module(module), function)), where
        assert set(s.not_captured) <= set(S.KIND_NAMES), s.name
        assert s.extra is None or s.extra in _extras(), s.extra
        assert s.baseline is None or s.baseline.runtime in R.BY_NAME, s.baseline
        assert s.baseline is None or s.baseline.weights is None or s.baseline.weights in [f.option for f in R.FILES]


def _extras() -> set[str]:
    from gemma4_trace.traces.inputs import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_the_gguf_types_are_llamacpps():
    pytest.importorskip("gguf")
    from gemma4_trace.replayer.runtimes.llamacpp.gguf_writer import GGUF_TYPES

    assert tuple(GGUF_TYPES) == R.BY_NAME["llama.cpp"].types


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
    from tests.support.cli import one_line_error

    def broken(loaded, max_seq, kinds=None):
        raise RuntimeError("no session today")

    monkeypatch.setattr("gemma4_trace.replayer.runtimes.onnx.OnnxRuntime", broken)
    out = tmp_path / "run.h5"
    line = one_line_error(invoke("replay", golden_path("short"), "--runtime", "onnx", "-o", out), out=out)
    assert line.startswith("error: runtime onnx failed to start at ") and "RuntimeError: no session today" in line
    assert "replayer/runtimes/onnx.py:" in line, line  # the adapter's line that failed


def test_the_capture_benchmark_measures_every_built_in_runtime_by_default():
    """benchmarks/bench_capture.py's default --runtimes: every registry row that runs E2B's decoder (the
    model it measures on: RuntimeSpec.decoders), llama.cpp at two types, then the --kinds selections
    docs/benchmarks.md names; each one parses to a choice."""
    from benchmarks.bench_capture import GGUF, every_runtime, parse

    names = every_runtime().split(",")
    choices = [parse(n) for n in names]
    e2b = {"text_config": {"num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256}}
    assert {c.spec.name for c, _ in choices} == {
        s.name for s in R.RUNTIMES if not (s.decoders and s.decoders.lacks(e2b))
    }
    assert {c.type for c, _ in choices if c.type} == set(GGUF)
    narrowed = {n for n, (_, kinds) in zip(names, choices) if kinds}
    assert {"litert:k+v", "llama.cpp:Q4_K_M:layer_out"} <= narrowed
    assert dict(zip(names, choices))["litert:k+v"][1] == ("k", "v")


def test_every_family_declares_its_rows_in_its_own_spec_module():
    """A family's rows live beside its adapter (NAME_spec.py, or spec.py in its package); the
    registry finds every one, and its table is theirs in ORDER."""
    here = ROOT / "replayer" / "runtimes"
    files = sorted([*here.glob("*_spec.py"), *here.glob("*/spec.py")])
    assert sorted(Path(m.__file__) for m in R.FAMILIES) == files
    assert [m.ORDER for m in R.FAMILIES] == sorted({m.ORDER for m in R.FAMILIES})
    assert R.RUNTIMES == tuple(s for m in R.FAMILIES for s in m.RUNTIMES)
    assert {f.runtime for f in R.FILES} <= set(R.BY_NAME)


RUNTIME_NAME_CALLS = ("startswith", "endswith", "removeprefix", "partition")


def runtime_name_tests(path: Path, names: set[str]) -> list[str]:
    """Where `path` compares a value with a built-in runtime's name (==, !=, in, startswith, ...):
    a fact about one runtime that belongs in its registry row."""
    import ast

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.rstrip(":") in names

    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        operands = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            operands += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in RUNTIME_NAME_CALLS:
            operands = list(node.args)
        bad += [f"{path.name}:{node.lineno} tests the name {o.value!r}" for o in operands if named(o)]
    return bad


def test_no_runtime_name_is_tested_outside_the_runtimes_wing(tmp_path):
    """`choice.name != "litert-lm"`, `runtime.startswith("llama.cpp:")`: a runtime's facts are its
    row's facets; only the families' own modules (replayer/runtimes/) may name themselves."""
    names = set(R.BY_NAME)
    bad = []
    for top in ("analysis", "diff", "gemma4_trace", "hf", "importer", "recorder", "replayer", "traces"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "runtimes" not in path.relative_to(ROOT).parts:
                bad += runtime_name_tests(path, names)
    assert not bad, "\n".join(bad)
    planted = tmp_path / "planted.py"
    planted.write_text('if rt == "litert-lm" or text.startswith("llama.cpp:") or name in ("static", "x"):\n    pass\n')
    assert len(runtime_name_tests(planted, names)) == 3


def test_export_takes_any_runtime_that_builds_artifacts_and_refuses_the_rest_in_one_line(tmp_path):
    from tests.support.cli import one_line_error

    assert "--runtime TEXT" in invoke("export", "--help").output
    for args, words in (
        (("--runtime", "static"), "--runtime static builds no artifacts to export; these do: onnx, llama.cpp"),
        (("--runtime", "onnx"), "--runtime onnx needs --max-seq N"),
        (("--runtime", "llama.cpp", "--max-seq", "8"), "--runtime llama.cpp takes no --max-seq"),
        (("--runtime", "openvino", "--max-seq", "8", "--calibrate", "x.h5"), "openvino takes no --calibrate"),
    ):
        line = one_line_error(invoke("export", *args, "-o", tmp_path / "out"))
        assert words in line, line


def test_export_and_its_alias_write_the_same_file(tmp_path):
    """`trace export --runtime llama.cpp:F32` is what `trace export-gguf` writes (one cache entry)."""
    pytest.importorskip("gguf")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first = invoke("export", "--runtime", "llama.cpp:F32", "-o", a, "--cache-dir", tmp_path / "cache")
    second = invoke("export-gguf", "-o", b, "--cache-dir", tmp_path / "cache")
    assert first.exit_code == second.exit_code == 0, (first.output, second.output)
    assert a.read_bytes() == b.read_bytes() and a.stat().st_size > 0
    assert "F32" in first.output and "cached" in second.output
