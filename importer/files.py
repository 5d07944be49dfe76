"""The dump folder and its tensor files: nothing outside the folder is opened, nothing is read
before its size is known to be one the reference justifies.

The folder is listed once (links are listed, never followed); a file is opened only when it is
in that listing, its resolved path is still inside the folder and it is a regular file (opened
without blocking, so a FIFO or device is refused, not waited on). A refusal says only that the
file is not one the import reads: nothing about what it is. Each reader takes the stored shape
and dtype from the file's header (or the map, for raw files), lets the caller check them
(`check`, which raises on a layout the reference does not justify) and only then maps the data
(npy, safetensors, raw: memory-mapped, so only the rows taken are read) or inflates it (an npz
member, whose stream is read for exactly the bytes its checked header declares).
"""

from __future__ import annotations

import contextlib
import json
import lzma
import math
import os
import stat
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces.errors import one_line

from .mapfile import NUMPY_DTYPES, Entry, fail

MAX_ENTRIES = 1 << 20  # files and folders in a dump folder
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit
SAFETENSORS_DTYPES = {
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
}
# what a malformed npy header or zip stream raises inside numpy, zipfile, zlib and lzma
MALFORMED = (
    ValueError,
    TypeError,
    SyntaxError,
    KeyError,
    EOFError,
    OSError,
    OverflowError,
    RecursionError,
    MemoryError,
    NotImplementedError,
    RuntimeError,
    zipfile.BadZipFile,
    zlib.error,
    lzma.LZMAError,
)

# check(shape, dtype name, what, whole) -> a layout; raises TraceToolError when the reference does not
# justify it. `whole`: the data will be read whole (an npz member), not mapped.
Check = Callable[[tuple, str, str, bool], object]


