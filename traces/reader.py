"""TraceReader: opens a trace, validates its structure, serves canonical tensors.

A trace is untrusted input (docs/robustness.md, "Threat model"). Opening one checks
everything that can be checked without reading tensor data: the file is a regular file;
the object tree is walked only along the names the schema defines, and every name must be
a hard link to an object no other name reaches (no soft or external links); every
dataset keeps its bytes inside the file (contiguous, chunked or compact layout, no
external storage, no virtual layout, only HDF5's built-in filters); every attribute is
small (limits.MAX_ATTR_BYTES); the schema name and version, the provenance and input
attributes, prompt ids, per-layer metadata and step positions (small datasets, sizes
checked before they are read); and for every tensor dataset its place in the layout,
dtype, rank, rows (one per position or per step), the row axes the layer metadata fixes,
and a row width the model config can justify. All datasets together may declare only so
many bytes for the file's size (limits.EXPANSION: a compression bomb is refused). A file
that fails raises TraceCorruptError (or TraceFileError when it is no trace at all); one
line naming the file, what is wrong and what to do. Tensor data is read later, on demand:
a chunk that fails its fletcher32 checksum or cannot be decompressed raises
TraceCorruptError naming the dataset, never a numeric result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from pathlib import Path

import h5py
import numpy as np

from . import limits as LIM
from . import schema as S
from .header import Provenance, TraceHeader
from .errors import TraceCorruptError, TraceFileError, TraceToolError, interrupted, one_line
from .layers import LayerInfo

HASH_BLOCK_BYTES = 64 << 20  # content_hash reads a dataset this many bytes at a time

ADVICE = "re-record it, or copy it again if it was transferred"
DTYPE_WORDS = {"f": "float16, float32 or float64", "b": "bool", "iu": "integer", "biuf": "numbers"}
# exceptions h5py raises on data it cannot read back (checksum, decompression, damaged index)
READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError)
_LAYER_GROUP = re.compile(r"^L(\d+)$")
# the names the schema defines above tensors/ (tensors/ is checked kind by kind)
_MEMBERS = {
    "/": ("inputs", "model", "steps", "tensors"),
    S.GROUP_INPUTS: ("prompt_ids", "extra"),
    S.GROUP_MODEL: S.LAYER_FIELDS,
    "steps": ("positions",),
}
_LAYOUTS = {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.CHUNKED: "chunked", h5py.h5d.COMPACT: "compact"}
# HDF5's built-in filters and h5py's lzf: anything else would load a plug-in library from disk
_FILTERS = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32, h5py.h5z.FILTER_SZIP,
            h5py.h5z.FILTER_NBIT, h5py.h5z.FILTER_SCALEOFFSET, h5py.h5z.FILTER_LZF}


def _no_filter_plugins() -> None:
    """Empty HDF5's plug-in search path: a trace naming an unknown filter cannot make HDF5 load code."""
    with contextlib.suppress(Exception):
        while h5py.h5pl.size():
            h5py.h5pl.remove(0)


def _attr_text(v) -> str:
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


def _as_int(v) -> int | None:
    """An integer scalar attribute's value, or None when it is not one (bools are not integers)."""
    if isinstance(v, np.ndarray) and v.size == 1 and v.ndim <= 1:
        v = v.reshape(()).item() if v.dtype.kind in "iu" else None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def _describe(v) -> str:
    t = type(v).__name__ if not isinstance(v, np.ndarray) else f"array of {v.dtype} {v.shape}"
    r = " ".join(repr(v).split())  # one line, whatever the value
    return f"{t} {r[:40] + '...' if len(r) > 40 else r}"


def _is_integer_dtype(dt: np.dtype) -> bool:
    return dt.kind in "iu"


def _nbytes(shape, dtype) -> int:
    """Declared bytes of a dataset, in Python integers (no overflow whatever the shape)."""
    n = 1
    for d in shape or ():
        n *= int(d)
    return n * max(1, np.dtype(dtype).itemsize)


