"""trace diff: align two traces, find the first divergence, report it (numpy + h5py only)."""

from .core import diff_traces
from .html import render_html, write_html
from .metrics import METRICS, Metric
from .report import format_text
from .result import DiffResult, Divergence
from .tolerances import Tolerances, load_tolerances

__all__ = ["METRICS", "DiffResult", "Divergence", "Metric", "Tolerances", "diff_traces", "format_text",
           "load_tolerances", "render_html", "write_html"]
