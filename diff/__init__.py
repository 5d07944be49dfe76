"""trace diff: align two traces, find the first divergence, report it (numpy + h5py only)."""

from .core import DiffResult, diff_traces
from .html import render_html, write_html
from .report import format_text
from .tolerances import Tolerances, load_tolerances

__all__ = ["DiffResult", "Tolerances", "diff_traces", "format_text", "load_tolerances", "render_html", "write_html"]
