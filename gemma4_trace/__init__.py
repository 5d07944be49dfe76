"""gemma4-trace: record, replay and diff Gemma 4 traces."""


def __getattr__(name: str):
    # read on first use: importing the package stays instant, so the `trace` command's Ctrl-C
    # handler (gemma4_trace/entry.py) is in place before anything slow is imported
    if name == "__version__":
        from importlib.metadata import version

        return version("gemma4-trace")  # one source: pyproject.toml
    raise AttributeError(f"module 'gemma4_trace' has no attribute {name!r}")
