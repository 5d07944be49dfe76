"""Small input files a command reads (tolerances, recipes, prompt sets, manifests), read bounded.

Every one is untrusted: it is opened without blocking and checked on the open descriptor (a
FIFO, a device such as /dev/zero or a folder is refused before a byte is read, and a file
swapped in after a check is still the one checked), read up to a cap, and a TOML file's keys
are bounded in depth before Python's parser (whose time and memory grow with the square of a
dotted key's depth) sees them.

    text = read_text(path, "recipe", 1 << 20)
    data = read_toml(path, "recipe", 1 << 20)
"""

from __future__ import annotations

import hashlib
import os
import stat

from .errors import TraceToolError, one_line

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MAX_KEY_DOTS = 64  # dotted-key parts on one line; the formats' own keys are a few deep


def open_regular(path, what: str):
    """`path` opened for reading when it is a regular file, else one line naming `what`: opened
    without blocking (a FIFO with no writer would hang a plain open) and checked on the open
    descriptor, so the file read is the file checked. Returns a binary file object (blocking)."""
    name = one_line(str(path), 200)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise TraceToolError(f"{what} {name}: no such file") from None
    except IsADirectoryError:
        raise TraceToolError(f"{what} {name}: not a regular file (a folder)") from None
    except OSError as e:
        raise TraceToolError(f"{what} {name}: cannot open ({e.strerror or type(e).__name__})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise TraceToolError(f"{what} {name}: not a regular file ({kind})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else is one line naming `what`."""
    name = one_line(str(path), 200)
    with open_regular(path, what) as f:
        st = os.fstat(f.fileno())
        if st.st_size > limit:
            raise TraceToolError(f"{what} {name}: {st.st_size} bytes, more than the {limit} allowed")
        try:
            raw = f.read(limit + 1)  # the file may grow after the stat
        except OSError as e:
            raise TraceToolError(f"{what} {name}: cannot read ({e.strerror or type(e).__name__})") from None
    if len(raw) > limit:
        raise TraceToolError(f"{what} {name}: more than the {limit} bytes allowed")
    return raw


def read_text(path, what: str, limit: int) -> str:
    """read_bytes as UTF-8 text."""
    try:
        return read_bytes(path, what, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise TraceToolError(f"{what} {one_line(str(path), 200)}: not UTF-8 text") from None


def read_toml(path, what: str, limit: int) -> dict:
    """A TOML file read bounded (read_text), its keys' depth checked before it is parsed."""
    name = one_line(str(path), 200)
    text = read_text(path, what, limit)
    for n, line in enumerate(text.splitlines(), 1):
        key = line.lstrip()
        key = key if key.startswith("[") else key.split("=", 1)[0]  # a table header, or a line's key part
        if key.count(".") > MAX_KEY_DOTS:
            raise TraceToolError(f"{what} {name}, line {n}: a key nested more than {MAX_KEY_DOTS} deep")
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as e:  # ValueError: an integer of over 4300 digits
        raise TraceToolError(f"{what} {name}: not valid TOML ({one_line(e, 200)})") from None
    except RecursionError:  # the parser recurses once per nesting level of arrays and inline tables
        raise TraceToolError(f"{what} {name}: not valid TOML (nested too deeply)") from None


def sha256_file(path) -> str:
    """sha256 of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
