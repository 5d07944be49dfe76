"""The shape of the production code, checked on the source (docs/design.md, "The runtimes wing"):

- no module imports a private name (`_x`) of another module, nor reaches one through a module it
  imported (`E._x` after `from . import export as E`);
- no package (subpackages, gemma4_trace/ and gemma4_trace/commands/ included) has an import cycle,
  nor has the project across its packages;
- no adapter (replayer/runtimes/) imports the replay driver (replay.py, core.py);
- no function over 80 lines, no class over 300, no module over 600 lines, no command module over 200
  lines; and none within 5% of its limit (a module of 571 lines, a function of 77): a piece near its
  cap is split before the next edit pushes it over;
- the trace vocabulary stays in traces/: no module outside it compares a kind's row index with a
  literal ("position", "step", ...), reads a kind's per-layer flag, or writes a "tensors/..." path
  (schema.Site composes and parses them: `parse(path(site)) == site` for every site of the
  shipped model);
- nothing is unpickled from an input: no `weights_only` but True, no `allow_pickle` but False, and
  no unpickling call (`pickle.loads`, `torch.load`, `torch.export.load`, ...) but the two of
  UNPICKLING_ALLOWED, neither of which reads a user's file.

Each checker is shown to catch a planted violation (as tests/test_layering.py does)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layering import LIBRARIES, ROOT, from_module, imports

PRODUCTION = (*LIBRARIES, "gemma4_trace")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
MAX_COMMAND_LINES = 200
MAX_CLASS_LINES = 300
MARGIN_PERCENT = 5  # the share of each limit kept free (test_every_size_keeps_its_margin)
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
    modules = {module_name(p, root) for p in sources(root)}
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
        bad += private_attributes(path, root, modules)
    return bad


def module_aliases(tree: ast.AST, path: Path, root: Path, modules: set[str]) -> dict[str, str]:
    """name -> the project module an import binds it to (`import a.b as E`, `from . import b as E`,
    `from a import b`; `import a.b` binds `a`), at any depth of the file."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:  # `import a.b` binds `a`: `a.b._x` is resolved through it
                    bound = a.asname or a.name.split(".")[0]
                    out[bound] = a.name if a.asname else bound
        elif isinstance(node, ast.ImportFrom):
            base = from_module(node, path, root)
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def private_attributes(path: Path, root: Path, modules: set[str]) -> list[str]:
    """`E._x` where E names another project module (an import's alias, or a chain from one)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = module_aliases(tree, path, root, modules)
    here = module_name(path, root)
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        chain = dotted(node.value)
        if chain is None or chain.split(".")[0] not in aliases:
            continue
        head, _, rest = chain.partition(".")
        module = ".".join([aliases[head], rest] if rest else [aliases[head]])
        if module in modules and module != here:
            bad.append(f"{path.relative_to(root)}:{node.lineno} reaches {module}.{node.attr}, a private name")
    return bad


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (at any depth). `from P import m` of a submodule
    `m` is an edge to P.m alone: P, an ancestor of the importer, is always initialized before it, and
    a package's __init__ importing its submodules is no cycle. `from P import name` of anything else
    is an edge to P itself (a module of P that takes a name from P's __init__ while that __init__
    imports it is a cycle)."""
    mods = {module_name(p, root): p for p in sources(root)}
    mods = {m: p for m, p in mods.items() if m == package or m.startswith(package + ".")}
    graph = {}
    for m, p in mods.items():
        out = set()
        for _, module, names in imports(p, root):
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in mods]
            targets = subs if subs and len(subs) == len(names) else [module, *subs]
            out.update(t for t in targets if t in mods and t != m)
        graph[m] = out
    return graph


def packages(root: Path) -> list[str]:
    """Every package of the production code, subpackages included: the folders its modules are in."""
    return sorted({module_name(p.parent / "__init__.py", root) for p in sources(root)})


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


