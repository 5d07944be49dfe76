"""Exceptions meant for the user: the CLI prints them as one line and exits 2."""


class TraceToolError(Exception):
    """Bad usage or input. The message is one line that says what to do."""


class TraceFileError(TraceToolError):
    """A trace file that cannot be read: missing, not HDF5, not a trace, wrong version."""


class TraceCorruptError(TraceFileError):
    """A trace whose stored bytes fail their checksum or structure checks."""
