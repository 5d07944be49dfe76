"""TraceWriter: streams canonical tensors into one HDF5 trace, step by step.

Rows are buffered per dataset and written in chunk-sized blocks, so memory stays
bounded by (datasets x chunk + the writer's queue) however long the run is. The blocks are
compressed and written on a writer thread (`_Writes`), off the caller's (the model's) thread;
the caller waits only while QUEUE_BYTES are queued, and at the end of the trace. bfloat16
values are stored as their 16-bit patterns (schema.STORAGE_BF16).

Row datasets are written one whole chunk at a time, each chunk encoded (chunks.py `encode_chunk`) and
handed to HDF5 as it is stored (H5Dwrite_chunk): the same byte shuffle, deflate stream and
Fletcher-32 checksum HDF5's own filters declare and undo on read, so any HDF5 reader reads the
file, but deflated plane by plane: noise planes (low mantissa bytes) stored, the rest by ISA-L's
fastest deflate (python-isal), and never compressed twice (a chunk filled in two writes is read
back, inflated and deflated again by HDF5). The stream is plain deflate: readers need only h5py.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
from pathlib import Path

import h5py
import numpy as np

from . import schema as S
from .atomic import atomic_output
from .chunks import encode_chunk
from .header import TraceHeader
from .layers import LayerInfo, TowerInfo
from .partial_rows import present_flags, spread_rows
from .rows import tower_rows

# h5py serialises its calls with one lock, but not every low-level one takes it (H5Dwrite_chunk in
# h5py 3.14 does not): the writer thread takes it around that call, or HDF5, which is not thread-safe,
# is entered from two threads at once (seen as "ring type mismatch" and H5Dwrite_chunk errors while
# the model thread creates datasets)
HDF5_LOCK = getattr(h5py._objects, "phil", None) or threading.RLock()

CHUNK_BYTES = 1 << 20  # target uncompressed chunk size
MAX_CHUNK_ROWS = 256
MASK_CHUNK_ROWS, MASK_CHUNK_KEYS = 256, 1024  # bool: 256 KiB per chunk
QUEUE_BYTES = 256 << 20  # rows handed to the writer thread and not yet written: the model thread waits beyond this
COMPRESSION = dict(compression="gzip", compression_opts=1, shuffle=True, fletcher32=True)


def fixed_text(text: str | list[str]) -> np.ndarray:
    """UTF-8 text as fixed-length HDF5 strings.

    Variable-length strings live in HDF5's global heap, and a damaged global heap can make
    the HDF5 library spin or crash while reading; fixed-length strings are stored inline.
    """
    data = [t.encode() for t in text] if isinstance(text, list) else text.encode()
    width = max([1] + [len(b) for b in (data if isinstance(data, list) else [data])])
    return np.array(data, dtype=h5py.string_dtype("utf-8", width))


class Bf16Rows:
    """bfloat16 values handed over as their 16-bit patterns (a uint16 array), so that the
    producer neither upcasts them to float32 nor copies twice as many bytes:
    `w.add(kind, Bf16Rows(t.view(torch.int16).numpy().view(np.uint16)))`. The writer copies them,
    unless `owned`: the bits are a copy made for the writer alone (nothing else holds or changes it),
    kept as they are."""

    def __init__(self, bits: np.ndarray, owned: bool = False):
        self.bits = np.asarray(bits).view(np.uint16)
        self.owned = owned


def _to_array(value, source_dtype: str | None) -> tuple[np.ndarray, str]:
    """Canonical storage dtype: floats as float32 (bf16/fp16 upcast losslessly), ints as int64;
    Bf16Rows stay uint16 bit patterns until written."""
    if isinstance(value, Bf16Rows):
        return value.bits, "bfloat16"
    arr = np.asarray(value)
    if arr.dtype == np.bool_:
        return arr, "bool"
    if np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.int64, copy=False), "int64"
    return arr.astype(np.float32, copy=False), source_dtype or str(arr.dtype)


def bf16_bits(data: np.ndarray) -> np.ndarray | None:
    """float32 values -> their bfloat16 bit patterns (uint16); None unless every value is a bfloat16 exactly."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    if (bits & 0xFFFF).any():
        return None
    return (bits >> 16).astype(np.uint16)


def _bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


