"""Exceptions meant for the user: the CLI prints them as one line and exits 2."""


class TraceToolError(Exception):
    """Bad usage or input. The message is one line that says what to do."""


class TraceFileError(TraceToolError):
    """A trace file that cannot be read: missing, not HDF5, not a trace, wrong version."""


class TraceCorruptError(TraceFileError):
    """A trace whose stored bytes fail their checksum or structure checks."""


def one_line(msg: object, limit: int | None = None) -> str:
    """`msg` (text or an exception) as one line that is safe to print in an error message.

    An exception gives the first non-empty line of its message (the lines after are detail
    such as HF's hints), or its type name when it has none. Undecodable text and control
    characters (newlines included) are escaped, so the result never spans lines; it is cut
    to `limit` characters when a limit is given.
    """
    if isinstance(msg, BaseException):
        lines = [line for line in str(msg).splitlines() if line.strip()]
        msg = lines[0] if lines else type(msg).__name__
    text = str(msg).encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if limit is None else text[:limit]


def interrupted(e: BaseException) -> bool:
    """Whether `e` is a Ctrl-C that C code (h5py's callbacks) wrapped in another exception."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, KeyboardInterrupt):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def install_hint(extra: str) -> str:
    """How to install one of the project's extras (it is installed from a checkout, not a registry)."""
    return f"install the extra [{extra}] (from a checkout: pip install -e '.[{extra}]')"
