"""The fuzzer's tolerance classes (scripts/fuzz_traces.py --tolerance-cases): two cases of each."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # hundreds of hostile inputs; make test-fast skips it


def _fuzzer():
    spec = importlib.util.spec_from_file_location(
        "fuzz_traces", Path(__file__).resolve().parents[1] / "scripts" / "fuzz_traces.py"
    )
    fz = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_traces"] = fz
    spec.loader.exec_module(fz)
    return fz


def test_fuzzer_tolerance_classes_end_cleanly():
    """Hostile tolerance files: `trace diff --tolerances` exits 0, 1 or 2 with one line; hostile
    REF/BASE/OUT names: calibrate writes a TOML that resolves to the same thresholds as plain names.
    Nothing outside the inputs opened, no run over 60 s or 2 GiB."""
    fz = _fuzzer()
    for cls in [*fz.TOLERANCE, "calibrate_name"]:
        rep = fz.fuzz_tolerances(2, SEED, only=cls)
        summary = fz.format_tolerance_report(rep, f"fuzz_tolerances(2, {SEED}, only={cls})")
        assert rep.cases == 2 and rep.mutations[cls] == 2, summary
        assert not rep.failures, summary + "\n" + "\n".join(rep.failures)
        assert rep.watch_ok and not rep.outside and not rep.slow and not rep.big, summary


SEED = 3  # a seed whose two cases per class run in seconds (seed 18 draws a 100,000-deep TOML header: 30 s)
