"""TraceReader: opens a trace, checks its schema and version, serves canonical tensors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np

from . import schema as S
from .errors import TraceCorruptError, TraceFileError
from .layers import LayerInfo

HASH_BLOCK_ROWS = 4096


def _attr_text(v) -> str:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return json.dumps(v.tolist())
    if isinstance(v, np.generic):
        return json.dumps(v.item())
    return json.dumps(v) if not isinstance(v, str) else v


class TraceReader:
    """Read-only view of a trace. Use as a context manager or call close()."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise TraceFileError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise TraceFileError(f"{self.path} is a folder, not a trace file")
        try:
            self.f = h5py.File(self.path, "r", locking=False)
        except OSError as e:
            raise TraceFileError(f"{self.path} is not a readable HDF5 trace ({_short(e)})") from None
        try:
            self._check_schema()
            self._load_header()
        except (KeyError, ValueError, TypeError, OSError) as e:
            self.f.close()
            raise TraceCorruptError(f"{self.path}: damaged trace ({_short(e)})") from None
        except BaseException:
            self.f.close()
            raise

    def _check_schema(self) -> None:
        name = self.f.attrs.get(S.ATTR_SCHEMA)
        if isinstance(name, bytes):
            name = name.decode()
        if name != S.SCHEMA_NAME:
            raise TraceFileError(f"{self.path} is an HDF5 file but not a {S.SCHEMA_NAME} trace")
        version = self.f.attrs.get(S.ATTR_SCHEMA_VERSION)
        if version is None or int(version) != S.SCHEMA_VERSION:
            raise TraceFileError(
                f"{self.path} has trace schema version {version}; this tool reads version {S.SCHEMA_VERSION}"
                " (re-record it with this version)"
            )

    def _load_header(self) -> None:
        f = self.f
        self.provenance = {k: _attr_text(f.attrs[k]) for k in S.PROVENANCE_KEYS}
        self.prompt_ids = f[S.DSET_PROMPT_IDS][()].astype(np.int64)
        g = f[S.GROUP_INPUTS]
        self.max_new_tokens = int(g.attrs["max_new_tokens"])
        self.eos_token_ids = [int(x) for x in np.asarray(g.attrs["eos_token_ids"]).reshape(-1)]
        self.prompt_text = _attr_text(g.attrs["prompt_text"])
        self.chat_template_applied = bool(g.attrs["chat_template_applied"])
        fields = {k: f[S.model_field_path(k)][()] for k in S.LAYER_FIELDS}
        n = len(fields["layer_type"])
        self.layers = [
            LayerInfo(
                **{k: (_attr_text(fields[k][i]) if k in ("layer_type", "kv_role") else int(fields[k][i])) for k in fields}
            )
            for i in range(n)
        ]
        self.step_positions = [tuple(int(x) for x in row) for row in f[S.DSET_STEP_POSITIONS][()]]
        if not self.step_positions:
            raise ValueError("no steps")
        if any(a >= b for a, b in self.step_positions):
            raise ValueError("step positions out of order")

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

    def step_of_position(self, pos: int) -> int:
        return 0 if pos < self.prompt_len else pos - self.prompt_len + 1

    def extra_inputs(self) -> dict[str, np.ndarray]:
        g = self.f.get(S.GROUP_INPUT_EXTRA)
        return {} if g is None else {k: g[k][()] for k in g}

    def has(self, kind: str, layer: int | None = None) -> bool:
        return S.tensor_path(kind, layer) in self.f

    def dataset(self, kind: str, layer: int | None = None) -> h5py.Dataset:
        try:
            return self.f[S.tensor_path(kind, layer)]
        except KeyError:
            where = f"layer {layer} " if layer is not None else ""
            raise TraceFileError(f"{self.path} has no {where}{kind!r} tensor") from None

    def source_dtype(self, kind: str, layer: int | None = None) -> str:
        return _attr_text(self.dataset(kind, layer).attrs.get(S.ATTR_SOURCE_DTYPE, "float32"))

    def read(self, kind: str, layer: int | None = None, rows: slice = slice(None)) -> np.ndarray:
        """Rows of a kind: by position for position-indexed kinds, by step for step kinds."""
        try:
            return self.dataset(kind, layer)[rows]
        except OSError as e:
            raise TraceCorruptError(f"{self.path}: {kind} layer {layer} is corrupt ({_short(e)})") from None

    def read_step(self, kind: str, step: int, layer: int | None = None) -> np.ndarray:
        if S.KIND_BY_NAME[kind].index == "step":
            return self.read(kind, layer, slice(step, step + 1))[0]
        a, b = self.step_positions[step]
        return self.read(kind, layer, slice(a, b))

    def tokens(self) -> np.ndarray:
        return self.read("token").astype(np.int64).reshape(-1)

    def kinds_present(self) -> list[tuple[str, int | None]]:
        """(kind, layer) pairs stored, in data-flow order."""
        out = []
        for spec in S.KINDS:
            layers = range(len(self.layers)) if spec.per_layer else [None]
            out += [(spec.name, l) for l in layers if self.has(spec.name, l)]
        return out

    # ------------------------------------------------------------------ hash
    def content_hash(self) -> str:
        """sha256 over names, attributes, dtypes, shapes and values (not file bytes)."""
        h = hashlib.sha256()

        def visit(name: str, obj) -> None:
            h.update(f"\0{name}\0{type(obj).__name__}\0".encode())
            for k in sorted(obj.attrs):
                h.update(f"{k}={_attr_text(obj.attrs[k])}\0".encode())
            if isinstance(obj, h5py.Dataset):
                h.update(f"{obj.dtype.str}{obj.shape}\0".encode())
                if obj.shape == () or obj.ndim == 0:
                    h.update(np.asarray(obj[()]).tobytes())
                elif obj.dtype.kind == "O":
                    h.update(json.dumps([_attr_text(x) for x in obj[()]]).encode())
                else:
                    for i in range(0, obj.shape[0], HASH_BLOCK_ROWS):
                        h.update(np.ascontiguousarray(obj[i : i + HASH_BLOCK_ROWS]).tobytes())

        names: list[str] = []
        self.f.visit(names.append)
        visit("/", self.f)
        try:
            for name in sorted(names):
                visit(name, self.f[name])
        except OSError as e:
            raise TraceCorruptError(f"{self.path}: corrupt data ({_short(e)})") from None
        return h.hexdigest()

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
