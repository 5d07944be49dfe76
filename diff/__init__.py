"""trace diff: align two traces, find the first divergence, report it (numpy + h5py only).

Computation (core and the modules it uses) returns typed results (result.py) and prints
nothing; the report modules (report.py: text, html.py: HTML, JSON: DiffResult.to_json) only
render them, with numbers formatted by fmt.py.
"""

from .audio_map import audio_map
from .baseline import DEFAULT_FACTOR
from .core import compare
from .hints import likely_cause
from .html import render_html, write_html
from .metrics import METRICS, Metric
from .patch_map import patch_map
from .report import base_against_ref, divergence_sentence, format_text, hint_evidence
from .result import DiffResult, Divergence, Hint
from .tolerances import Tolerances, load_tolerances

__all__ = [
    "METRICS",
    "DiffResult",
    "Divergence",
    "Hint",
    "Metric",
    "Tolerances",
    "compare",
    "diff_traces",
    "format_text",
    "likely_cause",
    "load_tolerances",
    "render_html",
    "write_html",
]


def diff_traces(
    ref_path,
    run_path,
    tolerances_path=None,
    baseline_path=None,
    baseline_factor: float = DEFAULT_FACTOR,
    full: bool = False,
) -> DiffResult:
    """compare(), with the first divergence's sentence (the text report's first line, also in the JSON)
    and the known bug it looks like, if any (diff/hints.py)."""
    result = compare(ref_path, run_path, tolerances_path, baseline_path, baseline_factor, full)
    if result.baseline is not None:  # the envelope's own standing: BASE judged against REF alone
        result.baseline.against_ref = base_against_ref(compare(ref_path, baseline_path, tolerances_path))
    if result.first_divergence is not None:
        result.first_divergence.sentence = divergence_sentence(result)
        result.hint = likely_cause(result, ref_path, run_path)
        if result.hint is not None:
            result.hint.evidence = hint_evidence(result.hint)
        result.patch_map = patch_map(result, ref_path, run_path)
        result.audio_map = audio_map(result, ref_path, run_path)
    return result
