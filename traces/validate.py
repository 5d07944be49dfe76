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

The object-level discipline (links, attributes, storage, bounded reads) and the error messages
are traces/objects.py's; this module checks the schema on top of it.
"""

from __future__ import annotations

import json

import h5py
import numpy as np

from . import limits as LIM
from . import schema as S
from .errors import one_line
from .layers import LayerInfo, TowerInfo, tower_sizes
from .objects import Checked, ObjectChecks, as_int, attr_text, describe, file_error, nbytes, read_small
from .rows import row_word, tower_rows

_TOWER_CAPS = {"layers": LIM.MAX_LAYERS, "hidden": LIM.MAX_HIDDEN, "heads": LIM.MAX_HEADS, "head_dim": LIM.MAX_HEAD_DIM}
_METADATA = f"the per-layer metadata under '{S.GROUP_MODEL}/'"
_HEAD_CAPS = (
    (S.FIELD_HEAD_DIM, LIM.MAX_HEAD_DIM),
    (S.FIELD_NUM_HEADS, LIM.MAX_HEADS),
    (S.FIELD_NUM_KV_HEADS, LIM.MAX_HEADS),
)


class Validator(ObjectChecks):
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
        self._check_towers()
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
        if v < S.TEXT_SCHEMA_VERSION:
            raise file_error(
                f"{self.path} has trace schema version {v}; this tool reads versions "
                f"{S.TEXT_SCHEMA_VERSION}-{S.SCHEMA_VERSION} (re-record it with this version)"
            )
        self.version = v
        # version 1: the text tower alone; version 2: encoder towers too (a towers/ table)
        if (S.GROUP_TOWERS in self.f) != (v > S.TEXT_SCHEMA_VERSION):
            what = "has no towers/ table" if v > S.TEXT_SCHEMA_VERSION else "holds a towers/ table"
            self._bad(f"it is schema version {v} but {what} (version 1: the text tower alone; 2: encoder towers)")

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

    def _check_towers(self) -> None:
        """Version 2: the encoder tower table, each tower's sizes as its sub-config says, its soft
        tokens as many as the prompt's tokens for them."""
        if self.version == S.TEXT_SCHEMA_VERSION:
            return
        g = self._group(S.GROUP_TOWERS)
        names = self._members(g, S.GROUP_TOWERS, S.ENCODER_TOWERS)
        if not names:
            self._bad(f"its {S.GROUP_TOWERS!r} table is empty (a version-2 trace records an encoder tower)")
        for name in sorted(names, key=S.ENCODER_TOWERS.index):
            self.out.towers[name] = self._tower(S.TOWER_BY_NAME[name])

    def _tower(self, tower: S.Tower) -> TowerInfo:
        path = S.tower_path(tower.name)
        self._members(self._group(path), path, S.TOWER_DSETS)
        g = self.f[path]
        sizes = {k: self._int_attr(g, k, repr(path), 1) for k in S.TOWER_ATTRS}
        for k, cap in _TOWER_CAPS.items():
            if sizes[k] > cap:
                self._bad(f"the attribute {k!r} of {path!r} is {sizes[k]}, expected 1..{cap}")
        config = tower_sizes(self.out.config, tower)
        if config is None or not isinstance(self.out.config.get(tower.config), dict):
            self._bad(f"it records a {tower.name} tower, but its model config has no {tower.config!r} object")
        missing = [k for k in S.TOWER_ATTRS if k not in config]
        if missing:  # what the table says cannot be checked: no writer of ours records such a tower
            self._bad(f"its model config's {tower.config} gives no {', '.join(missing)} (a positive integer)")
        for k, v in sizes.items():
            if k in config and config[k] != v:
                self._bad(
                    f"{path!r} says {k} {v}, but the model config's {tower.config} says {config[k]}: "
                    "the tower table disagrees with the model config"
                )
        counts = []
        for name in S.TOWER_DSETS:
            ds = self._dset(S.tower_path(tower.name, name), 1, "iu")
            vals = self._small(ds, LIM.MAX_EXTRA_INPUTS, "images or clips")
            if vals.size == 0 or (vals < 1).any() or int(vals.sum(dtype=np.float64)) > LIM.MAX_POSITIONS:
                self._bad(f"{ds.name.lstrip('/')!r} holds {describe(vals)}: expected 1..{LIM.MAX_POSITIONS} per item")
            counts.append(tuple(int(x) for x in vals))
        if len(counts[0]) != len(counts[1]):
            self._bad(f"{path!r}: {len(counts[0])} items' rows but {len(counts[1])} items' soft tokens")
        token_id = self.out.config.get(tower.token_id)
        if isinstance(token_id, int) and not isinstance(token_id, bool):
            n = int((self.out.prompt_ids == token_id).sum())
            if n != sum(counts[1]):
                self._bad(
                    f"{path!r} declares {sum(counts[1])} soft tokens, but the prompt holds {n} of its "
                    f"{tower.token_id} ({token_id})"
                )
        return TowerInfo(tower.name, item_rows=counts[0], item_tokens=counts[1], **sizes)

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
        limits = LIM.row_limits(self.out.config, self.out.layers, self.out.towers)
        for kind, layer in present:
            self._check_tensor(kind, layer, limits[kind])
        self.out.present = set(present)
        for kind, layer in flags:
            self._check_rows_present(kind, layer)
        self._check_tokens()

    def _tensor_names(self) -> tuple[list, list]:
        """(kind key, layer) of every tensor under tensors/ (and tensors/<tower>/ for the encoder
        towers the trace records), and of every <kind>.rows_present (which rows a runtime reported),
        after checking each name belongs where it is."""
        present: list[tuple[str, int | None]] = []
        flags: list[tuple[str, int | None]] = []
        self._tower_names(S.TEXT, present, flags)
        for tower in self.out.towers:
            self._tower_names(tower, present, flags)
        return present, flags

    def _tower_names(self, tower: str, present: list, flags: list) -> None:
        group = S.tower_group(tower)
        if tower != S.TEXT and self._child(group) is None:
            return  # the tower is recorded, none of its kinds kept (a selection)
        g = self._group(group)
        for name in g:
            obj_path = f"{group}/{name}"
            if tower == S.TEXT and name in self.out.towers:
                continue  # tensors/vision: walked as its own tower
            if name.endswith(S.ROWS_PRESENT_SUFFIX):
                flags.append((S.kind_key(name.removesuffix(S.ROWS_PRESENT_SUFFIX), tower), None))
                continue
            layer = S.layer_number(name)  # L07, as the writer names layer groups; None for anything else
            if layer is not None:
                self._layer_tensor_names(obj_path, layer, tower, present, flags)
                continue
            spec = S.KIND_BY_NAME.get(S.kind_key(name, tower))
            if spec is None or spec.per_layer or spec.tower != tower:
                self._bad(f"{obj_path!r} is neither a global kind nor a layer group (L00, L01, ...)")
            present.append((spec.key, None))

    def _layer_tensor_names(self, obj_path: str, layer: int, tower: str, present: list, flags: list) -> None:
        n_layers = len(self.out.layers) if tower == S.TEXT else self.out.towers[tower].layers
        if layer >= n_layers:
            self._bad(f"{obj_path!r} is a layer group, but the {tower_word(tower)} has {n_layers} layers")
        for kind in self._group(obj_path):
            if kind.endswith(S.ROWS_PRESENT_SUFFIX):
                flags.append((S.kind_key(kind.removesuffix(S.ROWS_PRESENT_SUFFIX), tower), layer))
                continue
            spec = S.KIND_BY_NAME.get(S.kind_key(kind, tower))
            if spec is None or not spec.per_layer or spec.tower != tower:
                names = [k.name for k in S.TOWER_BY_NAME[tower].kinds if k.per_layer]
                self._bad(f"{obj_path}/{kind!r} is not a per-layer kind ({', '.join(names)})")
            present.append((spec.key, layer))

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
        if spec.encoder:
            want = tower_rows(spec, self.out.towers[spec.tower])
            if rows != want:
                self._bad(f"{path!r} has {rows} rows, expected {want} (one per {row_word(spec)}, as its tower says)")
        elif spec.by_step:
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
        li = layers[layer] if layer is not None and not spec.encoder else None  # an encoder's layers are its own
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
        if spec is None or not spec.by_position or (kind, layer) not in self.out.present:
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


def tower_word(tower: str) -> str:
    return "model" if tower == S.TEXT else f"{tower} tower"


# ---------------------------------------------------------------------- shared with the reader
