"""trace diff: align two traces, find the first divergence, report it (numpy + h5py only).

Computation (core and the modules it uses) returns typed results (result.py) and prints
nothing; the report modules (report.py: text, html.py: HTML, JSON: DiffResult.to_json) only
render them, with numbers formatted by fmt.py.
"""

from .baseline import DEFAULT_FACTOR
from .core import compare
from .html import render_html, write_html
from .metrics import METRICS, Metric
from .report import divergence_sentence, format_text
from .result import DiffResult, Divergence
from .tolerances import Tolerances, load_tolerances

__all__ = [
    "METRICS",
    "DiffResult",
    "Divergence",
    "Metric",
    "Tolerances",
    "compare",
    "diff_traces",
    "format_text",
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
    """compare(), with the first divergence's sentence (the text report's first line, also in the JSON)."""
    result = compare(ref_path, run_path, tolerances_path, baseline_path, baseline_factor, full)
    if result.first_divergence is not None:
        result.first_divergence.sentence = divergence_sentence(result)
    return result
