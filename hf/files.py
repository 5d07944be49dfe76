"""A prompt's input file (an image, an audio clip) before it is opened: one line on anything wrong."""

from __future__ import annotations

import os
import stat

from gemma4_trace.traces.errors import TraceToolError, one_line


def check_input_file(path: str, what: str, limit: int) -> None:
    """`path` is a regular file of at most `limit` bytes (a FIFO is never opened: it would block)."""
    shown = f"{what} {one_line(path, 80)}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceToolError(f"{shown} does not exist") from None
    except OSError as e:
        raise TraceToolError(f"{shown} cannot be read ({type(e).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceToolError(f"{shown} is not a regular file")
    if st.st_size > limit:
        raise TraceToolError(f"{shown} is {st.st_size} bytes, more than {limit} read")