class TraceReader:
    """Read-only view of a trace. Use as a context manager or call close()."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            st = os.stat(self.path)  # stat, not open: opening a FIFO would block forever
        except FileNotFoundError:
            raise _file_error(f"{self.path}: no such file") from None
        except OSError as e:
            raise _file_error(f"{self.path} cannot be read ({e.strerror})") from None
        if stat.S_ISDIR(st.st_mode):
            raise _file_error(f"{self.path} is a folder, not a trace file")
        if not stat.S_ISREG(st.st_mode):
            raise _file_error(f"{self.path} is {_file_kind(st.st_mode)}, not a regular file; pass a trace file")
        if not os.access(self.path, os.R_OK):
            raise _file_error(f"{self.path} cannot be read (permission denied)")
        self.file_size = st.st_size
        _no_filter_plugins()
        try:
            self.f = h5py.File(self.path, "r", locking=False)
        except Exception as e:  # noqa: BLE001 - h5py reports every unopenable file as some exception
            raise _file_error(self._open_message(e)) from None
        self._at = "the file header"
        self._objects: list[str] = []  # every group and dataset, as walked (content_hash hashes these)
        self._addrs: dict[int, str] = {}
        self._declared = 0  # bytes all datasets declare
        self._memory = LIM.memory_limit()
        try:
            self._visit(self.f, "/")
            self._check_schema()
            self._load_header()
            self._check_tensors()
            self._check_declared()
        except TraceToolError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 - damaged HDF5 metadata surfaces as any h5py exception
            self.close()
            if interrupted(e):  # Ctrl-C inside an h5py callback arrives wrapped (SystemError)
                raise KeyboardInterrupt from None
            raise _corrupt(
                f"{self.path} is damaged: reading {self._at} failed ({type(e).__name__}: {one_line(e, 200)}); {ADVICE}"
            ) from None
        except BaseException:
            self.close()
            raise

    def _open_message(self, e: BaseException) -> str:
        msg = one_line(e, 200)
        head = f"{self.path} is not a readable HDF5 trace"
        m = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", msg)
        if m:
            return (f"{head}: it is truncated ({m.group(1)} of {m.group(2)} bytes; an interrupted copy or write); "
                    "copy it again or re-record it")
        if "file signature not found" in msg:
            return (f"{head}: it is not an HDF5 file at all (no HDF5 signature); "
                    "pass a trace written by 'trace record' or 'trace replay'")
        return f"{head} ({msg}); {ADVICE}"

    # ------------------------------------------------------------------ validation
    def _bad(self, what: str):
        # from None: the message says it all (no chained traceback, even with --debug)
        raise _corrupt(f"{self.path} is not a valid trace: {what}; {ADVICE}") from None

    def _child(self, path: str):
        """The object at a schema path, reached only through hard links (never a soft or external
        link, so nothing outside this file is opened); None when a name on the way is absent."""
        obj = self.f
        walked = ""
        for name in path.split("/"):
            walked = f"{walked}/{name}" if walked else name
            self._at = walked
            if not isinstance(obj, h5py.Group):
                return obj if walked == path else None
            link = obj.get(name, getlink=True)  # the link itself: nothing is followed
            if link is None:
                return None
            if isinstance(link, h5py.SoftLink):
                self._bad(f"{walked!r} is a soft link (to {link.path!r}); a trace holds no links, only its own data")
            if isinstance(link, h5py.ExternalLink):
                self._bad(f"{walked!r} is an external link (to {link.filename!r}); "
                          "a trace holds no links and is never allowed to read another file")
            if not isinstance(link, h5py.HardLink):
                self._bad(f"{walked!r} is a user-defined link; a trace holds no links, only its own data")
            obj = obj[name]
        return obj

    def _visit(self, obj, path: str) -> None:
        """Checks every object walked: reached by one name only, few and small attributes, and for a
        dataset, bytes stored inside this file (layout, external storage, filters, chunk size)."""
        self._at = path if path != "/" else "the root group"
        info = h5py.h5o.get_info(obj.id)
        if info.rc != 1 or info.addr in self._addrs:
            other = self._addrs.get(info.addr)
            self._bad(f"{path!r} is reached by {'two names' if other is None else f'two names ({other!r} too)'}; "
                      "every object of a trace has exactly one name")
        self._addrs[info.addr] = path
        if path != "/":
            self._objects.append(path)
        if info.num_attrs > LIM.MAX_ATTRS:
            self._bad(f"{path!r} has {info.num_attrs} attributes (a trace object has at most {LIM.MAX_ATTRS})")
        for key in obj.attrs:
            self._at = f"the attribute {key!r} of {path!r}"
            aid = obj.attrs.get_id(key)
            size = aid.get_storage_size()
            count = int(np.prod(aid.shape)) if aid.shape else 1
            # variable-length data lives in the global heap, where its size cannot be checked before
            # reading: only one text (older traces), at most the file's size
            vlen = aid.dtype.kind == "O"
            if size > LIM.MAX_ATTR_BYTES or (vlen and (count > 1 or h5py.check_string_dtype(aid.dtype) is None)):
                what = f"{LIM.fmt_bytes(size)}" if not vlen else f"{count} variable-length values"
                self._bad(f"the attribute {key!r} of {path!r} holds {what}, more than a trace attribute may "
                          f"({LIM.fmt_bytes(LIM.MAX_ATTR_BYTES)} of text or numbers)")
        if isinstance(obj, h5py.Dataset):
            self._at = path
            plist = obj.id.get_create_plist()
            layout = plist.get_layout()
            if layout not in _LAYOUTS:
                what = "a virtual dataset (its data lives in other files)" if layout == h5py.h5d.VIRTUAL \
                    else f"stored with layout {layout}"
                self._bad(f"{path!r} is {what}; a trace's datasets keep their bytes in the trace itself")
            if plist.get_external_count():
                self._bad(f"{path!r} keeps its bytes in an external file; "
                          "a trace's datasets keep their bytes in the trace itself")
            for i in range(plist.get_nfilters()):
                code = plist.get_filter(i)[0]
                if code not in _FILTERS:
                    self._bad(f"{path!r} uses HDF5 filter {code}, which is not built in (plug-in filters are not loaded)")
            if layout == h5py.h5d.CHUNKED:
                chunk = _nbytes(plist.get_chunk(), obj.dtype)
                if chunk > LIM.MAX_CHUNK_BYTES:
                    self._bad(f"{path!r} has chunks of {LIM.fmt_bytes(chunk)} (at most "
                              f"{LIM.fmt_bytes(LIM.MAX_CHUNK_BYTES)}: a chunk is decompressed whole)")
            if obj.shape is not None:
                self._declared += _nbytes(obj.shape, obj.dtype)

    def _members(self, g: h5py.Group, path: str, allowed) -> list[str]:
        names = list(g)
        if allowed is not None:
            extra = [n for n in names if n not in allowed]
            if extra:
                self._bad(f"{path!r} holds {extra[0]!r}, which is not part of a trace (expected only "
                          f"{', '.join(allowed)})")
        return names

    def _group(self, path: str) -> h5py.Group:
        self._at = path
        obj = self._child(path)
        if obj is None:
            self._bad(f"the group {path!r} is missing")
        if not isinstance(obj, h5py.Group):
            self._bad(f"{path!r} is a {type(obj).__name__}, not a group")
        self._visit(obj, path)
        return obj

    def _dset(self, path: str, ndim: int | None = None, kinds: str | None = None) -> h5py.Dataset:
        self._at = path
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
        dt = obj.dtype
        if kinds is not None and (dt.kind not in kinds or (dt.kind == "f" and dt.itemsize not in (2, 4, 8))):
            # float128 and other exotic widths are no numpy/torch-friendly tensor type: refuse them here
            self._bad(f"the dataset {path!r} has dtype {dt}, expected {DTYPE_WORDS.get(kinds, kinds)}")
        return obj

    def _small(self, ds: h5py.Dataset, max_len: int, what: str, vlen_text: bool = False) -> np.ndarray:
        """Read a small dataset whole, after checking its declared length (a bomb is never inflated)."""
        n = ds.shape[0] if ds.shape else 1
        if n > max_len or _nbytes(ds.shape, ds.dtype) > max_len * 64:
            self._bad(f"{ds.name.lstrip('/')!r} has shape {ds.shape}: more than {max_len} {what}")
        if vlen_text and ds.ndim == 1 and ds.dtype.kind == "O":
            # variable-length text (older traces) has no size to check before reading: one entry at a
            # time, each a short name, so memory stays bounded by the file's size
            out = []
            for i in range(n):
                try:
                    v = ds[i]
                except READ_ERRORS as e:
                    raise self._corrupt_data(ds.name, e) from None
                if len(v) > 64:
                    self._bad(f"{ds.name.lstrip('/')!r} entry {i} is {len(v)} characters long (a name is short)")
                out.append(v)
            return np.array(out, dtype=object)
        return self._read_small(ds)

    def _read_small(self, ds: h5py.Dataset) -> np.ndarray:
        try:
            return ds[()]
        except READ_ERRORS as e:
            raise self._corrupt_data(ds.name, e) from None

    def _corrupt_data(self, name: str, e: BaseException) -> TraceCorruptError:
        if interrupted(e):  # Ctrl-C during the read, not damage
            raise KeyboardInterrupt from None
        return _corrupt(
            f"{self.path} is corrupt: the dataset {name.lstrip('/')!r} cannot be read back ({one_line(e, 200)}); "
            "its stored bytes were damaged after writing (checksum or decompression failure): "
            "copy the file again or re-record it"
        )

    def _attr(self, obj, key: str, where: str):
        self._at = f"the attribute {key!r} of {where}"
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
            self._bad(f"the attribute {key!r} of {where} should be text, got {_describe(v)}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:  # h5py hands undecodable bytes over as surrogates
            self._bad(f"the attribute {key!r} of {where} is not UTF-8 text")
        return v

    def _int_attr(self, obj, key: str, where: str, minimum: int) -> int:
        v = self._attr(obj, key, where)
        n = _as_int(v)
        if n is None:
            self._bad(f"the attribute {key!r} of {where} should be an integer, got {_describe(v)}")
        if n < minimum:
            self._bad(f"the attribute {key!r} of {where} is {n}, expected >= {minimum}")
        return n

    def _check_schema(self) -> None:
        attrs = self.f.attrs
        self._at = "the root attributes"
        name = attrs.get(S.ATTR_SCHEMA)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if not (isinstance(name, str) and name == S.SCHEMA_NAME):
            what = "has no 'schema' attribute" if name is None else f"its 'schema' attribute is {_describe(name)}"
            raise _file_error(
                f"{self.path} is an HDF5 file but not a {S.SCHEMA_NAME} trace ({what}); "
                "pass a trace written by 'trace record' or 'trace replay'"
            )
        version = attrs.get(S.ATTR_SCHEMA_VERSION)
        if version is None:
            self._bad(f"the root attribute {S.ATTR_SCHEMA_VERSION!r} is missing")
        v = _as_int(version)
        if v is None:
            self._bad(f"the root attribute {S.ATTR_SCHEMA_VERSION!r} should be an integer, got {_describe(version)}")
        if v > S.SCHEMA_VERSION:
            raise _file_error(
                f"{self.path} has trace schema version {v}, newer than this tool reads ({S.SCHEMA_VERSION}); "
                "upgrade gemma4-trace to read it"
            )
        if v != S.SCHEMA_VERSION:
            raise _file_error(
                f"{self.path} has trace schema version {v}; this tool reads version {S.SCHEMA_VERSION}"
                " (re-record it with this version)"
            )

    def _load_header(self) -> None:
        f = self.f
        self._members(f, "/", _MEMBERS["/"])
        prov = {k: self._text_attr(f, k, "the root") for k in S.PROVENANCE_KEYS}
        if prov["mode"] not in S.MODES:
            self._bad(f"the root attribute 'mode' is {prov['mode']!r}, not one of {', '.join(S.MODES)}")
        try:
            cfg = json.loads(prov["model_config"])
        except (ValueError, RecursionError):
            cfg = None
        if not isinstance(cfg, dict):
            self._bad("the root attribute 'model_config' is not a JSON object")
        self.provenance = prov
        self._config = cfg
        self.selection = None  # a selective recording's Selection (traces/selection.py); None: everything
        if S.ATTR_SELECTION in f.attrs:
            from .selection import Selection

            try:
                self.selection = Selection.from_json(self._text_attr(f, S.ATTR_SELECTION, "the root"))
            except (ValueError, RecursionError) as e:
                self._bad(f"the root attribute {S.ATTR_SELECTION!r} is not a valid selection ({one_line(str(e), 120)})")

        g = self._group(S.GROUP_INPUTS)
        self._members(g, S.GROUP_INPUTS, _MEMBERS[S.GROUP_INPUTS])
        ids = self._small(self._dset(S.DSET_PROMPT_IDS, 1, "iu"), LIM.MAX_POSITIONS, "prompt ids")
        if ids.size == 0:
            self._bad(f"{S.DSET_PROMPT_IDS!r} is empty")
        if (ids < 0).any() or (ids.dtype.kind == "u" and (ids > np.iinfo(np.int64).max).any()):
            self._bad(f"{S.DSET_PROMPT_IDS!r} holds ids out of range ({int(ids.min())}..{int(ids.max())})")
        self.prompt_ids = ids.astype(np.int64)
        where = f"{S.GROUP_INPUTS!r}"
        self.max_new_tokens = self._int_attr(g, "max_new_tokens", where, 1)
        if ids.size + self.max_new_tokens > LIM.MAX_POSITIONS:
            self._bad(f"the attribute 'max_new_tokens' of {where} is {self.max_new_tokens}: with the {ids.size} "
                      f"prompt ids that is more than {LIM.MAX_POSITIONS} positions")
        eos = np.asarray(self._attr(g, "eos_token_ids", where))
        if eos.ndim > 1 or (eos.size and eos.dtype.kind not in "iu"):
            self._bad(f"the attribute 'eos_token_ids' of {where} should be integers, got {_describe(eos)}")
        self.eos_token_ids = [int(x) for x in eos.reshape(-1)]
        self.prompt_text = self._text_attr(g, "prompt_text", where)
        chat = self._attr(g, "chat_template_applied", where)
        if isinstance(chat, (bool, np.bool_)) or _as_int(chat) in (0, 1):
            self.chat_template_applied = bool(chat)
        else:
            self._bad(f"the attribute 'chat_template_applied' of {where} should be a bool, got {_describe(chat)}")
        self._extra_names = []
        if "extra" in g:
            extra = self._group(S.GROUP_INPUT_EXTRA)
            names = sorted(self._members(extra, S.GROUP_INPUT_EXTRA, None))
            if len(names) > LIM.MAX_EXTRA_INPUTS:
                self._bad(f"{S.GROUP_INPUT_EXTRA!r} holds {len(names)} inputs (at most {LIM.MAX_EXTRA_INPUTS})")
            for name in names:
                self._dset(S.input_extra_path(name), None, "biuf")
            self._extra_names = names

        self._members(self._group(S.GROUP_MODEL), S.GROUP_MODEL, _MEMBERS[S.GROUP_MODEL])
        fields = {}
        for k in S.LAYER_FIELDS:
            path = S.model_field_path(k)
            text = k in ("layer_type", "kv_role")
            ds = self._dset(path, 1)
            if text and h5py.check_string_dtype(ds.dtype) is None:
                self._bad(f"the dataset {path!r} has dtype {ds.dtype}, expected strings")
            if not text and not _is_integer_dtype(ds.dtype):
                self._bad(f"the dataset {path!r} has dtype {ds.dtype}, expected integer")
            vals = self._small(ds, LIM.MAX_LAYERS, "layers", vlen_text=text)
            if text:
                try:
                    vals = [_attr_text(x) for x in vals]
                except UnicodeDecodeError:
                    self._bad(f"the dataset {path!r} holds text that is not UTF-8")
            else:
                vals = [int(x) for x in vals]
            fields[k] = vals
        n = len(fields["layer_type"])
        lengths = {k: len(v) for k, v in fields.items()}
        if n == 0 or any(x != n for x in lengths.values()):
            self._bad(f"the per-layer metadata under 'model/' has inconsistent lengths {lengths}")
        self._at = "the per-layer metadata under 'model/'"
        for i in range(n):
            lt, role, src = fields["layer_type"][i], fields["kv_role"][i], fields["kv_source"][i]
            if lt not in S.LAYER_TYPE_SHORT:
                self._bad(f"model/layer_type of layer {i} is {lt!r}, not one of {', '.join(S.LAYER_TYPE_SHORT)}")
            if role not in S.KV_ROLES:
                self._bad(f"model/kv_role of layer {i} is {role!r}, not one of {', '.join(S.KV_ROLES)}")
            for k, cap in (("head_dim", LIM.MAX_HEAD_DIM), ("num_heads", LIM.MAX_HEADS), ("num_kv_heads", LIM.MAX_HEADS)):
                if not 1 <= fields[k][i] <= cap:
                    self._bad(f"model/{k} of layer {i} is {fields[k][i]}, expected 1..{cap}")
            ok = (src == i) if role != "reuses" else (0 <= src < i and fields["kv_role"][src] != "reuses")
            if not ok:
                self._bad(f"model/kv_source of layer {i} is {src}, impossible for a layer whose kv_role is {role!r}")
        self.layers = [LayerInfo(**{k: fields[k][i] for k in S.LAYER_FIELDS}) for i in range(n)]

        self._members(self._group("steps"), "steps", _MEMBERS["steps"])
        sp_ds = self._dset(S.DSET_STEP_POSITIONS, 2, "iu")
        if sp_ds.shape[0] > self.max_new_tokens:
            self._bad(f"it has {sp_ds.shape[0]} steps but max_new_tokens is {self.max_new_tokens}")
        sp = self._small(sp_ds, LIM.MAX_POSITIONS, "steps")
        if sp.shape[0] == 0 or sp.shape[1] != 2:
            self._bad(f"{S.DSET_STEP_POSITIONS!r} has shape {sp.shape}, expected (n_steps >= 1, 2)")
        self.step_positions = [(int(a), int(b)) for a, b in sp]
        T = int(ids.size)
        for s, (a, b) in enumerate(self.step_positions):
            want = (0, T) if s == 0 else (T + s - 1, T + s)
            if (a, b) != want:
                self._bad(f"{S.DSET_STEP_POSITIONS!r}: step {s} feeds positions [{a}, {b}), expected [{want[0]}, "
                          f"{want[1]}) (a prefill over the {T} prompt ids, then one position per decode step)")

    def _check_tensors(self) -> None:
        g = self._group(S.GROUP_TENSORS)
        present: list[tuple[str, int | None]] = []
        flags: list[tuple[str, int | None]] = []  # <kind>.rows_present: which rows a runtime reported
        for name in g:
            obj_path = f"{S.GROUP_TENSORS}/{name}"
            if name.endswith(S.ROWS_PRESENT_SUFFIX):
                flags.append((name.removesuffix(S.ROWS_PRESENT_SUFFIX), None))
                continue
            m = _LAYER_GROUP.match(name)
            if m and S.layer_group(int(m.group(1))) == obj_path:
                layer = int(m.group(1))
                if layer >= len(self.layers):
                    self._bad(f"{obj_path!r} is a layer group, but the model has {len(self.layers)} layers")
                lg = self._group(obj_path)
                for kind in lg:
                    if kind.endswith(S.ROWS_PRESENT_SUFFIX):
                        flags.append((kind.removesuffix(S.ROWS_PRESENT_SUFFIX), layer))
                        continue
                    spec = S.KIND_BY_NAME.get(kind)
                    if spec is None or not spec.per_layer:
                        self._bad(f"{obj_path}/{kind!r} is not a per-layer kind ({', '.join(S.LAYER_KIND_NAMES)})")
                    present.append((kind, layer))
            else:
                spec = S.KIND_BY_NAME.get(name)
                if spec is None or spec.per_layer:
                    self._bad(f"{obj_path!r} is neither a global kind nor a layer group (L00, L01, ...)")
                present.append((name, None))
        if ("token", None) not in present:
            self._bad(f"the dataset '{S.tensor_path('token', None)}' (the chosen tokens) is missing")
        limits = LIM.row_limits(self._config, self.layers)
        for kind, layer in present:
            self._check_tensor(kind, layer, limits[kind])
        self._present = set(present)
        self._flags = set()
        for kind, layer in flags:
            self._check_rows_present(kind, layer)
        # the chosen tokens are tiny and every command needs them: read and check them now
        path = S.tensor_path("token", None)
        t = self._read_small(self.f[path])
        if t.size and (t.min() < 0 or t.max() > np.iinfo(np.int64).max):
            self._bad(f"{path!r} holds token ids out of range ({t.min()}..{t.max()})")
        self._tokens = t.astype(np.int64).reshape(-1)

    def _check_tensor(self, kind: str, layer: int | None, row_limit: int) -> None:
        path = S.tensor_path(kind, layer)
        spec = S.KIND_BY_NAME[kind]
        ds = self._dset(path, 1 + spec.row_ndim, S.DTYPE_KINDS[spec.dtype])
        self._text_attr(ds, S.ATTR_SOURCE_DTYPE, repr(path))
        self._at = path
        rows, row = ds.shape[0], ds.shape[1:]
        if any(d < 1 for d in row):
            self._bad(f"{path!r} has shape {ds.shape}: an empty row")
        if spec.index == "step":
            if rows != self.n_steps:
                self._bad(f"{path!r} has {rows} rows, expected {self.n_steps} (one per step)")
        elif not self.prompt_len <= rows <= self.n_positions:
            # fewer rows than positions (ending on a step) is a runtime that stopped reporting the kind:
            # the diff reports it as a 'rows' divergence
            self._bad(f"{path!r} has {rows} rows, expected {self.n_positions} (one per position)")
        li = self.layers[layer] if layer is not None else None
        for axis, size in zip(spec.axes, row):
            want = len(self.layers) if axis.meta == "layers" else getattr(li, axis.meta) if li and axis.meta else None
            if want is not None and size != want:
                what = axis.meta.removeprefix("num_").replace("kv_", "KV ")  # heads, KV heads, layers
                self._bad(f"{path!r} has rows of shape {row}, but the model metadata says {want} {what}")
        elements = _nbytes(row, np.uint8)
        if elements > row_limit:
            self._bad(f"{path!r} has rows of shape {row} ({elements} values), more than the model config "
                      f"justifies ({row_limit})")

    def _check_rows_present(self, kind: str, layer: int | None) -> None:
        """<kind>.rows_present: (rows,) bool beside the position-indexed kind whose rows it flags."""
        spec = S.KIND_BY_NAME.get(kind)
        where = f"{S.tensor_path(kind, layer) if spec and spec.per_layer == (layer is not None) else kind}"
        path = f"{where}{S.ROWS_PRESENT_SUFFIX}"
        if spec is None or spec.index != "position" or (kind, layer) not in self._present:
            self._bad(f"{path!r} flags rows of a tensor this trace does not store by position")
        ds = self._dset(path, 1, "b")
        rows = self.f[S.tensor_path(kind, layer)].shape[0]
        if ds.shape != (rows,):
            self._bad(f"{path!r} has shape {ds.shape}, expected ({rows},): one flag per row of {kind}")
        self._flags.add((kind, layer))

    def rows_present(self, kind: str, layer: int | None = None) -> np.ndarray | None:
        """(rows,) bool: which rows of a kind hold data (a runtime may report a subset of a step's
        rows; the others are zeros); None when every row does."""
        if (kind, layer) not in self._flags:
            return None
        return self._read_small(self.f[S.rows_present_path(kind, layer)]).astype(bool)

    def _check_declared(self) -> None:
        """All datasets together may declare only so much for the file's size: a dataset of zeros
        compressed a thousandfold (a compression bomb) would cost time and memory to inflate."""
        self._at = "the sizes of the datasets"
        allowed = max(LIM.MIN_DECLARED, LIM.EXPANSION * self.file_size)
        if self._declared > allowed:
            self._bad(f"its datasets declare {LIM.fmt_bytes(self._declared)} of data in a file of "
                      f"{LIM.fmt_bytes(self.file_size)} (at most {LIM.EXPANSION}x the file size, or "
                      f"{LIM.fmt_bytes(LIM.MIN_DECLARED)}): a compression bomb or a damaged file")

    # ------------------------------------------------------------------ info
    @property
    def mode(self) -> str:
        return self.provenance["mode"]

    @property
    def model_config(self) -> dict:
        return json.loads(self.provenance["model_config"])

    @property
    def prompt_len(self) -> int:
        return self.step_positions[0][1]

    @property
    def n_steps(self) -> int:
        return len(self.step_positions)

    @property
    def n_positions(self) -> int:
        return self.step_positions[-1][1]

    def extra_shapes(self) -> dict[str, tuple]:
        """Shapes of the extra inputs (nothing read)."""
        return {k: tuple(self.f[S.input_extra_path(k)].shape) for k in self._extra_names}

    def extra_inputs(self) -> dict[str, np.ndarray]:
        out = {}
        for k in self._extra_names:
            ds = self.f[S.input_extra_path(k)]
            self._check_memory(ds, _nbytes(ds.shape, ds.dtype))
            out[k] = self._read_small(ds)
        return out

    def header(self) -> TraceHeader:
        """The trace's header, whole (the extra inputs are read): what a copy of it writes."""
        return TraceHeader(
            Provenance.from_dict(self.provenance), self.prompt_ids, self.layers, max_new_tokens=self.max_new_tokens,
            eos_token_ids=self.eos_token_ids, prompt_text=self.prompt_text,
            chat_template_applied=self.chat_template_applied, extra_inputs=self.extra_inputs(),
        )

    def has(self, kind: str, layer: int | None = None) -> bool:
        return (kind, layer) in self._present

    def dataset(self, kind: str, layer: int | None = None) -> h5py.Dataset:
        if (kind, layer) not in self._present:
            where = f"layer {layer} " if layer is not None else ""
            raise _file_error(f"{self.path} has no {where}{kind!r} tensor")
        return self.f[S.tensor_path(kind, layer)]

    def storage_size(self, kind: str, layer: int | None = None) -> int:
        """Bytes a kind's dataset takes on disk (walks its chunk index, reads no data)."""
        ds = self.dataset(kind, layer)
        try:
            return ds.id.get_storage_size()
        except READ_ERRORS as e:
            raise _corrupt(
                f"{self.path} is damaged: the chunk index of {ds.name.lstrip('/')!r} cannot be read ({one_line(e, 200)}); "
                f"{ADVICE}"
            ) from None

    def source_dtype(self, kind: str, layer: int | None = None) -> str:
        return _attr_text(self.dataset(kind, layer).attrs.get(S.ATTR_SOURCE_DTYPE, "float32"))

    def _check_memory(self, ds: h5py.Dataset, nbytes: int) -> None:
        if self._memory is not None and nbytes > self._memory:
            raise TraceToolError(
                f"reading {ds.name.lstrip('/')!r} of {self.path} needs {LIM.fmt_bytes(nbytes)} of memory, more than "
                f"the {LIM.fmt_bytes(self._memory)} available"
            )

    def read(self, kind: str, layer: int | None = None, rows: slice = slice(None)) -> np.ndarray:
        """Rows of a kind: by position for position-indexed kinds, by step for step kinds."""
        ds = self.dataset(kind, layer)
        n = len(range(*rows.indices(ds.shape[0])))
        self._check_memory(ds, _nbytes((n, *ds.shape[1:]), ds.dtype))
        try:
            return ds[rows]
        except READ_ERRORS as e:
            raise self._corrupt_data(ds.name, e) from None

    def tokens(self) -> np.ndarray:
        return self._tokens.copy()

    def kinds_present(self) -> list[tuple[str, int | None]]:
        """(kind, layer) pairs stored, in data-flow order."""
        out = []
        for spec in S.KINDS:
            layers = range(len(self.layers)) if spec.per_layer else [None]
            out += [(spec.name, l) for l in layers if self.has(spec.name, l)]
        return out

    # ------------------------------------------------------------------ hash
    def content_hash(self) -> str:
        """sha256 over names, attributes, dtypes, shapes and values (not file bytes).

        Hashes exactly the objects validated on open (every object of a valid trace), reached
        the same way: through hard links only; large datasets are read in blocks."""
        h = hashlib.sha256()

        def text(v) -> str:  # undecodable bytes hash as themselves (surrogateescape), valid text as before
            return v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else _attr_text(v)

        def visit(name: str, obj) -> None:
            h.update(f"\0{name}\0{type(obj).__name__}\0".encode("utf-8", "surrogateescape"))
            for k in sorted(obj.attrs):
                h.update(f"{k}={text(obj.attrs[k])}\0".encode("utf-8", "surrogateescape"))
            if isinstance(obj, h5py.Dataset):
                h.update(f"{obj.dtype.str}{obj.shape}\0".encode())
                if obj.shape is None:  # an empty (null dataspace) dataset: no values
                    return
                if obj.shape == () or obj.ndim == 0:
                    h.update(np.asarray(obj[()]).tobytes())
                elif obj.dtype.kind == "O":
                    h.update(json.dumps([text(x) for x in obj[()]]).encode())
                else:
                    block = max(1, HASH_BLOCK_BYTES // max(1, _nbytes(obj.shape[1:], obj.dtype)))
                    for i in range(0, obj.shape[0], block):
                        h.update(np.ascontiguousarray(obj[i : i + block]).tobytes())

        for name in ["/", *sorted(self._objects)]:
            obj = None
            try:
                obj = self.f if name == "/" else self.f[name]
                visit(name, obj)
            except READ_ERRORS as e:
                if isinstance(obj, h5py.Dataset):
                    raise self._corrupt_data(name, e) from None
                raise _corrupt(f"{self.path} is damaged: reading {name!r} failed ({one_line(e, 200)}); {ADVICE}") from None
        return h.hexdigest()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # read-only: nothing to lose if a damaged file fails to close
            self.f.close()

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _file_kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return word
    return "not a regular file"


def _corrupt(msg: str) -> TraceCorruptError:
    return TraceCorruptError(one_line(msg))


def _file_error(msg: str) -> TraceFileError:
    return TraceFileError(one_line(msg))