class Series:
    """One resizable dataset fed row blocks; the mask may grow along its key axis.

    The model thread appends copied rows and hands full chunks to the writer thread (`_Writes`);
    only the writer thread touches the HDF5 dataset (`write`) until the trace is finished."""

    def __init__(self, f: h5py.File, path: str, row_shape: tuple, dtype, source_dtype: str, grow_last: bool):
        self.f, self.path, self.dtype = f, path, dtype
        self.row_shape, self.grow_last = row_shape, grow_last
        self.source_dtype = source_dtype
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.accepted = 0  # rows handed over so far (model thread)
        self.rows = 0  # rows written (writer thread; rows carried to fill a chunk are not yet)
        self.absent: list[tuple[int, int]] = []  # [start, stop) row ranges a runtime did not report
        # bfloat16 values are stored as their 16-bit patterns, as long as every value written is one
        bits = np.dtype(dtype) == np.uint16  # Bf16Rows
        self.bf16 = source_dtype == "bfloat16" and (bits or np.dtype(dtype) == np.float32)
        # chunks of the same rows however the values are handed over or stored
        row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * (4 if bits else np.dtype(dtype).itemsize))
        self.chunk_rows = int(max(1, min(MAX_CHUNK_ROWS, CHUNK_BYTES // row_bytes)))
        self.ds = None
        self.carry: np.ndarray | None = None  # stored rows short of a whole chunk (direct chunk writes)
        self.expected: int | None = None  # an encoder tower's rows: all of them, or the trace is refused

    def append(self, block: np.ndarray, copy: bool = True) -> list[np.ndarray] | None:
        """Take a copy of `block` (`copy=False`: `block` itself, a copy no one else holds); return
        the pending blocks to write once they fill a chunk."""
        if block.shape[1:] != self.row_shape:
            if not (self.grow_last and block.ndim == 2):
                raise ValueError(f"{self.path}: row shape {block.shape[1:]} != {self.row_shape} of earlier rows")
        # a copy: a view would keep the caller's whole buffer alive (a KV cache, say) and see
        # later in-place writes to it
        self.pending.append(np.array(block, copy=True) if copy else block)
        self.pending_rows += block.shape[0]
        self.accepted += block.shape[0]
        return self.take() if self.pending_rows >= self.chunk_rows else None

    def take(self) -> list[np.ndarray] | None:
        """The pending blocks, handed over (None when there are none)."""
        blocks, self.pending, self.pending_rows = self.pending, [], 0
        return blocks or None

    def write(self, blocks: list[np.ndarray], final: bool = False) -> None:
        """Write row blocks at the end of the dataset (writer thread); `final`: the last rows."""
        if not blocks:
            if final and self.carry is not None:
                self._write_chunks(final=True)
            return
        if self.grow_last:
            width = max([b.shape[1] for b in blocks] + [self.row_shape[0]])
            blocks = [np.pad(b, ((0, 0), (0, width - b.shape[1]))) for b in blocks]
        else:
            width = None
        stored = self._stored(blocks)
        if self.ds is None:
            self._create(stored)
        if self.grow_last and width > self.ds.shape[1]:
            self.ds.resize(width, axis=1)
        if self.grow_last and stored.shape[1] < self.ds.shape[1]:
            stored = np.pad(stored, ((0, 0), (0, self.ds.shape[1] - stored.shape[1])))
        if self.direct(stored):
            self.carry = stored if self.carry is None else np.concatenate([self.carry, stored], axis=0)
            self._write_chunks(final)
            return
        n = self.rows
        self.ds.resize(n + stored.shape[0], axis=0)
        self.ds[n:] = stored
        self.rows += stored.shape[0]
        if self.grow_last:
            self.row_shape = (self.ds.shape[1],)

    def direct(self, stored: np.ndarray) -> bool:
        """Are `stored` rows written as whole chunks encoded here (encode_chunk)? Not the mask, nor one-byte values."""
        return not self.grow_last and stored.dtype.itemsize > 1 and stored.dtype.kind in "uif"

    def _write_chunks(self, final: bool) -> None:
        """Write the carried rows' whole chunks (and with `final`, the rest as a zero-padded chunk)."""
        rows, n = self.carry, self.rows  # rows written so far: whole chunks
        whole = rows.shape[0] // self.chunk_rows * self.chunk_rows
        end = rows.shape[0] if final else whole
        if end == 0:
            return
        self.ds.resize(n + end, axis=0)
        zeros = (0,) * len(self.row_shape)
        for a in range(0, end, self.chunk_rows):
            chunk = rows[a : a + self.chunk_rows]
            if chunk.shape[0] < self.chunk_rows:  # the last chunk: HDF5 stores it whole, padded
                pad = [(0, self.chunk_rows - chunk.shape[0])] + [(0, 0)] * len(self.row_shape)
                chunk = np.pad(chunk, pad)
            if chunk.any():  # a chunk of zeros (rows not recorded) is not written: HDF5 reads it as its fill value, 0
                data = encode_chunk(chunk)  # outside the lock: the work the writer thread is for
                with HDF5_LOCK:
                    self.ds.id.write_direct_chunk((n + a, *zeros), data)
        self.carry = rows[whole:] if not final and whole < rows.shape[0] else None
        self.rows = n + end

    def _stored(self, blocks: list[np.ndarray]) -> np.ndarray:
        """The blocks as stored: bfloat16 bit patterns while every value is one, else float32 (or as given)."""
        if self.bf16:
            bits = [b if b.dtype == np.uint16 else bf16_bits(b) for b in blocks]
            if all(b is not None for b in bits):
                return np.concatenate(bits, axis=0) if len(bits) > 1 else bits[0]
            self._widen()  # not bfloat16 values after all: store them (and the rows so far) as float32
        blocks = [_bf16_to_float32(b) if b.dtype == np.uint16 else b for b in blocks]
        return np.concatenate(blocks, axis=0) if len(blocks) > 1 else blocks[0]

    def _create(self, data: np.ndarray) -> None:
        maxshape = (None, None) if self.grow_last else (None, *self.row_shape)
        # the mask's key axis grows with the run: fixed-width key chunks keep the chunk count
        # (and HDF5's index) proportional to the data, not to the number of resizes
        chunks = (self.chunk_rows, *data.shape[1:]) if not self.grow_last else (MASK_CHUNK_ROWS, MASK_CHUNK_KEYS)
        self.ds = self.f.create_dataset(
            self.path, shape=(0, *data.shape[1:]), maxshape=maxshape, dtype=data.dtype, chunks=chunks, **COMPRESSION
        )
        self.ds.attrs[S.ATTR_SOURCE_DTYPE] = fixed_text(self.source_dtype)
        if self.bf16:
            self.ds.attrs[S.ATTR_STORAGE] = fixed_text(S.STORAGE_BF16)

    def _widen(self) -> None:
        """From bfloat16 bit patterns to float32: the rows written (and carried) so far are rewritten."""
        self.bf16 = False
        parts = [] if self.ds is None else [self.ds[()]]
        parts += [] if self.carry is None else [self.carry]
        if self.ds is not None:
            del self.f[self.path]
        self.ds, self.rows, self.carry = None, 0, None
        old = np.concatenate(parts, axis=0) if parts else None
        if old is not None and old.shape[0]:
            self.write([_bf16_to_float32(old)])


def spare_core(device: str, compute_threads: int) -> bool:
    """Does a writer thread have a core of its own? Yes when the model runs on a GPU or leaves a CPU
    core free. When the model's threads take every core, the thread's encoding stalls one of them
    while it runs (a parallel op waits for its slowest thread): on the 2-core machine of
    docs/benchmarks.md a full-size E2B record-last took 12.1 s with the thread and 11.5 s with the
    writes between the model's steps on its own thread (medians of 4 alternating runs), a full
    record 14.9 s and 14.4 s (3 runs). `trace record` asks; `trace replay` keeps the thread."""
    if device != "cpu":
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores > compute_threads


class _Writes:
    """The writer thread: runs the HDF5 writes handed to it, in order, off the model's thread.

    The model thread hands over copied rows and waits only while more than `max_bytes` are
    queued. The first error raised in the writer thread is raised again in the model thread at
    its next hand-over (or at the end): the same exception, so it reads as it always did."""

    def __init__(self, max_bytes: int = QUEUE_BYTES, threaded: bool = True):
        self.max_bytes = max_bytes
        self.jobs: collections.deque = collections.deque()
        self.queued = 0  # bytes of the blocks queued and not yet written
        self.unfinished = 0  # jobs handed over and not yet done
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self.threaded = threaded
        if self.threaded:
            self.thread.start()

    def submit(self, series: Series, blocks: list[np.ndarray], final: bool = False) -> None:
        if not self.threaded:
            series.write(blocks, final)
            return
        size = sum(b.nbytes for b in blocks)
        with self.cond:
            while self.queued and self.queued + size > self.max_bytes and self.error is None:
                self.cond.wait()
            self._raise()
            self.jobs.append((series, blocks, size, final))
            self.queued += size
            self.unfinished += 1
            self.cond.notify_all()

    def drain(self) -> None:
        """Wait until everything handed over is written; raise the writer thread's error, if any."""
        with self.cond:
            while self.unfinished and self.error is None:
                self.cond.wait()
            self._raise()

    def close(self) -> None:
        """Stop the thread: what is still queued is dropped (an error or an interrupt ended the
        trace); the write in progress, at most a chunk or a step's rows, is waited for."""
        with self.cond:
            self.stopping = True
            self.jobs.clear()
            self.cond.notify_all()
        if self.threaded:
            self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.jobs and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                series, blocks, size, final = self.jobs.popleft()
            try:
                if self.error is None:
                    series.write(blocks, final)
            except BaseException as e:  # noqa: BLE001 - raised again in the model thread
                with self.cond:
                    self.error = e
            with self.cond:
                self.queued -= size
                self.unfinished -= 1
                self.cond.notify_all()


class TraceWriter:
    """Write a trace: `with TraceWriter(path, force=...) as w:` then header, steps, tensors.

        w.write_header(TraceHeader(provenance, prompt_ids, layers, max_new_tokens=..., eos_token_ids=...))
        w.begin_step(positions=range(0, T))        # step 0: the prefill
        w.add("q", q_rows, layer=3)                 # rows for the step's positions
        w.add("logits", logits_row)                 # step-indexed kinds: one row
        w.end_step()

    The file appears at `path` only when the `with` block ends without an exception.
    """

    def __init__(
        self, path: str | Path, force: bool = False, source_dtype: str | None = None, selection=None, threaded=True
    ):
        self.path = Path(path)
        self.threaded = threaded  # a writer thread (spare_core says when it pays); False: the caller's thread
        self.selection = selection  # traces.selection.Selection: what to keep (None: everything)
        self.force = force
        self.source_dtype = source_dtype
        self._ctx = None
        self.f: h5py.File | None = None
        self._writes: _Writes | None = None
        self._series: dict[str, Series] = {}
        self._steps: list[tuple[int, int]] = []
        self._step_open = False
        self._n_layers = 0
        self.layers: list[LayerInfo] = []
        self.towers: dict[str, TowerInfo] = {}
        self.model_config: dict = {}

    def __enter__(self) -> TraceWriter:
        self._ctx = atomic_output(self.path, self.force)
        tmp = self._ctx.__enter__()
        # no chunk cache: rows are written in chunk-sized blocks, once, so caching only costs memory
        self.f = h5py.File(tmp, "w", track_order=True, rdcc_nbytes=0)
        self._writes = _Writes(threaded=self.threaded)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                if self._step_open:
                    raise ValueError("trace closed in the middle of a step")
                self._finish()
            self._writes.close()
            self.f.close()  # flushes: a full disk can fail here too
        except BaseException as e:
            self._writes.close()  # the writer thread stops before the partial file goes
            with contextlib.suppress(Exception):
                self.f.close()
            self._ctx.__exit__(type(e), e, e.__traceback__)  # removes the partial file; names a full disk
            raise
        return self._ctx.__exit__(exc_type, exc, tb)

    # ---------------------------------------------------------------- header
    def write_header(self, header: TraceHeader) -> None:
        f = self.f
        f.attrs[S.ATTR_SCHEMA] = fixed_text(S.SCHEMA_NAME)
        # a text-only trace stays version 1 byte for byte; encoder towers make it version 2
        f.attrs[S.ATTR_SCHEMA_VERSION] = S.SCHEMA_VERSION if header.towers else S.TEXT_SCHEMA_VERSION
        if self.selection is not None:  # asked kinds of towers the trace does not record: nothing to keep
            self.selection = self.selection.within({t.name for t in header.towers})
            f.attrs[S.ATTR_SELECTION] = fixed_text(json.dumps(self.selection.to_json(), sort_keys=True))
        for k, text in header.provenance.attrs().items():
            f.attrs[k] = fixed_text(text)
        if header.max_seq is not None:
            f.attrs[S.ATTR_MAX_SEQ] = header.max_seq
        f.create_dataset(S.DSET_PROMPT_IDS, data=header.prompt_ids)
        g = f[S.GROUP_INPUTS]
        g.attrs[S.ATTR_MAX_NEW_TOKENS] = header.max_new_tokens
        g.attrs[S.ATTR_EOS_TOKEN_IDS] = np.asarray(header.eos_token_ids, dtype=np.int64)
        g.attrs[S.ATTR_PROMPT_TEXT] = fixed_text(header.prompt_text)
        g.attrs[S.ATTR_CHAT_TEMPLATE_APPLIED] = bool(header.chat_template_applied)
        f.require_group(S.GROUP_INPUT_EXTRA)
        for name, value in sorted(header.extra_inputs.items()):
            arr, src = _to_array(value, None)
            ds = f.create_dataset(S.input_extra_path(name), data=arr, **COMPRESSION)
            ds.attrs[S.ATTR_SOURCE_DTYPE] = fixed_text(src)
        layers = header.layers
        for name in S.LAYER_FIELDS:
            vals = [getattr(li, name) for li in layers]
            data = fixed_text(vals) if name in S.LAYER_TEXT_FIELDS else np.asarray(vals, dtype=np.int64)
            f.create_dataset(S.model_field_path(name), data=data)
        if header.towers:  # no link creation order below the root (HDF5 does not checksum that index)
            f.create_group(S.GROUP_TENSORS, track_order=False)
            f.create_group(S.GROUP_TOWERS, track_order=False)
        for t in header.towers:
            g = f.create_group(S.tower_path(t.name), track_order=False)
            for name in S.TOWER_ATTRS:
                g.attrs[name] = int(getattr(t, name))
            f.create_dataset(S.tower_path(t.name, S.DSET_ITEM_ROWS), data=np.asarray(t.item_rows, dtype=np.int64))
            f.create_dataset(S.tower_path(t.name, S.DSET_ITEM_TOKENS), data=np.asarray(t.item_tokens, dtype=np.int64))
        self._n_layers = len(layers)
        self.layers = list(layers)  # what a probe may report is bounded by these (traces/limits.py)
        self.towers = {t.name: t for t in header.towers}
        cfg = header.provenance.model_config
        self.model_config = cfg if isinstance(cfg, dict) else {}

    # ---------------------------------------------------------------- steps
    def begin_step(self, positions: range) -> None:
        if self._step_open:
            raise ValueError("begin_step called twice without end_step")
        start = self._steps[-1][1] if self._steps else 0
        if positions.start != start or positions.step != 1 or len(positions) == 0:
            raise ValueError(f"step {len(self._steps)} must feed positions from {start}, got {positions}")
        self._steps.append((positions.start, positions.stop))
        self._step_open = True

    def end_step(self) -> None:
        self._step_open = False

    @property
    def step_rows(self) -> int:
        """Positions the open step feeds (rows a position-indexed kind adds)."""
        start, stop = self._steps[-1]
        return stop - start

    @property
    def step(self) -> int:
        return len(self._steps) - 1

    def add(
        self,
        kind: str,
        value,
        layer: int | None = None,
        source_dtype: str | None = None,
        positions=None,
        tower: str = S.TEXT,
    ) -> None:
        """Add the rows of `kind` for the open step: one per fed position, or one per step.

        `positions` (increasing absolute positions of this step): `value` holds only these rows;
        the others are stored as zeros and flagged absent (schema.rows_present_path).
        `tower`: an encoder tower's kind (its rows are patches, frames or soft tokens, added in the
        prefill step, image after image: one call per image or one for all).
        """
        if not self._step_open:
            raise ValueError("add() outside begin_step/end_step")
        site = S.Site(tower, kind, layer)
        spec, path, key = site.spec, site.path, site.key
        if not self.keeps(key, layer):
            return
        if spec.encoder:
            if positions is not None:
                raise ValueError(f"{site}: positions= names text positions; an encoder reports all its rows")
            self._add_encoder(site, value, source_dtype)
            return
        arr, src = _to_array(value, source_dtype or self.source_dtype)
        owned = isinstance(value, Bf16Rows) and value.owned  # else the caller's buffer: copied
        start, stop = self._steps[-1]
        absent = []
        if positions is not None:
            arr, absent = spread_rows(kind, layer, arr, positions, start, stop, spec.by_step)
            owned = True
        if self.selection is not None and not self.selection.keeps_step(kind, self.step):
            arr, absent = np.zeros_like(arr), [(0, stop - start)]  # a step left out: zero rows, flagged absent
            owned = True
        if spec.by_step:
            arr = arr.reshape(1, *arr.shape)
        elif arr.shape[0] != stop - start:
            raise ValueError(f"{kind} layer {layer}: {arr.shape[0]} rows for {stop - start} positions")
        series = self._series.get(path)
        if series is None:
            series = self._series[path] = Series(self.f, path, arr.shape[1:], arr.dtype, src, grow_last=spec.grows)
        expected_rows = self.step if spec.by_step else start
        if series.accepted != expected_rows:
            raise ValueError(f"{kind} layer {layer}: rows out of order at step {self.step}")
        series.absent += [(start + a, start + b) for a, b in absent]
        blocks = series.append(arr, copy=not owned)
        if blocks is not None:
            self._writes.submit(series, blocks)

    def _add_encoder(self, site: S.Site, value, source_dtype: str | None) -> None:
        """An encoder tower's rows: appended in the prefill, never more than its table declares."""
        info = self.towers.get(site.tower)
        if info is None:
            raise ValueError(f"{site}: the trace header declares no {site.tower} tower")
        if self.step != 0:
            raise ValueError(f"{site}: an encoder tower's rows are added in the prefill (step 0), not step {self.step}")
        if site.layer is not None and site.layer >= info.layers:
            raise ValueError(f"{site}: the {site.tower} tower has {info.layers} layers")
        if self.selection is not None and not self.selection.keeps_step(site.key, 0):
            return
        arr, src = _to_array(value, source_dtype or self.source_dtype)
        if arr.ndim == 0:
            raise ValueError(f"{site}: expected rows, got a scalar")
        want = tower_rows(site.spec, info)
        series = self._series.get(site.path)
        if series is None:
            series = self._series[site.path] = Series(self.f, site.path, arr.shape[1:], arr.dtype, src, False)
            series.expected = want
        if series.accepted + arr.shape[0] > want:
            raise ValueError(f"{site}: {series.accepted + arr.shape[0]} rows, more than the {want} its tower declares")
        blocks = series.append(arr, copy=not (isinstance(value, Bf16Rows) and value.owned))
        if blocks is not None:
            self._writes.submit(series, blocks)

    def keeps(self, kind: str, layer: int | None = None) -> bool:
        """Does the selection keep (kind, layer) at all? (Callers skip computing what it does not.)"""
        return self.selection is None or self.selection.keeps(kind, layer)

    def keeps_now(self, kind: str, layer: int | None = None) -> bool:
        """Does the selection keep (kind, layer) at the open step?"""
        return self.keeps(kind, layer) and (self.selection is None or self.selection.keeps_step(kind, self.step))

    def _finish(self) -> None:
        for s in self._series.values():
            if s.expected is not None and s.accepted != s.expected:
                raise ValueError(f"{s.path}: {s.accepted} rows, but its tower declares {s.expected}")
        for s in self._series.values():
            self._writes.submit(s, s.take() or [], final=True)  # the last rows, and a carried part chunk
        self._writes.drain()  # every row written: the rest is written here, on the caller's thread
        for s in self._series.values():
            if s.absent:  # rows reported only in part: say which rows are data
                present = present_flags(s.rows, s.absent)
                self.f.create_dataset(
                    s.path + S.ROWS_PRESENT_SUFFIX, data=present, chunks=(min(s.rows, 1 << 16),), **COMPRESSION
                )
        self.f.create_dataset(S.DSET_STEP_POSITIONS, data=np.asarray(self._steps, dtype=np.int64).reshape(-1, 2))
