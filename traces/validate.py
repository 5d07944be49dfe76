"""The structure checks a trace passes on open, before any tensor data is read.

A trace is untrusted input (docs/robustness.md, "Threat model"). `Validator` checks
everything that can be checked without reading tensor data: the object tree is walked only
along the names the schema defines, and every name must be a hard link to an object no
other name reaches (no soft or external links); every dataset keeps its bytes inside the
file (contiguous, chunked or compact layout, no external storage, no virtual layout, only
HDF5's built-in filters); every attribute is small (limits.MAX_ATTR_BYTES); the schema
name and version, the provenance and input attributes, prompt ids, per-layer metadata and
step positions (small datasets, sizes checked before they are read); and for every tensor
dataset its place in the layout, dtype, rank, rows (one per position or per step), the row
axes the layer metadata fixes, and a row width the model config can justify. All datasets
together may declare only so many bytes for the file's size (limits.EXPANSION: a
compression bomb is refused). A file that fails raises TraceCorruptError (or
TraceFileError when it is no trace at all): one line naming the file, what is wrong and
what to do.

The helpers at the end (reading a small dataset, the error messages) serve the reader too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from . import limits as LIM
from . import schema as S
from .errors import TraceCorruptError, TraceFileError, interrupted, one_line
from .layers import LayerInfo

ADVICE = "re-record it, or copy it again if it was transferred"
DTYPE_WORDS = {"f": "float16, float32 or float64", "b": "bool", "iu": "integer", "biuf": "numbers"}
# exceptions h5py raises on data it cannot read back (checksum, decompression, damaged index)
READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError)
_LAYER_GROUP = re.compile(rf"^{S.LAYER_GROUP_PREFIX}(\d+)$")
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
_METADATA = f"the per-layer metadata under '{S.GROUP_MODEL}/'"
_HEAD_CAPS = (
    (S.FIELD_HEAD_DIM, LIM.MAX_HEAD_DIM),
    (S.FIELD_NUM_HEADS, LIM.MAX_HEADS),
    (S.FIELD_NUM_KV_HEADS, LIM.MAX_HEADS),
)


@dataclass
class Checked:
    """What validation read and checked: the reader serves it."""

    provenance: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    selection: object = None  # a selective recording's Selection (traces/selection.py); None: everything
    prompt_ids: np.ndarray | None = None
    max_new_tokens: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    chat_template_applied: bool = False
    extra_names: list[str] = field(default_factory=list)
    layers: list[LayerInfo] = field(default_factory=list)
    step_positions: list[tuple[int, int]] = field(default_factory=list)
    present: set = field(default_factory=set)  # (kind, layer) stored
    flags: set = field(default_factory=set)  # (kind, layer) with a rows_present dataset
    bf16: set = field(default_factory=set)  # (kind, layer) stored as bfloat16 bit patterns (schema.STORAGE_BF16)
    tokens: np.ndarray | None = None
    objects: list[str] = field(default_factory=list)  # every group and dataset, as walked (content_hash hashes these)


class _Objects:
    """The HDF5 discipline of every object a trace walk reaches, whatever the schema says of it:
    hard links only, one name per object, few and small attributes, bytes inside the file, and
    small datasets read only after their declared size is checked.

    `at` names what was being read, for the reader's message when h5py itself fails."""

    def __init__(self, f: h5py.File, path: Path, file_size: int):
        self.f, self.path, self.file_size = f, path, file_size
        self.at = "the file header"
        self.out = Checked()
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
            size = aid.get_storage_size()
            n = int(np.prod(aid.shape)) if aid.shape else 1
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