def sizes(root: Path):
    """(what, lines, limit) for every module (a command module's limit is its own), function and
    class of the production code; a function or class is named by its file, line and name."""
    for path in sources(root):
        text, rel = path.read_text(), path.relative_to(root)
        yield (
            f"{rel}",
            len(text.splitlines()),
            MAX_COMMAND_LINES if path.parent.name == "commands" else MAX_MODULE_LINES,
        )
        for node in ast.walk(ast.parse(text)):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{rel}:{node.lineno} {node.name}", length, MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                yield f"{rel}:{node.lineno} class {node.name}", length, MAX_CLASS_LINES


def oversized(root: Path) -> list[str]:
    return [f"{what}: {n} lines, more than {limit}" for what, n, limit in sizes(root) if n > limit]


def margin_of(limit: int) -> int:
    """The most lines a piece with this limit may have and keep its margin: 570 of 600, 76 of 80."""
    return limit * (100 - MARGIN_PERCENT) // 100


def near_limit(root: Path) -> list[str]:
    return [
        f"{what}: {n} lines, within {MARGIN_PERCENT}% of its limit {limit} (at most {margin_of(limit)})"
        for what, n, limit in sizes(root)
        if n > margin_of(limit)
    ]


ROW_INDEX_WORDS = {"position", "step", "patch", "frame", "soft_token"}  # traces.schema.ROW_INDEXES


def _text_start(node: ast.AST) -> str | None:
    """The leading text of a string constant or f-string (an absolute HDF5 path's without its '/')."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lstrip("/")
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value).lstrip("/")
    return None


def _texts(node: ast.AST) -> set:
    """The texts a comparison's side holds: itself, or a tuple, list or set of them (`in (...)`)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {_text_start(x) for x in items}


def _is_index(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "index") or (
        isinstance(node, ast.Name) and node.id == "index"
    )


def vocabulary_leaks(root: Path) -> list[str]:
    """Row-index literal comparisons, per-layer flag reads and tensors/ paths outside traces/ (by line)."""
    bad = []
    for path in sources(root):
        rel = path.relative_to(root)
        if rel.parts[0] == "traces":
            continue
        tree = ast.parse(path.read_text())
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # an f-string's
        for node in ast.walk(tree):
            if id(node) in parts:
                continue
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                words = set().union(*(_texts(x) for x in sides)) & ROW_INDEX_WORDS
                if words and any(_is_index(x) for x in sides):
                    bad.append(f"{where} compares a row index with {sorted(words)[0]!r}")
            elif (isinstance(node, ast.Attribute) and node.attr == "per_layer") or (
                isinstance(node, ast.Call) and any(_text_start(a) == "per_layer" for a in node.args[1:2])
            ):
                bad.append(f"{where} reads a kind's per_layer flag")
            elif (_text_start(node) or "").startswith("tensors/"):
                bad.append(f"{where} writes a tensors/ path")
    return sorted(bad, key=lambda x: (x.split(":")[0], int(x.split(":")[1].split()[0])))  # stable: by file, line


UNPICKLERS = {"pickle.load", "pickle.loads", "torch.load", "torch.export.load", "marshal.loads", "joblib.load"}
UNPICKLERS |= {"dill.load", "dill.loads", "cloudpickle.loads", "shelve.open", "pickle.Unpickler"}
UNPICKLING_ALLOWED = {  # (file, call): why what it reads is not an input
    ("replayer/child.py", "pickle.loads"): "the child protocol: replies from the tool's own child process",
    ("replayer/runtimes/executorch.py", "torch.export.load"): "the tool's own converted programs, hash-checked",
}
SAFE_KEYWORDS = {"weights_only": True, "allow_pickle": False}


def unpickling(root: Path) -> list[str]:
    """Every call that could unpickle what it reads, but those UNPICKLING_ALLOWED (by its dotted name
    as written: `torch.load(...)`, `pickle.loads(...)`)."""
    bad = []
    for path in sources(root):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            for k in node.keywords:
                want = SAFE_KEYWORDS.get(k.arg or "", k.value)
                if k.value is not want and not (isinstance(k.value, ast.Constant) and k.value.value is want):
                    bad.append(f"{rel}:{node.lineno} passes {k.arg}={ast.unparse(k.value)}")
            if name in UNPICKLERS and (rel, name) not in UNPICKLING_ALLOWED:
                bad.append(f"{rel}:{node.lineno} calls {name}")
    return bad


