"""The HDF5 discipline every trace object passes, whatever the schema says of it (traces/validate.py
checks the schema on top): hard links only, one name per object, few and small attributes, bytes
inside the file, only HDF5's built-in filters, small datasets read only after their declared size
is checked; and the error messages a damaged trace gets. The reader uses the helpers too."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from . import limits as LIM
from .errors import TraceCorruptError, TraceFileError, interrupted, one_line
from .layers import LayerInfo, TowerInfo

ADVICE = "re-record it, or copy it again if it was transferred"
DTYPE_WORDS = {"f": "float16, float32 or float64", "b": "bool", "iu": "integer", "biuf": "numbers"}
# exceptions h5py raises on data it cannot read back (checksum, decompression, damaged index)
READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError)
_LAYOUTS = {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.CHUNKED: "chunked", h5py.h5d.COMPACT: "compact"}
# HDF5's built-in filters and h5py's lzf: anything else would load a plug-in library from disk
_FILTERS = {
    h5py.h5z.FILTER_DEFLATE,
    h5py.h5z.FILTER_SHUFFLE,
    h5py.h5z.FILTER_FLETCHER32,
    h5py.h5z.FILTER_SZIP,
    h5py.h5z.FILTER_NBIT,
    h5py.h5z.FILTER_SCALEOFFSET,
    h5py.h5z.FILTER_LZF,
}


@dataclass
class Checked:
    """What validation read and checked: the reader serves it."""

    provenance: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    selection: object = None  # a selective recording's Selection (traces/selection.py); None: everything
    max_seq: int | None = None  # a replay's runtime positions (schema.ATTR_MAX_SEQ); None: not said
    prompt_ids: np.ndarray | None = None
    max_new_tokens: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    chat_template_applied: bool = False
    extra_names: list[str] = field(default_factory=list)
    layers: list[LayerInfo] = field(default_factory=list)
    towers: dict[str, TowerInfo] = field(default_factory=dict)  # encoder towers (schema version 2)
    step_positions: list[tuple[int, int]] = field(default_factory=list)
    present: set = field(default_factory=set)  # (kind, layer) stored
    flags: set = field(default_factory=set)  # (kind, layer) with a rows_present dataset
    bf16: set = field(default_factory=set)  # (kind, layer) stored as bfloat16 bit patterns (schema.STORAGE_BF16)
    tokens: np.ndarray | None = None
    objects: list[str] = field(default_factory=list)  # every group and dataset, as walked (content_hash hashes these)


class ObjectChecks:
    """The HDF5 discipline of every object a trace walk reaches, whatever the schema says of it:
    hard links only, one name per object, few and small attributes, bytes inside the file, and
    small datasets read only after their declared size is checked.

    `at` names what was being read, for the reader's message when h5py itself fails."""

    def __init__(self, f: h5py.File, path: Path, file_size: int):
        self.f, self.path, self.file_size = f, path, file_size
        self.at = "the file header"
        self.out = Checked()
        self.version = 1  # the trace's schema version, once read
        self._addrs: dict[int, str] = {}
        self._declared = 0  # bytes all datasets declare

    def _bad(self, what: str):
        # from None: the message says it all (no chained traceback, even with --debug)
        raise corrupt(f"{self.path} is not a valid trace: {what}; {ADVICE}") from None

    def _child(self, path: str):
        """The object at a schema path, reached only through hard links (never a soft or external
        link, so nothing outside this file is opened); None when a name on the way is absent."""
        obj = self.f
        walked = ""
        for name in path.split("/"):
            walked = f"{walked}/{name}" if walked else name
            self.at = walked
            if not isinstance(obj, h5py.Group):
                return obj if walked == path else None
            link = obj.get(name, getlink=True)  # the link itself: nothing is followed
            if link is None:
                return None
            if isinstance(link, h5py.SoftLink):
                self._bad(f"{walked!r} is a soft link (to {link.path!r}); a trace holds no links, only its own data")
            if isinstance(link, h5py.ExternalLink):
                self._bad(
                    f"{walked!r} is an external link (to {link.filename!r}); "
                    "a trace holds no links and is never allowed to read another file"
                )
            if not isinstance(link, h5py.HardLink):
                self._bad(f"{walked!r} is a user-defined link; a trace holds no links, only its own data")
            obj = obj[name]
        return obj

    def _visit(self, obj, path: str) -> None:
        """Checks every object walked: reached by one name only, few and small attributes, and for a
        dataset, bytes stored inside this file (layout, external storage, filters, chunk size)."""
        self.at = path if path != "/" else "the root group"
        info = h5py.h5o.get_info(obj.id)
        if info.rc != 1 or info.addr in self._addrs:
            other = self._addrs.get(info.addr)
            self._bad(
                f"{path!r} is reached by {'two names' if other is None else f'two names ({other!r} too)'}; "
                "every object of a trace has exactly one name"
            )
        self._addrs[info.addr] = path
        if path != "/":
            self.out.objects.append(path)
        self._check_attrs(obj, path, info.num_attrs)
        if isinstance(obj, h5py.Dataset):
            self._check_storage(obj, path)
            if obj.shape is not None:
                self._declared += nbytes(obj.shape, obj.dtype)

    def _check_attrs(self, obj, path: str, count: int) -> None:
        if count > LIM.MAX_ATTRS:
            self._bad(f"{path!r} has {count} attributes (a trace object has at most {LIM.MAX_ATTRS})")
        for key in obj.attrs:
            self.at = f"the attribute {key!r} of {path!r}"
            aid = obj.attrs.get_id(key)
            n = int(np.prod(aid.shape)) if aid.shape else 1
            # no elements (an empty array, a null dataspace): HDF5 says size 0, which h5py raises on
            size = aid.get_storage_size() if n and aid.shape is not None else 0
            # variable-length data lives in the global heap, where its size cannot be checked before
            # reading: only one text (older traces), at most the file's size
            vlen = aid.dtype.kind == "O"
            if size > LIM.MAX_ATTR_BYTES or (vlen and (n > 1 or h5py.check_string_dtype(aid.dtype) is None)):
                what = f"{LIM.fmt_bytes(size)}" if not vlen else f"{n} variable-length values"
                self._bad(
                    f"the attribute {key!r} of {path!r} holds {what}, more than a trace attribute may "
                    f"({LIM.fmt_bytes(LIM.MAX_ATTR_BYTES)} of text or numbers)"
                )

    def _check_storage(self, obj: h5py.Dataset, path: str) -> None:
        self.at = path
        plist = obj.id.get_create_plist()
        layout = plist.get_layout()
        if layout not in _LAYOUTS:
            what = (
                "a virtual dataset (its data lives in other files)"
                if layout == h5py.h5d.VIRTUAL
                else f"stored with layout {layout}"
            )
            self._bad(f"{path!r} is {what}; a trace's datasets keep their bytes in the trace itself")
        if plist.get_external_count():
            self._bad(
                f"{path!r} keeps its bytes in an external file; a trace's datasets keep their bytes in the trace itself"
            )
        for i in range(plist.get_nfilters()):
            code = plist.get_filter(i)[0]
            if code not in _FILTERS:
                self._bad(f"{path!r} uses HDF5 filter {code}, which is not built in (plug-in filters are not loaded)")
        if layout == h5py.h5d.CHUNKED:
            chunk = nbytes(plist.get_chunk(), obj.dtype)
            if chunk > LIM.MAX_CHUNK_BYTES:
                self._bad(
                    f"{path!r} has chunks of {LIM.fmt_bytes(chunk)} (at most "
                    f"{LIM.fmt_bytes(LIM.MAX_CHUNK_BYTES)}: a chunk is decompressed whole)"
                )

    def _members(self, g: h5py.Group, path: str, allowed) -> list[str]:
        names = list(g)
        if allowed is not None:
            extra = [n for n in names if n not in allowed]
            if extra:
                self._bad(
                    f"{path!r} holds {extra[0]!r}, which is not part of a trace (expected only {', '.join(allowed)})"
                )
        return names

    def _group(self, path: str) -> h5py.Group:
        self.at = path
        obj = self._child(path)
        if obj is None:
            self._bad(f"the group {path!r} is missing")
        if not isinstance(obj, h5py.Group):
            self._bad(f"{path!r} is a {type(obj).__name__}, not a group")
        self._visit(obj, path)
        return obj

    def _dset(self, path: str, ndim: int | None = None, kinds: str | None = None) -> h5py.Dataset:
        self.at = path
        obj = self._child(path)
        if obj is None:
            self._bad(f"the dataset {path!r} is missing")
        if not isinstance(obj, h5py.Dataset):
            self._bad(f"{path!r} is a {type(obj).__name__}, not a dataset")
        self._visit(obj, path)
        if obj.shape is None:
            self._bad(f"the dataset {path!r} is empty (no dataspace)")
        if ndim is not None and obj.ndim != ndim:
            self._bad(f"the dataset {path!r} has shape {obj.shape}, expected {ndim} dimension(s)")
        if kinds is not None:
            self._check_dtype(obj, path, kinds)
        return obj

    def _check_dtype(self, obj: h5py.Dataset, path: str, kinds: str) -> None:
        dt = obj.dtype
        if dt.kind not in kinds or (dt.kind == "f" and dt.itemsize not in (2, 4, 8)):
            # float128 and other exotic widths are no numpy/torch-friendly tensor type: refuse them here
            self._bad(f"the dataset {path!r} has dtype {dt}, expected {DTYPE_WORDS.get(kinds, kinds)}")

    def _small(self, ds: h5py.Dataset, max_len: int, what: str, vlen_text: bool = False) -> np.ndarray:
        """Read a small dataset whole, after checking its declared length (a bomb is never inflated)."""
        n = ds.shape[0] if ds.shape else 1
        if n > max_len or nbytes(ds.shape, ds.dtype) > max_len * 64:
            self._bad(f"{ds.name.lstrip('/')!r} has shape {ds.shape}: more than {max_len} {what}")
        if not (vlen_text and ds.ndim == 1 and ds.dtype.kind == "O"):
            return read_small(self.path, ds)
        # variable-length text (older traces) has no size to check before reading: one entry at a
        # time, each a short name, so memory stays bounded by the file's size
        out = []
        for i in range(n):
            try:
                v = ds[i]
            except READ_ERRORS as e:
                raise corrupt_data(self.path, ds.name, e) from None
            if len(v) > 64:
                self._bad(f"{ds.name.lstrip('/')!r} entry {i} is {len(v)} characters long (a name is short)")
            out.append(v)
        return np.array(out, dtype=object)

    # ------------------------------------------------------------------ attributes
    def _attr(self, obj, key: str, where: str):
        self.at = f"the attribute {key!r} of {where}"
        if key not in obj.attrs:
            self._bad(f"the attribute {key!r} of {where} is missing")
        return obj.attrs[key]  # its size was checked when the object was visited

    def _text_attr(self, obj, key: str, where: str) -> str:
        v = self._attr(obj, key, where)
        if isinstance(v, bytes):
            try:
                return v.decode()
            except UnicodeDecodeError:
                self._bad(f"the attribute {key!r} of {where} is not UTF-8 text")
        if not isinstance(v, str):
            self._bad(f"the attribute {key!r} of {where} should be text, got {describe(v)}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:  # h5py hands undecodable bytes over as surrogates
            self._bad(f"the attribute {key!r} of {where} is not UTF-8 text")
        return v

    def _int_attr(self, obj, key: str, where: str, minimum: int) -> int:
        v = self._attr(obj, key, where)
        n = as_int(v)
        if n is None:
            self._bad(f"the attribute {key!r} of {where} should be an integer, got {describe(v)}")
        if n < minimum:
            self._bad(f"the attribute {key!r} of {where} is {n}, expected >= {minimum}")
        return n

    def _check_declared(self) -> None:
        """All datasets together may declare only so much for the file's size: a dataset of zeros
        compressed a thousandfold (a compression bomb) would cost time and memory to inflate."""
        self.at = "the sizes of the datasets"
        allowed = max(LIM.MIN_DECLARED, LIM.EXPANSION * self.file_size)
        if self._declared > allowed:
            self._bad(
                f"its datasets declare {LIM.fmt_bytes(self._declared)} of data in a file of "
                f"{LIM.fmt_bytes(self.file_size)} (at most {LIM.EXPANSION}x the file size, or "
                f"{LIM.fmt_bytes(LIM.MIN_DECLARED)}): a compression bomb or a damaged file"
            )


def read_small(path: Path, ds: h5py.Dataset) -> np.ndarray:
    """A dataset read whole (its size checked by the caller); damage is one line naming it."""
    try:
        return ds[()]
    except READ_ERRORS as e:
        raise corrupt_data(path, ds.name, e) from None


def corrupt_data(path: Path, name: str, e: BaseException) -> TraceCorruptError:
    if interrupted(e):  # Ctrl-C during the read, not damage
        raise KeyboardInterrupt from None
    return corrupt(
        f"{path} is corrupt: the dataset {name.lstrip('/')!r} cannot be read back ({one_line(e, 200)}); "
        "its stored bytes were damaged after writing (checksum or decompression failure): "
        "copy the file again or re-record it"
    )


def corrupt(msg: str) -> TraceCorruptError:
    return TraceCorruptError(one_line(msg))


def file_error(msg: str) -> TraceFileError:
    return TraceFileError(one_line(msg))


def attr_text(v) -> str:
    if isinstance(v, bytes):
        return v.decode()
    try:
        if isinstance(v, np.ndarray):
            return json.dumps(v.tolist())
        if isinstance(v, np.generic):
            return json.dumps(v.item())
        return json.dumps(v) if not isinstance(v, str) else v
    except (TypeError, ValueError):  # values no writer of ours makes (references, raw bytes in arrays)
        return repr(v)


def as_int(v) -> int | None:
    """An integer scalar attribute's value, or None when it is not one (bools are not integers)."""
    if isinstance(v, np.ndarray) and v.size == 1 and v.ndim <= 1:
        v = v.reshape(()).item() if v.dtype.kind in "iu" else None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def describe(v) -> str:
    t = type(v).__name__ if not isinstance(v, np.ndarray) else f"array of {v.dtype} {v.shape}"
    r = " ".join(repr(v).split())  # one line, whatever the value
    return f"{t} {r[:40] + '...' if len(r) > 40 else r}"


def nbytes(shape, dtype) -> int:
    """Declared bytes of a dataset, in Python integers (no overflow whatever the shape)."""
    n = 1
    for d in shape or ():
        n *= int(d)
    return n * max(1, np.dtype(dtype).itemsize)
