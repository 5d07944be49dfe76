"""The shape of the production code, checked on the source (docs/design.md, "The runtimes wing"):

- no module imports a private name (`_x`) of another module;
- replayer/ (with replayer/runtimes/) has no import cycle;
- no adapter (replayer/runtimes/) imports the replay driver (replay.py, core.py);
- no function over 80 lines, no module over 600 lines, no command module over 200 lines.

Each checker is shown to catch a planted violation (as tests/test_layering.py does)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layering import LIBRARIES, ROOT, imports

PRODUCTION = (*LIBRARIES, "gemma4_trace")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
MAX_COMMAND_LINES = 200
DRIVER = ("gemma4_trace.replayer.replay", "gemma4_trace.replayer.core")


def sources(root: Path):
    for top in PRODUCTION:
        yield from sorted((root / top).rglob("*.py")) if (root / top).is_dir() else ()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "gemma4_trace" else ["gemma4_trace", *parts])


def private_imports(root: Path) -> list[str]:
    bad = []
    for path in sources(root):
        here = module_name(path, root)
        for line, module, names in imports(path, root):
            if not module.startswith("gemma4_trace") or module == here:
                continue
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{path.relative_to(root)}:{line} imports {module}.{name}, a private name")
            if module.rpartition(".")[2].startswith("_"):
                bad.append(f"{path.relative_to(root)}:{line} imports {module}, a private module")
    return bad


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (at any depth)."""
    mods = {module_name(p, root): p for p in sources(root)}
    mods = {m: p for m, p in mods.items() if m == package or m.startswith(package + ".")}
    graph = {}
    for m, p in mods.items():
        out = set()
        for _, module, names in imports(p, root):
            for target in (module, *(f"{module}.{n}" for n in names)):
                if target in mods and target != m:
                    out.add(target)
        graph[m] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def adapter_driver_imports(root: Path) -> list[str]:
    bad = []
    for path in sorted((root / "replayer" / "runtimes").rglob("*.py")):
        for line, module, names in imports(path, root):
            targets = (module, *(f"{module}.{n}" for n in names))
            if any(t in DRIVER for t in targets):
                bad.append(f"{path.relative_to(root)}:{line} imports the replay driver ({module})")
    return bad


def oversized(root: Path) -> list[str]:
    bad = []
    for path in sources(root):
        text = path.read_text()
        n = len(text.splitlines())
        limit = MAX_COMMAND_LINES if path.parent.name == "commands" else MAX_MODULE_LINES
        if n > limit:
            bad.append(f"{path.relative_to(root)}: {n} lines, more than {limit}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {length} lines")
    return bad


def test_no_private_name_is_imported_across_modules():
    bad = private_imports(ROOT)
    assert not bad, "\n".join(bad)


def test_the_replayer_has_no_import_cycle():
    graph = import_graph(ROOT, "gemma4_trace.replayer")
    assert len(graph) > 10 and any(graph.values())  # the graph was read
    assert not cycles(graph), cycles(graph)


def test_no_adapter_imports_the_replay_driver():
    assert list((ROOT / "replayer" / "runtimes").rglob("*.py"))
    bad = adapter_driver_imports(ROOT)
    assert not bad, "\n".join(bad)


def test_no_function_module_or_command_is_oversized():
    bad = oversized(ROOT)
    assert not bad, "\n".join(bad)


def test_the_checkers_catch_each_violation(tmp_path):
    (tmp_path / "replayer" / "runtimes").mkdir(parents=True)
    (tmp_path / "gemma4_trace" / "commands").mkdir(parents=True)
    (tmp_path / "replayer" / "a.py").write_text("from .b import helper\nfrom .c import _private\n")
    (tmp_path / "replayer" / "b.py").write_text("def helper():\n    from . import a\n")
    (tmp_path / "replayer" / "c.py").write_text("def _private():\n    pass\n")
    (tmp_path / "replayer" / "runtimes" / "x.py").write_text("from ..core import make_runtime\n")
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "gemma4_trace" / "commands" / "big.py").write_text(f"def f():\n{long_body}" + "\n" * 150)
    assert private_imports(tmp_path) == ["replayer/a.py:2 imports gemma4_trace.replayer.c._private, a private name"]
    assert cycles(import_graph(tmp_path, "gemma4_trace.replayer")) == [
        ["gemma4_trace.replayer.a", "gemma4_trace.replayer.b"]
    ]
    assert adapter_driver_imports(tmp_path) == [
        "replayer/runtimes/x.py:1 imports the replay driver (gemma4_trace.replayer.core)"
    ]
    assert oversized(tmp_path) == [
        f"gemma4_trace/commands/big.py: {MAX_FUNCTION_LINES + 151} lines, more than {MAX_COMMAND_LINES}",
        f"gemma4_trace/commands/big.py:1 f: {MAX_FUNCTION_LINES + 1} lines",
    ]