def test_nothing_is_unpickled_from_an_input():
    bad = unpickling(ROOT)
    assert not bad, "\n".join(bad)


def test_the_unpickling_checker_catches_each_call(tmp_path):
    (tmp_path / "replayer").mkdir()
    (tmp_path / "replayer" / "child.py").write_text("import pickle\npickle.loads(b'')\n")  # allowed
    (tmp_path / "replayer" / "g.py").write_text(
        "import pickle, torch, numpy as np\n\n\ndef f(p, w):\n    torch.load(p, weights_only=False)\n"
        "    torch.load(p, weights_only=w)\n    torch.load(p, weights_only=True)\n    pickle.load(p)\n"
        "    np.load(p, allow_pickle=True)\n    np.load(p, allow_pickle=False)\n    torch.export.load(p)\n"
    )
    assert unpickling(tmp_path) == [
        "replayer/g.py:5 passes weights_only=False",
        "replayer/g.py:5 calls torch.load",
        "replayer/g.py:6 passes weights_only=w",
        "replayer/g.py:6 calls torch.load",
        "replayer/g.py:7 calls torch.load",
        "replayer/g.py:8 calls pickle.load",
        "replayer/g.py:9 passes allow_pickle=True",
        "replayer/g.py:11 calls torch.export.load",
    ]


def test_the_trace_vocabulary_stays_in_traces():
    bad = vocabulary_leaks(ROOT)
    assert not bad, "\n".join(bad)


def test_every_site_of_the_shipped_model_parses_back():
    import json

    from gemma4_trace.traces import schema as S
    from gemma4_trace.traces.layers import tower_sizes

    config = json.loads((ROOT / "hf" / "tiny_model" / "config.json").read_text())
    counts = {S.TEXT: config["text_config"]["num_hidden_layers"]}
    for tower in S.TOWERS:
        sizes = tower_sizes(config, tower) if tower.name != S.TEXT else None
        if sizes is not None:
            counts[tower.name] = sizes["layers"]
    assert set(counts) == {"text", "vision"}  # the tiny model has no audio tower: absent, never empty
    sites = S.dataflow(counts)
    # text: 9 global kinds + 6 kinds in each of 8 layers; vision: 3 global + 6 in each of 2 layers
    assert len(sites) == len({s.path for s in sites}) == 9 + 6 * 8 + 3 + 6 * 2
    for site in sites:
        assert S.Site.parse(site.path) == site, site
        assert S.Site.of(site.key, site.layer) == site


def test_no_private_name_is_imported_across_modules():
    bad = private_imports(ROOT)
    assert not bad, "\n".join(bad)


def test_no_package_has_an_import_cycle():
    """The project's whole graph: a cycle inside any package (or across packages) is one in it."""
    found = packages(ROOT)
    wanted = {f"gemma4_trace.{lib}" for lib in LIBRARIES}
    wanted |= {"gemma4_trace", "gemma4_trace.commands", "gemma4_trace.replayer.runtimes"}
    assert wanted <= set(found), sorted(wanted - set(found))
    graph = import_graph(ROOT, "gemma4_trace")
    assert all(any(m.startswith(pkg + ".") for m in graph) for pkg in found)  # every package was read
    assert len(graph) > 100 and any(graph.values())
    assert not cycles(graph), cycles(graph)


def test_no_adapter_imports_the_replay_driver():
    assert list((ROOT / "replayer" / "runtimes").rglob("*.py"))
    bad = adapter_driver_imports(ROOT)
    assert not bad, "\n".join(bad)


def test_no_function_class_module_or_command_is_oversized():
    bad = oversized(ROOT)
    assert not bad, "\n".join(bad)


