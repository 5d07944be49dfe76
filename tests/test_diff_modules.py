"""The diff's computation is free of presentation (issue 17): the modules that compute import
no renderer and no number formatting, and fmt.py (the numbers every report prints) imports
nothing else of the diff, so a new report format is a new module plus its CLI option."""

from __future__ import annotations

import ast
from pathlib import Path

DIFF = Path(__file__).resolve().parents[1] / "diff"
RENDERERS = {"report", "html", "fmt", "svg", "patch_svg", "audio_svg"}
COMPUTE = (
    "align",
    "audio_hints",
    "audio_map",
    "audio_where",
    "baseline",
    "blocks",
    "calibrate",
    "core",
    "hints",
    "ledger",
    "isolation",
    "logits",
    "metrics",
    "origin",
    "parallel",
    "patch_map",
    "result",
    "tokens",
    "tolerances",
    "vision_hints",
)


def diff_imports(module: str) -> set[str]:
    """The diff modules `module` imports (relative or absolute), at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse((DIFF / f"{module}.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level == 1:
                out |= {name.split(".")[0]} if name else {a.name for a in node.names}
            elif name.startswith("gemma4_trace.diff"):
                rest = name.removeprefix("gemma4_trace.diff").lstrip(".")
                out |= {rest.split(".")[0]} if rest else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("gemma4_trace.diff.")}
    return out


def test_every_diff_module_is_classified():
    assert {p.stem for p in DIFF.glob("*.py")} - {"__init__"} == RENDERERS | set(COMPUTE)


def test_computation_imports_no_renderer():
    leaks = {m: diff_imports(m) & RENDERERS for m in COMPUTE}
    assert not any(leaks.values()), leaks


def test_number_formatting_is_a_leaf():
    assert diff_imports("fmt") == set()


def test_one_block_size():
    """One BLOCK_BYTES, in the walker every pass reads through."""
    owners = [p.stem for p in DIFF.glob("*.py") if "BLOCK_BYTES =" in p.read_text(encoding="utf-8")]
    assert owners == ["blocks"], owners
