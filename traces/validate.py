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
are traces/objects.py's; this module checks the schema on top of it: the header (everything outside
tensors/) in traces/validate_header.py, the tensors here.
"""

from __future__ import annotations

import numpy as np

from . import limits as LIM
from . import schema as S
from .objects import Checked, nbytes, read_small
from .rows import row_word, tower_rows
from .validate_header import HeaderChecks


class Validator(HeaderChecks):
    """Walks an open trace file once along the schema's names; `run()` returns what it checked or
    raises one line."""

    def run(self) -> Checked:
        self._visit(self.f, "/")
        self._check_schema()
        self._members(self.f, "/", S.MEMBERS["/"])
        self._check_provenance()
        self._check_selection()
        self._check_max_seq()
        self._check_inputs()
        self._check_model()
        self._check_towers()
        self._check_steps()
        self._check_tensors()
        self._check_declared()
        return self.out

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
