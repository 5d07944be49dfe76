"""TraceReader: opens a trace, has it validated, serves canonical tensors.

A trace is untrusted input (docs/robustness.md, "Threat model"). Opening one checks that
the file is a regular file and an HDF5 file, then its whole structure before any tensor
data is read (traces/validate.py and objects.py: object tree, storage, attributes, header, per-layer
metadata, steps, every tensor's place, dtype, rank, rows and width, declared bytes). A
file that fails raises TraceCorruptError (or TraceFileError when it is no trace at all):
one line naming the file, what is wrong and what to do. Tensor data is read later, on
demand, only from the datasets validation walked and bounded by the memory available: a
chunk that fails its fletcher32 checksum or cannot be decompressed raises
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
from .errors import TraceToolError, interrupted, one_line
from .header import Provenance, TraceHeader
from .objects import ADVICE, READ_ERRORS, Checked, attr_text, corrupt, corrupt_data, file_error, nbytes, read_small
from .rows import layer_counts
from .validate import Validator

HASH_BLOCK_BYTES = 64 << 20  # content_hash reads a dataset this many bytes at a time


def _no_filter_plugins() -> None:
    """Empty HDF5's plug-in search path: a trace naming an unknown filter cannot make HDF5 load code."""
    with contextlib.suppress(Exception):
        while h5py.h5pl.size():
            h5py.h5pl.remove(0)


