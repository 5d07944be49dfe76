"""gemma4-trace: record, replay and diff Gemma 4 traces."""

__version__ = "0.1.0"