def test_every_size_keeps_its_margin():
    """Every module, command module, function and class keeps 5% of its limit free (modules at most
    570 lines, command modules 190, functions 76, classes 285); every offender in one message."""
    assert (margin_of(MAX_MODULE_LINES), margin_of(MAX_COMMAND_LINES)) == (570, 190)
    assert (margin_of(MAX_FUNCTION_LINES), margin_of(MAX_CLASS_LINES)) == (76, 285)
    bad = near_limit(ROOT)
    assert not bad, f"{len(bad)} near their limit (split them):\n" + "\n".join(bad)


def test_the_checkers_catch_each_violation(tmp_path):
    (tmp_path / "replayer" / "runtimes").mkdir(parents=True)
    (tmp_path / "gemma4_trace" / "commands").mkdir(parents=True)
    (tmp_path / "replayer" / "a.py").write_text("from .b import helper\nfrom .c import _private\n")
    (tmp_path / "replayer" / "b.py").write_text("def helper():\n    from . import a\n")
    (tmp_path / "replayer" / "c.py").write_text("def _private():\n    pass\n")
    (tmp_path / "replayer" / "d.py").write_text(
        "from . import c as C\nimport gemma4_trace.replayer.c\n\n\ndef f(self):\n"
        "    C._private()\n    gemma4_trace.replayer.c._private()\n    C.public(self._mine, C.__name__)\n"
    )
    (tmp_path / "replayer" / "runtimes" / "x.py").write_text("from ..core import make_runtime\n")
    (tmp_path / "diff").mkdir()
    (tmp_path / "diff" / "v.py").write_text(
        "def f(spec, index, layer, e):\n    if spec.index == 'step' or 'position' != index:\n"
        "        return spec.per_layer, f'tensors/L{layer:02d}/q', 'tensors/logits'\n"
        "    return e.rows == 'step', spec.index is None, 'the tensors/ group'\n"
        "def g(spec, index):\n    if index in ('patch', 'frame'):\n"
        "        return getattr(spec, 'per_layer'), '/tensors/logits'\n"
    )
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "s.py").write_text("def f(spec):\n    return spec.per_layer, spec.index == 'step'\n")
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "gemma4_trace" / "commands" / "big.py").write_text(f"def f():\n{long_body}" + "\n" * 150)
    (tmp_path / "diff" / "k.py").write_text("class K:\n" + "    y = 0\n" * MAX_CLASS_LINES)
    assert private_imports(tmp_path) == [
        "replayer/a.py:2 imports gemma4_trace.replayer.c._private, a private name",
        "replayer/d.py:6 reaches gemma4_trace.replayer.c._private, a private name",
        "replayer/d.py:7 reaches gemma4_trace.replayer.c._private, a private name",
    ]
    assert cycles(import_graph(tmp_path, "gemma4_trace.replayer")) == [
        ["gemma4_trace.replayer.a", "gemma4_trace.replayer.b"]
    ]
    assert adapter_driver_imports(tmp_path) == [
        "replayer/runtimes/x.py:1 imports the replay driver (gemma4_trace.replayer.core)"
    ]
    assert vocabulary_leaks(tmp_path) == [
        "diff/v.py:2 compares a row index with 'step'",
        "diff/v.py:2 compares a row index with 'position'",
        "diff/v.py:3 reads a kind's per_layer flag",
        "diff/v.py:3 writes a tensors/ path",
        "diff/v.py:3 writes a tensors/ path",
        "diff/v.py:6 compares a row index with 'frame'",
        "diff/v.py:7 reads a kind's per_layer flag",
        "diff/v.py:7 writes a tensors/ path",
    ]
    assert oversized(tmp_path) == [
        f"diff/k.py:1 class K: {MAX_CLASS_LINES + 1} lines, more than {MAX_CLASS_LINES}",
        f"gemma4_trace/commands/big.py: {MAX_FUNCTION_LINES + 151} lines, more than {MAX_COMMAND_LINES}",
        f"gemma4_trace/commands/big.py:1 f: {MAX_FUNCTION_LINES + 1} lines, more than {MAX_FUNCTION_LINES}",
    ]


