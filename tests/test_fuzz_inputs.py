"""Fuzz the inputs that are not traces (scripts/fuzz_inputs.py): mutated GGUF files through
`--weights-from` and `--gguf` (llama.cpp in its child), mutated recipes through `--recipe`, and
mutated prompt files through `trace sweep`. Every case must end in exit 0/1/2 with one error line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_inputs.py"


def test_hostile_gguf_recipe_and_prompt_files_are_one_line_each(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("fuzz_inputs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_inputs"] = mod
    spec.loader.exec_module(mod)
    monkeypatch.setenv("GEMMA4_TRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    counts = mod.run(120, 2024, say=lambda line: None)
    failures = [f for c in mod.CLASSES for f in counts[c]["failures"]]
    assert not failures, failures[:5]
    for c in mod.CLASSES:
        assert counts[c]["cases"] == 40
        assert counts[c]["exit"][2] > 10  # the mutations reach the checks
    assert sum(counts[c]["exit"][0] for c in mod.CLASSES) > 3  # and some still run: the base inputs are valid