class DumpFolder:
    """DUMP_DIR, listed once: the relative names of the files (and links) below it."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            is_dir = stat.S_ISDIR(os.stat(self.path).st_mode)
        except (OSError, ValueError):
            is_dir = False
        if not is_dir:
            fail(f"dump folder {self.path}: no such folder")
        self.real = os.path.realpath(self.path)
        self.names: set[str] = set()
        count = 0
        for top, dirs, files in os.walk(self.real, followlinks=False):
            count += len(dirs) + len(files)
            if count > MAX_ENTRIES:
                fail(f"dump folder {self.path}: more than {MAX_ENTRIES} files and folders; give the folder of one dump")
            rel = os.path.relpath(top, self.real)
            self.names.update(f if rel == "." else f"{rel}/{f}" for f in files)

    def shown(self, rel: str) -> str:
        return str(self.path / rel)

    @contextlib.contextmanager
    def open(self, rel: str):
        """The file `rel` of the listing, opened for reading; refused unless it is a regular file inside."""
        refused = f"{self.shown(rel)}: not a regular file inside the dump folder (only those are read)"
        if rel not in self.names:
            fail(refused)
        real = os.path.realpath(os.path.join(self.real, rel))
        if os.path.commonpath([real, self.real]) != self.real:
            fail(refused)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except PermissionError:
            fail(f"{self.shown(rel)}: cannot be read (permission denied)")
        except OSError:
            fail(refused)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                fail(refused)
            yield fh


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16).astype(np.uint32) << 16).view(np.float32)


def _mapped(fh, dtype: np.dtype, offset: int, shape: tuple, fortran: bool = False) -> np.ndarray:
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(fh, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def _size(fh) -> int:
    return os.fstat(fh.fileno()).st_size


def read_raw(fh, shown: str, e: Entry, shape: tuple, check: Check):
    """A raw file: dtype and shape from the map, exactly that many bytes."""
    lay = check(shape, e.dtype, shown, False)
    order = "<" if e.byteorder == "little" else ">"
    stored = np.dtype(f"{order}u2") if e.dtype == "bfloat16" else np.dtype(e.dtype).newbyteorder(order)
    want, size = math.prod(shape) * stored.itemsize, _size(fh)
    if size != want:
        fail(f"{shown}: holds {size} bytes; the map's dtype {e.dtype} and shape {list(shape)} make {want}")
    return _mapped(fh, stored, 0, shape), e.dtype, lay


def _npy_header(fh, what: str) -> tuple[tuple, bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
    except MALFORMED as ex:
        fail(f"{what}: not a readable .npy array ({one_line(ex, 120)})")
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        fail(f"{what}: not a readable .npy array (its header's shape is not a list of sizes)")
    if dtype.hasobject or dtype.name not in NUMPY_DTYPES:
        fail(f"{what}: holds {one_line(str(dtype), 40)} data; expected numbers")
    return tuple(shape), bool(fortran), dtype


def read_npy(fh, shown: str, check: Check):
    shape, fortran, dtype = _npy_header(fh, shown)
    lay = check(shape, dtype.name, shown, False)
    offset = fh.tell()
    if offset + math.prod(shape) * dtype.itemsize > _size(fh):
        fail(f"{shown}: holds fewer bytes than its header's shape {list(shape)} needs (truncated)")
    return _mapped(fh, dtype, offset, shape, fortran), dtype.name, lay


def read_npz(fh, shown: str, key: str, check: Check):
    """An npz member: its header is read from the stream and checked, then exactly its bytes inflated."""
    what = f"{shown} [{key}]"
    try:
        with zipfile.ZipFile(fh) as z:
            try:
                info = z.getinfo(f"{key}.npy")
            except KeyError:
                names = sorted(n[:-4] for n in z.namelist() if n.endswith(".npy"))
                shown_names = ", ".join(one_line(n, 40) for n in names[:8]) + (", ..." if len(names) > 8 else "")
                fail(f"{shown}: no array {one_line(repr(key), 80)} (it holds: {shown_names or 'nothing'})")
            with z.open(info) as member:
                shape, fortran, dtype = _npy_header(member, what)
                lay = check(shape, dtype.name, what, True)
                nbytes = math.prod(shape) * dtype.itemsize
                LIM.check_fits(nbytes, what)
                buf = member.read(nbytes)
    except MALFORMED as ex:
        fail(f"{shown}: not a readable .npz file ({one_line(ex, 120)})")
    if len(buf) != nbytes:
        fail(f"{what}: holds fewer bytes than its header's shape {list(shape)} needs (truncated)")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return arr, dtype.name, lay


def read_safetensors(fh, shown: str, key: str, check: Check):
    """One tensor of a safetensors file (a JSON header, then raw little-endian bytes); parsed here
    because numpy has no bfloat16."""
    size = _size(fh)
    head = fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or n > MAX_SAFETENSORS_HEADER or 8 + n > size:
        fail(f"{shown}: not a safetensors file (bad header length)")
    try:
        header = json.loads(fh.read(n))
    except (ValueError, UnicodeDecodeError, RecursionError):
        fail(f"{shown}: not a safetensors file (its header is not JSON)")
    what = f"{shown} [{key}]"
    info = header.get(key) if isinstance(header, dict) else None
    if not isinstance(info, dict):
        names = sorted(k for k in header if k != "__metadata__") if isinstance(header, dict) else []
        listed = ", ".join(one_line(k, 40) for k in names[:8]) + (", ..." if len(names) > 8 else "")
        fail(f"{shown}: no tensor {one_line(repr(key), 80)} (it holds: {listed or 'nothing'})")
    name, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = SAFETENSORS_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        fail(f"{what}: dtype {one_line(repr(name), 40)}, which this importer does not read")

    def sizes(x, n=None):
        return (
            isinstance(x, list)
            and (n is None or len(x) == n)
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in x)
        )

    if not sizes(shape) or not sizes(offs, 2):
        fail(f"{what}: a malformed shape or offsets in the header")
    shape = tuple(shape)
    lay = check(shape, dtype, what, False)
    stored = np.dtype("<u2") if dtype == "bfloat16" else np.dtype(dtype).newbyteorder("<")
    a, b = offs
    if b - a != math.prod(shape) * stored.itemsize or 8 + n + b > size:
        fail(f"{what}: its offsets do not match its shape and dtype (damaged file)")
    return _mapped(fh, stored, 8 + n + a, shape), dtype, lay
