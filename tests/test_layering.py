"""Dependencies run one way (docs/design.md, "Layout"), checked on the source, not by convention.

    traces  <-  hf, diff, importer  <-  recorder (traces, hf), replayer (traces, hf)
            <-  analysis (all of them)  <-  gemma4_trace (CLI, plug-in)

Every import statement of every module is read with `ast` (also those inside functions,
which a runtime check of sys.modules would miss), resolved to its absolute name and
checked against the rules below. The CLI-level commands that must start fast are then
run in a subprocess to see that they really load no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("traces", "hf", "diff", "recorder", "replayer", "importer", "analysis")  # installed as gemma4_trace.<name>
# which library packages each may import (itself included)
MAY_IMPORT = {
    "traces": {"traces"},
    "hf": {"hf", "traces"},
    "diff": {"diff", "traces"},
    "recorder": {"recorder", "hf", "traces"},
    "replayer": {"replayer", "hf", "traces"},
    "importer": {"importer", "traces"},
    "analysis": {"analysis", "diff", "replayer", "recorder", "hf", "traces"},
}
NO_TORCH = (
    "traces",
    "diff",
    "importer",
)  # `trace diff` / `trace show` / `trace import` run where no model is installed
CLI_MODULES = (
    "gemma4_trace.cli",
    "gemma4_trace.commands",
    "gemma4_trace.options",
    "gemma4_trace.progress",
    "gemma4_trace.show",
    "gemma4_trace.pytest_plugin",
    "gemma4_trace.__main__",
)


def package_of(path: Path, root: Path) -> str:
    """The dotted package a source file's relative imports resolve against."""
    parts = list(path.relative_to(root).parts[:-1])
    if parts and parts[0] in LIBRARIES:
        parts = ["gemma4_trace", *parts]
    return ".".join(parts)


def from_module(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The absolute module a `from X import ...` names (relative levels resolved against the package)."""
    module = node.module or ""
    if node.level:
        base = package_of(path, root).split(".")
        base = base[: len(base) - (node.level - 1)]
        module = ".".join([*base, module] if module else base)
    return module


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every import in a file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, from_module(node, path, root), [a.name for a in node.names]))
        elif (  # __import__("x") / importlib.import_module("x") with a literal name
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("__import__", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            out.append((node.lineno, node.args[0].value, []))
    return out


def layering_violations(root: Path) -> list[str]:
    bad = []
    for lib in LIBRARIES:
        for path in sorted((root / lib).rglob("*.py")):
            for line, module, names in imports(path, root):
                where = f"{path.relative_to(root)}:{line} imports {module}"
                parts = module.split(".")
                if lib in NO_TORCH and parts[0] in ("torch", "transformers"):
                    bad.append(f"{where}: {lib}/ must not import torch or transformers")
                if any(module == m or module.startswith(m + ".") for m in CLI_MODULES):
                    bad.append(f"{where}: a library must not import the CLI layer")
                if module == "gemma4_trace" and "__version__" in names:
                    bad.append(f"{where} __version__: read importlib.metadata.version instead")
                if parts[0] == "gemma4_trace" and len(parts) > 1 and parts[1] in LIBRARIES:
                    if parts[1] not in MAY_IMPORT[lib]:
                        bad.append(f"{where}: {lib}/ may import only {sorted(MAY_IMPORT[lib])}")
    return bad


def bare_imports(root: Path) -> list[str]:
    skip = {".venv", "build", "dist"}
    bad = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        for line, module, _ in imports(path, root):
            if module.split(".")[0] in LIBRARIES:
                bad.append(f"{path.relative_to(root)}:{line} imports bare {module!r}; use gemma4_trace.{module}")
    return bad


def test_libraries_import_one_way():
    assert all(list((ROOT / lib).rglob("*.py")) for lib in LIBRARIES)  # the rules read something
    bad = layering_violations(ROOT)
    assert not bad, "\n".join(bad)


def test_no_bare_library_imports_anywhere():
    bad = bare_imports(ROOT)
    assert not bad, "\n".join(bad)


def test_the_checker_catches_each_rule(tmp_path):
    (tmp_path / "diff").mkdir()
    (tmp_path / "replayer").mkdir()
    (tmp_path / "diff" / "m.py").write_text(
        "def f():\n    import torch.nn\n"  # nested: still found
        "from ..recorder import record\n"
        "from gemma4_trace import __version__\n"
        "from gemma4_trace.progress import ProgressBar\n"
    )
    (tmp_path / "replayer" / "r.py").write_text("from gemma4_trace.recorder.record import record_trace\n")
    (tmp_path / "t.py").write_text("x = __import__('recorder.model')\nimport traces\n")
    bad = layering_violations(tmp_path)
    assert len(bad) == 5, bad
    for needle in (
        "import torch",
        "gemma4_trace.recorder: diff/",
        "__version__",
        "CLI layer",
        "gemma4_trace.recorder.record: replayer/",
    ):
        assert any(needle in b for b in bad), (needle, bad)
    found = sorted(b.split(" imports bare ")[1].split(";")[0] for b in bare_imports(tmp_path))
    assert found == ["'recorder.model'", "'traces'"]


HEAVY_CHECK = """
import sys
from gemma4_trace.cli import main
try:
    main(sys.argv[1:], prog_name="trace")
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'})
print("EXIT", code, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args", [["diff", "--help"], ["show", "GOLDEN"], ["show", "--hash", "GOLDEN"], ["diff", "GOLDEN", "GOLDEN"]]
)
def test_fast_commands_import_no_torch(args, tmp_path):
    from gemma4_trace.recorder.golden import golden_path

    args = [str(golden_path("short")) if a == "GOLDEN" else a for a in args]
    p = subprocess.run(
        [sys.executable, "-c", HEAVY_CHECK, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    last = p.stderr.strip().splitlines()[-1]
    assert last == "EXIT 0 HEAVY -", p.stdout + p.stderr
