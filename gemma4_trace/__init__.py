"""gemma4-trace: record, replay and diff Gemma 4 traces."""

from importlib.metadata import version

__version__ = version("gemma4-trace")  # one source: pyproject.toml