class Validator(_Objects):
    """Walks an open trace file once along the schema's names; `run()` returns what it checked or
    raises one line."""

    def run(self) -> Checked:
        self._visit(self.f, "/")
        self._check_schema()
        self._members(self.f, "/", S.MEMBERS["/"])
        self._check_provenance()
        self._check_selection()
        self._check_inputs()
        self._check_model()
        self._check_steps()
        self._check_tensors()
        self._check_declared()
        return self.out

    # ------------------------------------------------------------------ header
    def _check_schema(self) -> None:
        attrs = self.f.attrs
        self.at = "the root attributes"
        name = attrs.get(S.ATTR_SCHEMA)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if not (isinstance(name, str) and name == S.SCHEMA_NAME):
            what = (
                f"has no {S.ATTR_SCHEMA!r} attribute"
                if name is None
                else f"its {S.ATTR_SCHEMA!r} attribute is {describe(name)}"
            )
            raise file_error(
                f"{self.path} is an HDF5 file but not a {S.SCHEMA_NAME} trace ({what}); "
                "pass a trace written by 'trace record' or 'trace replay'"
            )
        version = attrs.get(S.ATTR_SCHEMA_VERSION)
        if version is None:
            self._bad(f"the root attribute {S.ATTR_SCHEMA_VERSION!r} is missing")
        v = as_int(version)
        if v is None:
            self._bad(f"the root attribute {S.ATTR_SCHEMA_VERSION!r} should be an integer, got {describe(version)}")
        if v > S.SCHEMA_VERSION:
            raise file_error(
                f"{self.path} has trace schema version {v}, newer than this tool reads ({S.SCHEMA_VERSION}); "
                "upgrade gemma4-trace to read it"
            )
        if v != S.SCHEMA_VERSION:
            raise file_error(
                f"{self.path} has trace schema version {v}; this tool reads version {S.SCHEMA_VERSION}"
                " (re-record it with this version)"
            )

    def _check_provenance(self) -> None:
        prov = {k: self._text_attr(self.f, k, "the root") for k in S.PROVENANCE_KEYS}
        mode = prov[S.ATTR_MODE]
        if mode not in S.MODES:
            self._bad(f"the root attribute {S.ATTR_MODE!r} is {mode!r}, not one of {', '.join(S.MODES)}")
        try:
            cfg = json.loads(prov[S.ATTR_MODEL_CONFIG])
        except (ValueError, RecursionError):
            cfg = None
        if not isinstance(cfg, dict):
            self._bad(f"the root attribute {S.ATTR_MODEL_CONFIG!r} is not a JSON object")
        self.out.provenance, self.out.config = prov, cfg

    def _check_selection(self) -> None:
        if S.ATTR_SELECTION not in self.f.attrs:
            return
        from .selection import Selection

        try:
            self.out.selection = Selection.from_json(self._text_attr(self.f, S.ATTR_SELECTION, "the root"))
        except (ValueError, RecursionError) as e:
            self._bad(f"the root attribute {S.ATTR_SELECTION!r} is not a valid selection ({one_line(str(e), 120)})")

    def _check_inputs(self) -> None:
        g = self._group(S.GROUP_INPUTS)
        self._members(g, S.GROUP_INPUTS, S.MEMBERS[S.GROUP_INPUTS])
        self._check_prompt_ids()
        self._check_input_attrs(g)
        if S.leaf(S.GROUP_INPUT_EXTRA) in g:
            self._check_extra_inputs()

    def _check_prompt_ids(self) -> None:
        ids = self._small(self._dset(S.DSET_PROMPT_IDS, 1, "iu"), LIM.MAX_POSITIONS, "prompt ids")
        if ids.size == 0:
            self._bad(f"{S.DSET_PROMPT_IDS!r} is empty")
        if (ids < 0).any() or (ids.dtype.kind == "u" and (ids > np.iinfo(np.int64).max).any()):
            self._bad(f"{S.DSET_PROMPT_IDS!r} holds ids out of range ({int(ids.min())}..{int(ids.max())})")
        self.out.prompt_ids = ids.astype(np.int64)

    def _check_input_attrs(self, g: h5py.Group) -> None:
        out, where, n_ids = self.out, f"{S.GROUP_INPUTS!r}", self.out.prompt_ids.size
        out.max_new_tokens = self._int_attr(g, S.ATTR_MAX_NEW_TOKENS, where, 1)
        if n_ids + out.max_new_tokens > LIM.MAX_POSITIONS:
            self._bad(
                f"the attribute {S.ATTR_MAX_NEW_TOKENS!r} of {where} is {out.max_new_tokens}: with the "
                f"{n_ids} prompt ids that is more than {LIM.MAX_POSITIONS} positions"
            )
        eos = np.asarray(self._attr(g, S.ATTR_EOS_TOKEN_IDS, where))
        if eos.ndim > 1 or (eos.size and eos.dtype.kind not in "iu"):
            self._bad(f"the attribute {S.ATTR_EOS_TOKEN_IDS!r} of {where} should be integers, got {describe(eos)}")
        out.eos_token_ids = [int(x) for x in eos.reshape(-1)]
        out.prompt_text = self._text_attr(g, S.ATTR_PROMPT_TEXT, where)
        chat = self._attr(g, S.ATTR_CHAT_TEMPLATE_APPLIED, where)
        if not (isinstance(chat, (bool, np.bool_)) or as_int(chat) in (0, 1)):
            self._bad(
                f"the attribute {S.ATTR_CHAT_TEMPLATE_APPLIED!r} of {where} should be a bool, got {describe(chat)}"
            )
        out.chat_template_applied = bool(chat)

    def _check_extra_inputs(self) -> None:
        extra = self._group(S.GROUP_INPUT_EXTRA)
        names = sorted(self._members(extra, S.GROUP_INPUT_EXTRA, None))
        if len(names) > LIM.MAX_EXTRA_INPUTS:
            self._bad(f"{S.GROUP_INPUT_EXTRA!r} holds {len(names)} inputs (at most {LIM.MAX_EXTRA_INPUTS})")
        for name in names:
            self._dset(S.input_extra_path(name), None, "biuf")
        self.out.extra_names = names

    # ------------------------------------------------------------------ model and steps
    def _check_model(self) -> None:
        self._members(self._group(S.GROUP_MODEL), S.GROUP_MODEL, S.MEMBERS[S.GROUP_MODEL])
        fields = {k: self._layer_field(k) for k in S.LAYER_FIELDS}
        n = len(fields[S.FIELD_LAYER_TYPE])
        lengths = {k: len(v) for k, v in fields.items()}
        if n == 0 or any(x != n for x in lengths.values()):
            self._bad(f"{_METADATA} has inconsistent lengths {lengths}")
        self.at = _METADATA
        for i in range(n):
            self._check_layer(fields, i)
        self.out.layers = [LayerInfo(**{k: fields[k][i] for k in S.LAYER_FIELDS}) for i in range(n)]

    def _layer_field(self, k: str) -> list:
        """One per-layer metadata dataset: text or integers, at most MAX_LAYERS entries."""
        path = S.model_field_path(k)
        text = k in S.LAYER_TEXT_FIELDS
        ds = self._dset(path, 1)
        if text and h5py.check_string_dtype(ds.dtype) is None:
            self._bad(f"the dataset {path!r} has dtype {ds.dtype}, expected strings")
        if not text and ds.dtype.kind not in "iu":
            self._bad(f"the dataset {path!r} has dtype {ds.dtype}, expected integer")
        vals = self._small(ds, LIM.MAX_LAYERS, "layers", vlen_text=text)
        if not text:
            return [int(x) for x in vals]
        try:
            return [attr_text(x) for x in vals]
        except UnicodeDecodeError:
            self._bad(f"the dataset {path!r} holds text that is not UTF-8")

    def _check_layer(self, fields: dict, i: int) -> None:
        lt, role, src = fields[S.FIELD_LAYER_TYPE][i], fields[S.FIELD_KV_ROLE][i], fields[S.FIELD_KV_SOURCE][i]
        path = S.model_field_path
        if lt not in S.LAYER_TYPE_SHORT:
            self._bad(f"{path(S.FIELD_LAYER_TYPE)} of layer {i} is {lt!r}, not one of {', '.join(S.LAYER_TYPE_SHORT)}")
        if role not in S.KV_ROLES:
            self._bad(f"{path(S.FIELD_KV_ROLE)} of layer {i} is {role!r}, not one of {', '.join(S.KV_ROLES)}")
        for k, cap in _HEAD_CAPS:
            if not 1 <= fields[k][i] <= cap:
                self._bad(f"{path(k)} of layer {i} is {fields[k][i]}, expected 1..{cap}")
        ok = (src == i) if role != "reuses" else (0 <= src < i and fields[S.FIELD_KV_ROLE][src] != "reuses")
        if not ok:
            self._bad(
                f"{path(S.FIELD_KV_SOURCE)} of layer {i} is {src}, impossible for a layer whose kv_role is {role!r}"
            )

    def _check_steps(self) -> None:
        self._members(self._group(S.GROUP_STEPS), S.GROUP_STEPS, S.MEMBERS[S.GROUP_STEPS])
        sp_ds = self._dset(S.DSET_STEP_POSITIONS, 2, "iu")
        max_new = self.out.max_new_tokens
        if sp_ds.shape[0] > max_new:
            self._bad(f"it has {sp_ds.shape[0]} steps but {S.ATTR_MAX_NEW_TOKENS} is {max_new}")
        sp = self._small(sp_ds, LIM.MAX_POSITIONS, "steps")
        if sp.shape[0] == 0 or sp.shape[1] != 2:
            self._bad(f"{S.DSET_STEP_POSITIONS!r} has shape {sp.shape}, expected (n_steps >= 1, 2)")
        steps = [(int(a), int(b)) for a, b in sp]
        T = int(self.out.prompt_ids.size)
        for s, (a, b) in enumerate(steps):
            want = (0, T) if s == 0 else (T + s - 1, T + s)
            if (a, b) != want:
                self._bad(
                    f"{S.DSET_STEP_POSITIONS!r}: step {s} feeds positions [{a}, {b}), expected [{want[0]}, "
                    f"{want[1]}) (a prefill over the {T} prompt ids, then one position per decode step)"
                )
        self.out.step_positions = steps

    # ------------------------------------------------------------------ tensors
    def _check_tensors(self) -> None:
        present, flags = self._tensor_names()
        if (S.KIND_TOKEN, None) not in present:
            self._bad(f"the dataset '{S.tensor_path(S.KIND_TOKEN, None)}' (the chosen tokens) is missing")
        limits = LIM.row_limits(self.out.config, self.out.layers)
        for kind, layer in present:
            self._check_tensor(kind, layer, limits[kind])
        self.out.present = set(present)
        for kind, layer in flags:
            self._check_rows_present(kind, layer)
        self._check_tokens()

    def _tensor_names(self) -> tuple[list, list]:
        """(kind, layer) of every tensor under tensors/, and of every <kind>.rows_present (which rows
        a runtime reported), after checking each name belongs where it is."""
        g = self._group(S.GROUP_TENSORS)
        present: list[tuple[str, int | None]] = []
        flags: list[tuple[str, int | None]] = []
        for name in g:
            obj_path = f"{S.GROUP_TENSORS}/{name}"
            if name.endswith(S.ROWS_PRESENT_SUFFIX):
                flags.append((name.removesuffix(S.ROWS_PRESENT_SUFFIX), None))
                continue
            m = _LAYER_GROUP.match(name)
            if m and S.layer_group(int(m.group(1))) == obj_path:
                self._layer_tensor_names(obj_path, int(m.group(1)), present, flags)
                continue
            spec = S.KIND_BY_NAME.get(name)
            if spec is None or spec.per_layer:
                self._bad(f"{obj_path!r} is neither a global kind nor a layer group (L00, L01, ...)")
            present.append((name, None))
        return present, flags

    def _layer_tensor_names(self, obj_path: str, layer: int, present: list, flags: list) -> None:
        n_layers = len(self.out.layers)
        if layer >= n_layers:
            self._bad(f"{obj_path!r} is a layer group, but the model has {n_layers} layers")
        for kind in self._group(obj_path):
            if kind.endswith(S.ROWS_PRESENT_SUFFIX):
                flags.append((kind.removesuffix(S.ROWS_PRESENT_SUFFIX), layer))
                continue
            spec = S.KIND_BY_NAME.get(kind)
            if spec is None or not spec.per_layer:
                self._bad(f"{obj_path}/{kind!r} is not a per-layer kind ({', '.join(S.LAYER_KIND_NAMES)})")
            present.append((kind, layer))

    def _check_tensor(self, kind: str, layer: int | None, row_limit: int) -> None:
        path = S.tensor_path(kind, layer)
        spec = S.KIND_BY_NAME[kind]
        ds = self._dset(path, 1 + spec.row_ndim)
        self._text_attr(ds, S.ATTR_SOURCE_DTYPE, repr(path))
        if S.ATTR_STORAGE in ds.attrs:  # bfloat16 values stored as their 16-bit patterns
            storage = self._text_attr(ds, S.ATTR_STORAGE, repr(path))
            if spec.dtype != "float" or storage != S.STORAGE_BF16:
                self._bad(
                    f"{path!r} says its values are stored as {storage[:40]!r}; only a float kind may say "
                    f"{S.STORAGE_BF16!r}"
                )
            if ds.dtype.kind != "u" or ds.dtype.itemsize != 2:
                self._bad(f"the dataset {path!r} has dtype {ds.dtype}, expected uint16 ({S.STORAGE_BF16})")
            self.out.bf16.add((kind, layer))
        else:
            self._check_dtype(ds, path, S.DTYPE_KINDS[spec.dtype])
        self.at = path
        rows, row = ds.shape[0], ds.shape[1:]
        if any(d < 1 for d in row):
            self._bad(f"{path!r} has shape {ds.shape}: an empty row")
        n_steps, steps = len(self.out.step_positions), self.out.step_positions
        if spec.index == "step":
            if rows != n_steps:
                self._bad(f"{path!r} has {rows} rows, expected {n_steps} (one per step)")
        elif not steps[0][1] <= rows <= steps[-1][1]:
            # fewer rows than positions (ending on a step) is a runtime that stopped reporting the kind:
            # the diff reports it as a 'rows' divergence
            self._bad(f"{path!r} has {rows} rows, expected {steps[-1][1]} (one per position)")
        self._check_row_axes(path, spec, layer, row)
        elements = nbytes(row, np.uint8)
        if elements > row_limit:
            self._bad(
                f"{path!r} has rows of shape {row} ({elements} values), more than the model config "
                f"justifies ({row_limit})"
            )

    def _check_row_axes(self, path: str, spec: S.Kind, layer: int | None, row: tuple) -> None:
        """The row axes the layer metadata fixes (heads, KV heads, layers) have exactly that size."""
        layers = self.out.layers
        li = layers[layer] if layer is not None else None
        for axis, size in zip(spec.axes, row):
            want = len(layers) if axis.meta == "layers" else getattr(li, axis.meta) if li and axis.meta else None
            if want is not None and size != want:
                what = axis.meta.removeprefix("num_").replace("kv_", "KV ")  # heads, KV heads, layers
                self._bad(f"{path!r} has rows of shape {row}, but the model metadata says {want} {what}")

    def _check_rows_present(self, kind: str, layer: int | None) -> None:
        """<kind>.rows_present: (rows,) bool beside the position-indexed kind whose rows it flags."""
        spec = S.KIND_BY_NAME.get(kind)
        where = f"{S.tensor_path(kind, layer) if spec and spec.per_layer == (layer is not None) else kind}"
        path = f"{where}{S.ROWS_PRESENT_SUFFIX}"
        if spec is None or spec.index != "position" or (kind, layer) not in self.out.present:
            self._bad(f"{path!r} flags rows of a tensor this trace does not store by position")
        ds = self._dset(path, 1, "b")
        rows = self.f[S.tensor_path(kind, layer)].shape[0]
        if ds.shape != (rows,):
            self._bad(f"{path!r} has shape {ds.shape}, expected ({rows},): one flag per row of {kind}")
        self.out.flags.add((kind, layer))

    def _check_tokens(self) -> None:
        """The chosen tokens are tiny and every command needs them: read and check them now."""
        path = S.tensor_path(S.KIND_TOKEN, None)
        t = read_small(self.path, self.f[path])
        if t.size and (t.min() < 0 or t.max() > np.iinfo(np.int64).max):
            self._bad(f"{path!r} holds token ids out of range ({t.min()}..{t.max()})")
        self.out.tokens = t.astype(np.int64).reshape(-1)


# ---------------------------------------------------------------------- shared with the reader
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