def test_the_margin_checker_names_every_piece_near_its_limit(tmp_path):
    """A module, a function, a class and a command module each one line past their margin are named,
    all in one list; the same pieces at their margin exactly (a class of methods at theirs) are not."""
    for folder in ("traces", "hf", "diff", "gemma4_trace/commands"):
        (tmp_path / folder).mkdir(parents=True)
    module, function, klass, command = (
        margin_of(n) for n in (MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES, MAX_COMMAND_LINES)
    )

    def func(name: str, lines: int, indent: str = "") -> str:
        return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))

    def cls(name: str, lines: int) -> str:  # a method at its own margin, then plain lines
        return f"class {name}:\n" + func("m", function, "    ") + "    y = 0\n" * (lines - 1 - function)

    (tmp_path / "traces" / "ok.py").write_text("\n" * module)
    (tmp_path / "traces" / "near.py").write_text("\n" * (module + 1))
    (tmp_path / "hf" / "f.py").write_text(func("fine", function) + func("long", function + 1))
    (tmp_path / "diff" / "fine.py").write_text(cls("Fine", klass))
    (tmp_path / "diff" / "long.py").write_text(cls("Long", klass + 1))
    (tmp_path / "gemma4_trace" / "commands" / "ok.py").write_text("\n" * command)
    (tmp_path / "gemma4_trace" / "commands" / "near.py").write_text("\n" * (command + 1))
    assert not oversized(tmp_path)  # near, never over
    assert near_limit(tmp_path) == [
        f"traces/near.py: {module + 1} lines, within 5% of its limit {MAX_MODULE_LINES} (at most {module})",
        f"hf/f.py:{function + 1} long: {function + 1} lines, within 5% of its limit {MAX_FUNCTION_LINES} "
        f"(at most {function})",
        f"diff/long.py:1 class Long: {klass + 1} lines, within 5% of its limit {MAX_CLASS_LINES} (at most {klass})",
        f"gemma4_trace/commands/near.py: {command + 1} lines, within 5% of its limit {MAX_COMMAND_LINES} "
        f"(at most {command})",
    ]


def test_the_cycle_checker_covers_every_package(tmp_path):
    """A cycle planted in a library, in the CLI's commands and through a package's __init__ is found;
    an __init__ that imports its submodules, which import their siblings with `from . import m`, is
    no cycle."""
    for folder in ("analysis", "traces", "gemma4_trace/commands"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "analysis" / "sweep.py").write_text("def f():\n    from .sweep_pool import run_pool\n")
    (tmp_path / "analysis" / "sweep_pool.py").write_text("from .sweep import process_prompt\n")
    (tmp_path / "gemma4_trace" / "commands" / "a.py").write_text("from gemma4_trace.commands import b\n")
    (tmp_path / "gemma4_trace" / "commands" / "b.py").write_text("import gemma4_trace.commands.a\n")
    (tmp_path / "traces" / "__init__.py").write_text("from .header import Header\nfrom .reader import Reader\n")
    (tmp_path / "traces" / "schema.py").write_text("KINDS = ()\n")
    (tmp_path / "traces" / "reader.py").write_text("from . import schema as S\n")
    (tmp_path / "traces" / "header.py").write_text("from gemma4_trace.traces import Reader, schema\n")
    assert packages(tmp_path) == ["gemma4_trace.analysis", "gemma4_trace.commands", "gemma4_trace.traces"]
    assert sorted(cycles(import_graph(tmp_path, "gemma4_trace"))) == [
        ["gemma4_trace.analysis.sweep", "gemma4_trace.analysis.sweep_pool"],
        ["gemma4_trace.commands.a", "gemma4_trace.commands.b"],
        ["gemma4_trace.traces", "gemma4_trace.traces.header"],
    ]
    (tmp_path / "traces" / "header.py").write_text("from . import schema\n")  # as reader.py: no cycle
    assert sorted(cycles(import_graph(tmp_path, "gemma4_trace"))) == [
        ["gemma4_trace.analysis.sweep", "gemma4_trace.analysis.sweep_pool"],
        ["gemma4_trace.commands.a", "gemma4_trace.commands.b"],
    ]