class TraceReader:
    """Read-only view of a trace. Use as a context manager or call close()."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            st = os.stat(self.path)  # stat, not open: opening a FIFO would block forever
        except FileNotFoundError:
            raise file_error(f"{self.path}: no such file") from None
        except OSError as e:
            raise file_error(f"{self.path} cannot be read ({e.strerror})") from None
        if stat.S_ISDIR(st.st_mode):
            raise file_error(f"{self.path} is a folder, not a trace file")
        if not stat.S_ISREG(st.st_mode):
            raise file_error(f"{self.path} is {_file_kind(st.st_mode)}, not a regular file; pass a trace file")
        if not os.access(self.path, os.R_OK):
            raise file_error(f"{self.path} cannot be read (permission denied)")
        self.file_size = st.st_size
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # the file this reader opened
        _no_filter_plugins()
        try:
            self.f = h5py.File(self.path, "r", locking=False)
        except Exception as e:  # noqa: BLE001 - h5py reports every unopenable file as some exception
            raise file_error(self._open_message(e)) from None
        self._memory = LIM.memory_limit()
        check = Validator(self.f, self.path, self.file_size)
        try:
            self._serve(check.run())
        except TraceToolError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 - damaged HDF5 metadata surfaces as any h5py exception
            self.close()
            if interrupted(e):  # Ctrl-C inside an h5py callback arrives wrapped (SystemError)
                raise KeyboardInterrupt from None
            raise corrupt(
                f"{self.path} is damaged: reading {check.at} failed ({type(e).__name__}: {one_line(e, 200)}); {ADVICE}"
            ) from None
        except BaseException:
            self.close()
            raise

    def _serve(self, c: Checked) -> None:
        """Keep what validation checked: the header as attributes, the rest for the accessors."""
        self.provenance, self.selection, self.max_seq = c.provenance, c.selection, c.max_seq
        self.prompt_ids, self.max_new_tokens, self.eos_token_ids = c.prompt_ids, c.max_new_tokens, c.eos_token_ids
        self.prompt_text, self.chat_template_applied = c.prompt_text, c.chat_template_applied
        self.layers, self.step_positions = c.layers, c.step_positions
        self.towers = c.towers  # {name: TowerInfo} of the encoder towers recorded (schema version 2)
        self._extra_names, self._present, self._flags = c.extra_names, c.present, c.flags
        self._tokens, self._objects = c.tokens, c.objects
        self._bf16 = c.bf16

    def _open_message(self, e: BaseException) -> str:
        msg = one_line(e, 200)
        head = f"{self.path} is not a readable HDF5 trace"
        m = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", msg)
        if m:
            return (
                f"{head}: it is truncated ({m.group(1)} of {m.group(2)} bytes; an interrupted copy or write); "
                "copy it again or re-record it"
            )
        if "file signature not found" in msg:
            return (
                f"{head}: it is not an HDF5 file at all (no HDF5 signature); "
                "pass a trace written by 'trace record' or 'trace replay'"
            )
        return f"{head} ({msg}); {ADVICE}"

    # ------------------------------------------------------------------ info
    def rows_present(self, kind: str, layer: int | None = None) -> np.ndarray | None:
        """(rows,) bool: which rows of a kind hold data (a runtime may report a subset of a step's
        rows; the others are zeros); None when every row does."""
        if (kind, layer) not in self._flags:
            return None
        return read_small(self.path, self.f[S.rows_present_path(kind, layer)]).astype(bool)

    @property
    def mode(self) -> str:
        return self.provenance[S.ATTR_MODE]

    @property
    def model_config(self) -> dict:
        return json.loads(self.provenance[S.ATTR_MODEL_CONFIG])

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
            self._check_memory(ds, nbytes(ds.shape, ds.dtype))
            out[k] = read_small(self.path, ds)
        return out

    def extra_input(self, name: str) -> np.ndarray | None:
        """One extra input (None when the trace has none of that name)."""
        if name not in self._extra_names:
            return None
        ds = self.f[S.input_extra_path(name)]
        self._check_memory(ds, nbytes(ds.shape, ds.dtype))
        return read_small(self.path, ds)

    def header(self) -> TraceHeader:
        """The trace's header, whole (the extra inputs are read): what a copy of it writes."""
        return TraceHeader(
            Provenance.from_dict(self.provenance),
            self.prompt_ids,
            self.layers,
            max_new_tokens=self.max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            prompt_text=self.prompt_text,
            chat_template_applied=self.chat_template_applied,
            extra_inputs=self.extra_inputs(),
            towers=tuple(self.towers.values()),
            max_seq=self.max_seq,
        )

    def has(self, kind: str, layer: int | None = None) -> bool:
        return (kind, layer) in self._present

    def dataset(self, kind: str, layer: int | None = None) -> h5py.Dataset:
        if (kind, layer) not in self._present:
            where = f"layer {layer} " if layer is not None else ""
            raise file_error(f"{self.path} has no {where}{kind!r} tensor")
        return self.f[S.tensor_path(kind, layer)]

    def storage_size(self, kind: str, layer: int | None = None) -> int:
        """Bytes a kind's dataset takes on disk (walks its chunk index, reads no data)."""
        ds = self.dataset(kind, layer)
        try:
            return ds.id.get_storage_size()
        except READ_ERRORS as e:
            raise corrupt(
                f"{self.path} is damaged: the chunk index of {ds.name.lstrip('/')!r} cannot be read "
                f"({one_line(e, 200)}); "
                f"{ADVICE}"
            ) from None

    def source_dtype(self, kind: str, layer: int | None = None) -> str:
        return attr_text(self.dataset(kind, layer).attrs.get(S.ATTR_SOURCE_DTYPE, "float32"))

    def _check_memory(self, ds: h5py.Dataset, size: int) -> None:
        if self._memory is not None and size > self._memory:
            raise TraceToolError(
                f"reading {ds.name.lstrip('/')!r} of {self.path} needs {LIM.fmt_bytes(size)} of memory, more than "
                f"the {LIM.fmt_bytes(self._memory)} available"
            )

    def read(self, kind: str, layer: int | None = None, rows: slice = slice(None)) -> np.ndarray:
        """Rows of a kind: by position for position-indexed kinds, by step for step kinds.

        Values stored as bfloat16 bit patterns (schema.STORAGE_BF16) come back as float32, exactly."""
        ds = self.dataset(kind, layer)
        bf16 = (kind, layer) in self._bf16
        n = len(range(*rows.indices(ds.shape[0])))
        # bf16: the 16-bit rows read, then widened (1.5x the float32 result at the peak)
        self._check_memory(ds, nbytes((n, *ds.shape[1:]), ds.dtype) * (3 if bf16 else 1))
        try:
            data = ds[rows]
        except READ_ERRORS as e:
            raise corrupt_data(self.path, ds.name, e) from None
        return bf16_to_float32(data) if bf16 else data

    def stored_as(self, kind: str, layer: int | None = None) -> str:
        """How a kind's values are stored: its dataset's dtype, or schema.STORAGE_BF16."""
        return S.STORAGE_BF16 if (kind, layer) in self._bf16 else str(self.dataset(kind, layer).dtype)

    def tokens(self) -> np.ndarray:
        return self._tokens.copy()

    def layer_counts(self) -> dict[str, int]:
        """{tower: its layer count} of the towers this trace records (the text tower always)."""
        return layer_counts(len(self.layers), self.towers)

    def kinds_present(self) -> list[tuple[str, int | None]]:
        """(kind key, layer) pairs stored, tower by tower in data-flow order, each kind's layers in turn."""
        counts = self.layer_counts()
        out = []
        for key in S.ALL_KIND_KEYS:
            n = counts.get(S.KIND_BY_NAME[key].tower)
            if n is not None:
                out += [(key, site.layer) for site in S.sites_of(key, n) if self.has(key, site.layer)]
        return out

    def sites(self) -> list[S.Site]:
        """Every site stored, in the diff's data-flow order (encoder towers, then the text tower)."""
        return [site for site in S.dataflow(self.layer_counts()) if self.has(site.key, site.layer)]

    # ------------------------------------------------------------------ hash
    def content_hash(self) -> str:
        """sha256 over names, attributes, dtypes, shapes and values (not file bytes).

        Hashes exactly the objects validated on open (every object of a valid trace), reached
        the same way: through hard links only; large datasets are read in blocks."""
        h = hashlib.sha256()

        def text(v) -> str:  # undecodable bytes hash as themselves (surrogateescape), valid text as before
            return v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else attr_text(v)

        def visit(name: str, obj) -> None:
            h.update(f"\0{name}\0{type(obj).__name__}\0".encode("utf-8", "surrogateescape"))
            bf16 = name in bf16_paths  # hashed as the float32 values it holds: how they are stored is no content
            for k in sorted(obj.attrs):
                if not (bf16 and k == S.ATTR_STORAGE):
                    h.update(f"{k}={text(obj.attrs[k])}\0".encode("utf-8", "surrogateescape"))
            if isinstance(obj, h5py.Dataset):
                h.update(f"{np.dtype(np.float32).str if bf16 else obj.dtype.str}{obj.shape}\0".encode())
                if obj.shape is None:  # an empty (null dataspace) dataset: no values
                    return
                if obj.shape == () or obj.ndim == 0:
                    h.update(np.asarray(obj[()]).tobytes())
                elif obj.dtype.kind == "O":
                    h.update(json.dumps([text(x) for x in obj[()]]).encode())
                else:
                    block = max(1, HASH_BLOCK_BYTES // max(1, nbytes(obj.shape[1:], obj.dtype)))
                    for i in range(0, obj.shape[0], block):
                        data = obj[i : i + block]
                        h.update(np.ascontiguousarray(bf16_to_float32(data) if bf16 else data).tobytes())

        bf16_paths = {S.tensor_path(kind, layer) for kind, layer in self._bf16}
        for name in ["/", *sorted(self._objects)]:
            obj = None
            try:
                obj = self.f if name == "/" else self.f[name]
                visit(name, obj)
            except READ_ERRORS as e:
                if isinstance(obj, h5py.Dataset):
                    raise corrupt_data(self.path, name, e) from None
                raise corrupt(
                    f"{self.path} is damaged: reading {name!r} failed ({one_line(e, 200)}); {ADVICE}"
                ) from None
        return h.hexdigest()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # read-only: nothing to lose if a damaged file fails to close
            self.f.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> the float32 values they are, exactly."""
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def _file_kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return word
    return "not a regular file"
