"""Fuzz the trace readers: corrupt a golden trace at random, run `trace show`, `trace show
--hash` and `trace diff` (both ways) on it in-process, and check every run ends cleanly.

    python scripts/fuzz_traces.py --cases 4000 --seed 1        # counts by outcome
    python scripts/fuzz_traces.py --seed 1 --case 3245 --keep bad.h5   # replay one case, keep its file
    python scripts/fuzz_traces.py --import-cases 400 --seed 18          # `trace import`: hostile maps and dumps
    python scripts/fuzz_traces.py --tolerance-cases 300 --seed 18       # tolerance files, calibrate's names

A case applies one to three corruptions to a copy of the golden trace (default
traces/golden/short.h5): bit flips at random offsets (anywhere, or only in HDF5 metadata),
an overwritten byte run, truncation, a deleted, renamed or swapped object, a deleted
attribute, an attribute of the wrong type, a dataset rewritten with another shape, dtype or
values, a dangling link; or a hostile class (links, external storage, bombs, deep trees, huge
attributes). A third of the cases (--tower-share; a draw of its own, so the other cases are the
mutations they always were) start from a version-2 trace with a vision and an audio tower instead
(written by tests/support/synth.py) and apply a tower class: the towers/<tower> attributes and item
datasets, the tensors/<tower>/ layout, the schema version, the model config's sub-configs and
token ids (see TOWER); those that change nothing else must be refused or read as the format says.
The allowed outcomes are exit 0 or 2 for `show`, 0, 1 or 2 for
`diff` (a corruption that leaves a valid trace may match or diverge); exit 2 must be
exactly one line `error: ...` on stderr. A failure is anything else: an exception escaping
the command (GEMMA4_TRACE_DEBUG=1 lets our own bugs through instead of 'internal error'),
an 'internal error' message, more than one line, a traceback, another exit code, a run
longer than --timeout seconds, a tower case read that the format forbids or refused that it
allows, or a whole-HDF5 tower case refused as "damaged" (an exception inside the checks).

Cases run in --jobs worker processes. HDF5 can hang or crash on some damaged metadata
inside C code that holds the GIL; a worker stuck for --hang-after seconds is ended by
faulthandler, and a worker that died inside an h5py call counts as a library defect
(docs/robustness.md), anywhere else as a failure. The exit status is 1 when any case failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from click.testing import CliRunner  # noqa: E402

from gemma4_trace.cli import main as cli_main  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.traces import limits as LIM  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.layers import TowerInfo  # noqa: E402

GOLDEN = golden_path("short")
COMMANDS = ("show", "show --hash", "diff GOLDEN CORRUPT", "diff CORRUPT GOLDEN")
ALLOWED = {"show": {0, 2}, "show --hash": {0, 2}, "diff GOLDEN CORRUPT": {0, 1, 2}, "diff CORRUPT GOLDEN": {0, 1, 2}}
MESSAGE_KINDS = (  # (substring of the error line, label) in the order tried
    ("not a readable HDF5", "unreadable HDF5"),
    ("not a gemma4-trace", "not a trace"),
    ("schema version", "schema version"),
    ("is corrupt:", "corrupt data (checksum)"),
    ("is damaged:", "damaged metadata"),
    ("is not a valid trace", "invalid structure"),
    ("different model architectures", "incompatible traces"),
    ("different prompts", "incompatible traces"),
    ("different positions", "incompatible traces"),
    ("has no ", "missing tensor"),
)
WEIRD_ATTRS = (
    np.int64(-1),
    0,
    2**62,
    3.5,
    "",
    "garbage",
    b"\xff\xfe\xfd",
    np.array([1, 2, 3]),
    np.array([], dtype=np.int64),
    True,
    np.array(["a", "b"], dtype=h5py.string_dtype()),
    np.float64("nan"),
    np.zeros((2, 2)),
    '{"a": 1}',
    "[1, 2]",
    "null",
    "reference",
    "999",
    np.uint64(2**63 + 5),
    np.array([-7]),
)


class OutsideWatch:
    """inotify on the files a hostile trace points at: any open or read of them by the commands is
    a read outside the trace. A folder given stands for the files in it when the watch starts; the
    folder itself is not watched, so a listing of it (`ls`, `find`, an indexer) is no event: only
    an open or read of the files themselves is, and only the hostile traces name them. (Linux only;
    without inotify the check is reported as unavailable, never as passed.)"""

    IN_ACCESS, IN_OPEN, IN_NONBLOCK = 0x1, 0x20, 0x800

    def __init__(self, paths):
        import ctypes
        import ctypes.util

        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(self.IN_NONBLOCK)
        files = [f for p in map(Path, paths) for f in (sorted(p.iterdir()) if p.is_dir() else [p])]
        self.ok = self.fd >= 0 and bool(files)  # a watch over nothing checks nothing
        self.names = {}
        for p in files:
            if self.ok:
                wd = self.libc.inotify_add_watch(self.fd, str(p).encode(), self.IN_ACCESS | self.IN_OPEN)
                self.ok = wd >= 0
                self.names[wd] = p.name

    def events(self) -> list[str]:
        """Names opened or read since the last call."""
        if not self.ok:
            return []
        out, buf = [], b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            buf += chunk
        i = 0
        while i + 16 <= len(buf):
            wd, mask, _cookie, length = np.frombuffer(buf[i : i + 16], dtype=np.dtype("<i4,<u4,<u4,<u4"))[0].tolist()
            if mask & (self.IN_ACCESS | self.IN_OPEN):  # not IN_IGNORED (a watched file removed)
                out.append(self.names.get(wd, "?"))
            i += 16 + length
        return out


class CaseTimeout(BaseException):
    """Raised by the per-case alarm; a BaseException so no `except Exception` swallows it."""


@dataclass
class Info:
    """What the golden holds: object names, chunk byte ranges (to aim at metadata), size."""

    size: int
    chunk_ranges: list[tuple[int, int]]


@dataclass
class Report:
    cases: int = 0
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)  # (command, exit code) -> count
    messages: Counter = field(default_factory=Counter)  # kind of error line -> count
    mutations: Counter = field(default_factory=Counter)
    goldens: Counter = field(default_factory=Counter)  # cases by the golden they started from ("v1", "v2")
    verdicts: Counter = field(default_factory=Counter)  # tower-only cases the format has a verdict on
    failures: list[str] = field(default_factory=list)
    library: list[str] = field(default_factory=list)  # the process died inside HDF5's C code (hang or crash)
    library_goldens: Counter = field(default_factory=Counter)  # those by the golden their case started from
    outside: list[str] = field(default_factory=list)  # a command opened or read a file outside the trace
    slow: list[str] = field(default_factory=list)  # a command ran longer than SLOW_SECONDS
    big: list[str] = field(default_factory=list)  # the process grew past BIG_RSS
    watch_ok: bool = True  # inotify available (else reads outside the file were not checked)
    max_seconds: float = 0.0
    max_rss: int = 0  # bytes, the worker processes' peak
    stopped: bool = False  # the --budget ran out before every case was run


SLOW_SECONDS = 60.0
BIG_RSS = 2 << 30


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def golden_info(path: Path) -> Info:
    ranges = []
    with h5py.File(path, "r") as f:

        def visit(_name, obj):
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                for i in range(obj.id.get_num_chunks()):
                    c = obj.id.get_chunk_info(i)
                    ranges.append((c.byte_offset, c.byte_offset + c.size))

        f.visititems(visit)
    return Info(path.stat().st_size, sorted(ranges))


# ---------------------------------------------------------------- structural corruptions (h5py)
def _names(f: h5py.File, datasets_only=False) -> list[str]:
    out: list[str] = []
    f.visititems(lambda n, o: out.append(n) if (not datasets_only or isinstance(o, h5py.Dataset)) else None)
    return sorted(out)


def m_delete(f, rng):
    name = rng.choice(_names(f))
    del f[name]
    return f"delete {name}"


def m_rename(f, rng):
    names = _names(f)
    src = str(rng.choice(names))
    how = rng.integers(3)
    if how == 0:  # a near-miss name
        dst = src + rng.choice(["_x", "0", "s"])
    elif how == 1:  # swap with another object
        other = str(
            rng.choice(
                [n for n in names if n != src and not n.startswith(src + "/") and not src.startswith(n + "/")] or [src]
            )
        )
        if other == src:
            return "rename (nothing to swap)"
        f.move(src, "__swap__")
        f.move(other, src)
        f.move("__swap__", other)
        return f"swap {src} <-> {other}"
    else:  # into another group
        groups = [n for n in names if isinstance(f[n], h5py.Group) and not n.startswith(src)] or ["/"]
        dst = f"{rng.choice(groups)}/{src.rsplit('/', 1)[-1]}"
    if dst in f:
        return f"rename {src} (target {dst} exists)"
    f.move(src, dst)
    return f"rename {src} -> {dst}"


def _attr_holders(f) -> list[str]:
    return ["/"] + [n for n in _names(f) if len(f[n].attrs)]


def m_del_attr(f, rng):
    holder = f[str(rng.choice(_attr_holders(f)))]
    if not len(holder.attrs):
        return "delete attribute (none)"
    key = str(rng.choice(sorted(holder.attrs)))
    del holder.attrs[key]
    return f"delete attribute {holder.name}@{key}"


def m_attr_type(f, rng):
    holder = f[str(rng.choice(_attr_holders(f)))]
    keys = sorted(holder.attrs) or ["x"]
    key = str(rng.choice(keys))
    value = WEIRD_ATTRS[rng.integers(len(WEIRD_ATTRS))]
    holder.attrs[key] = value
    return f"attribute {holder.name}@{key} = {value!r:.40}"


def _rewrite(f, name, data, rng):
    ds = f[name]
    attrs = {k: ds.attrs[k] for k in ds.attrs}
    del f[name]
    kw = {}
    if rng.random() < 0.5 and np.ndim(data) > 0 and np.size(data) > 0 and np.asarray(data).dtype.kind in "biuf":
        kw = dict(chunks=True, compression="gzip", shuffle=True, fletcher32=True)
    new = f.create_dataset(name, data=data, **kw)
    for k, v in attrs.items():
        new.attrs[k] = v


def m_reshape(f, rng):
    name = str(rng.choice(_names(f, datasets_only=True)))
    a = f[name][()]
    if np.ndim(a) == 0:
        new = np.asarray([a, a])
    else:
        how = rng.integers(8)
        if how == 0:
            new = a[:-1]
        elif how == 1:
            new = np.concatenate([a, a[-1:]])
        elif how == 2:
            new = a[..., : max(1, a.shape[-1] // 2)] if a.ndim > 1 else a[: max(0, a.shape[0] // 2)]
        elif how == 3:
            new = a[..., None]
        elif how == 4:
            new = a.reshape(-1)
        elif how == 5:
            new = a.reshape(-1)[0]
        elif how == 6:
            new = a[:0]
        else:
            new = np.swapaxes(a, 0, -1) if a.ndim > 1 else a.reshape(1, -1)
    _rewrite(f, name, new, rng)
    return f"reshape {name} {np.shape(a)} -> {np.shape(new)}"


def m_retype(f, rng):
    name = str(rng.choice(_names(f, datasets_only=True)))
    a = f[name][()]
    target = rng.choice(["float64", "float16", "int32", "int64", "uint8", "bool", "complex64", "S4", "vlen-str"])
    try:
        if target == "vlen-str":
            new = np.asarray(a).astype(str).astype(object)
            new = np.asarray(new, dtype=h5py.string_dtype())
        elif np.asarray(a).dtype.kind == "O":
            new = np.arange(np.size(a), dtype=target if target != "S4" else "int16").reshape(np.shape(a))
        else:
            with np.errstate(all="ignore"):
                new = np.asarray(a).astype(target)
    except (ValueError, TypeError, OverflowError):
        new = np.zeros(np.shape(a), dtype="float64")
    _rewrite(f, name, new, rng)
    return f"retype {name} {np.asarray(a).dtype} -> {new.dtype}"


def m_values(f, rng):
    small = [n for n in _names(f, datasets_only=True) if not n.startswith("tensors/") or n.endswith("token")]
    name = str(rng.choice(small))
    a = np.asarray(f[name][()])
    if a.dtype.kind in "iu" and a.size:
        new = a.copy()
        idx = rng.integers(a.size)
        new.reshape(-1)[idx] = rng.choice([-5, -1, 0, 1, 2, 7, 10**6, int(new.reshape(-1)[idx]) + 1])
    elif a.dtype.kind == "O" and a.size:
        new = a.copy()
        new.reshape(-1)[rng.integers(a.size)] = rng.choice(
            [b"", b"owns", b"stores", b"reuses", b"sliding_attention", b"full_attention", b"bogus", b"\xff\xfe"]
        )
        new = np.asarray(new, dtype=h5py.string_dtype())
    else:
        return f"values {name} (skipped)"
    _rewrite(f, name, new, rng)
    return f"values {name}"


def m_link(f, rng):
    name = str(rng.choice(_names(f)))
    del f[name]
    if rng.random() < 0.5:
        f[name] = h5py.SoftLink("/nowhere/" + name)
        return f"dangling soft link {name}"
    f[name] = h5py.ExternalLink("missing-file.h5", "/" + name)
    return f"external link {name}"


STRUCTURAL = {
    "delete": m_delete,
    "rename": m_rename,
    "del_attr": m_del_attr,
    "attr_type": m_attr_type,
    "reshape": m_reshape,
    "retype": m_retype,
    "values": m_values,
    "link": m_link,
}


# ---------------------------------------------------------------- hostile files (a sender who means harm)
# Files outside the trace that a hostile trace points at. A run that opens one of them has read
# outside the file: the supervisor watches them with inotify (see OutsideWatch).
ENV: dict = {}  # "canary": raw bytes file, "outside": a valid trace (following a link to it "works")
CANARY = b"GEMMA4-TRACE-CANARY-" * 64


def _copy_attrs(src, dst):
    for k in src.attrs:
        dst.attrs[k] = src.attrs[k]


def _replace_dataset(f, name, make):
    old = f[name]
    attrs = {k: old.attrs[k] for k in old.attrs}
    shape, dtype = old.shape, old.dtype
    del f[name]
    ds = make(shape, dtype)
    for k, v in attrs.items():
        ds.attrs[k] = v
    return shape


def h_external_storage(f, rng):
    name = str(rng.choice(_names(f, datasets_only=True)))
    shape = _replace_dataset(
        f,
        name,
        lambda shape, dtype: f.create_dataset(
            name,
            shape=shape,
            dtype=dtype if dtype.kind != "O" else "int64",
            external=[(str(ENV["canary"]), int(rng.integers(0, 64)), h5py.h5f.UNLIMITED)],
        ),
    )
    return f"external storage {name} {shape} -> canary"


def h_external_link(f, rng):
    name = str(rng.choice(_names(f)))
    del f[name]
    target = ENV["outside"] if rng.random() < 0.7 else ENV["canary"]
    # absolute or relative (HDF5 resolves relative names against the trace's folder)
    fname = str(target) if rng.random() < 0.5 else target.name
    f[name] = h5py.ExternalLink(fname, "/" + name)
    return f"external link {name} -> {fname}"


def _link_pair(f, rng) -> tuple[str, list[str]]:
    """A random object name and the other names of its type outside its own subtree."""
    names = _names(f)
    name = str(rng.choice(names))
    is_group = isinstance(f[name], h5py.Group)
    same = [
        n
        for n in names
        if n != name
        and isinstance(f[n], h5py.Group) == is_group
        and not n.startswith(name + "/")
        and not name.startswith(n + "/")
    ]
    return name, same


def h_soft_link(f, rng):
    name, same = _link_pair(f, rng)
    if not same:
        return f"soft link {name} (no target)"
    target = str(rng.choice(same))
    del f[name]
    f[name] = h5py.SoftLink("/" + target)
    return f"soft link {name} -> {target}"


def h_hard_link(f, rng):
    name, same = _link_pair(f, rng)
    if not same:
        return f"hard link {name} (no target)"
    target = str(rng.choice(same))
    obj = f[target]
    if rng.random() < 0.5:
        del f[name]
        f[name] = obj
        return f"hard link {name} = {target}"
    f[name + "_alias"] = obj  # a second name beside the first
    return f"hard link {name}_alias = {target}"


def h_virtual(f, rng):
    name = str(rng.choice([n for n in _names(f, datasets_only=True) if f[n].dtype.kind != "O" and f[n].shape]))
    source = ENV["outside"] if rng.random() < 0.5 else ENV["outside"].with_name("missing.h5")

    def make(shape, dtype):
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        layout[...] = h5py.VirtualSource(str(source), "/" + name, shape=shape)
        return f.create_virtual_dataset(name, layout, fillvalue=0)

    _replace_dataset(f, name, make)
    return f"virtual {name} <- {source.name}"


def h_sparse(f, rng):
    """A huge declared shape with nothing stored (every chunk missing: no bytes on disk)."""
    name = str(rng.choice([n for n in _names(f, datasets_only=True) if f[n].ndim >= 1 and f[n].dtype.kind in "biuf"]))
    big = int(rng.choice([10**6, 10**9, 10**12]))

    def make(shape, dtype):
        new = list(shape)
        axis = int(rng.integers(len(new)))
        new[axis] = big
        chunks = tuple(min(d, 1024) for d in new)
        return f.create_dataset(
            name, shape=tuple(new), dtype=dtype, chunks=chunks, compression="gzip", maxshape=tuple(None for _ in new)
        )

    _replace_dataset(f, name, make)
    return f"sparse {name} axis -> {big}"


_ZERO_CHUNKS: dict = {}


def _zero_chunk(nbytes: int) -> bytes:
    if nbytes not in _ZERO_CHUNKS:
        import zlib

        _ZERO_CHUNKS[nbytes] = zlib.compress(bytes(nbytes), 9)
    return _ZERO_CHUNKS[nbytes]


def _bomb_dataset(g, name, shape, chunks, dtype="float32"):
    """A dataset of gzip-compressed zeros, chunks written directly: ~1000x smaller on disk than declared."""
    ds = g.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks, compression="gzip")
    raw = _zero_chunk(int(np.prod(chunks)) * np.dtype(dtype).itemsize)
    for r in range(0, shape[0], chunks[0]):
        for c in range(0, shape[1], chunks[1]):
            ds.id.write_direct_chunk((r, c), raw)
    ds.attrs["source_dtype"] = "float32" if dtype == "float32" else str(np.dtype(dtype))
    return ds


def h_bomb(f, rng):
    """A compression bomb. Either within what the golden's header allows (the mask, wide as the
    limits let it be), or behind a header of 200,000 positions, consistent everywhere, whose
    tensors are gigabytes of compressed zeros in a file of a few MB."""
    if rng.random() < 0.5:
        layer = int(rng.integers(8))
        name = f"tensors/L{layer:02d}/mask"
        if name in f:
            del f[name]
        width = int(rng.choice([1 << 16, 1 << 18, 1 << 20]))
        _bomb_dataset(f, name, (15, width), (15, 1 << 14), dtype="bool")
        return f"bomb {name} (15, {width}) bool"
    n = int(rng.choice([50_000, 200_000, 1_000_000]))
    for k in ("tensors", "inputs/prompt_ids", "steps/positions"):
        if k in f:
            del f[k]
    f["inputs/prompt_ids"] = np.full(n, 5, dtype=np.int64)
    f["inputs"].attrs["max_new_tokens"] = 1
    f.require_group("steps")["positions"] = np.array([[0, n]], dtype=np.int64)
    t = f.create_group("tensors")
    t["token"] = np.array([5], dtype=np.int64)
    t["token"].attrs["source_dtype"] = "int64"
    kinds = ["embeddings", "final_hidden", "L00/layer_out", "L01/attn_out"][: int(rng.integers(1, 5))]
    for kind in kinds:
        _bomb_dataset(t, kind, (n, 256), (256, 256))
    return f"bomb header {n} positions, {len(kinds)} x ({n}, 256) float32 zeros"


def h_deep(f, rng):
    places = ["junk", "tensors/L01/junk", "inputs/extra/junk", "model/junk", "tensors/junk"]
    if S.GROUP_TOWERS in f:  # a version-2 trace: inside the tower table and a tower's layer group too
        places += ["towers/vision/junk", "tensors/vision/L00/junk"]
    where = str(rng.choice(places))
    depth = int(rng.integers(1000, ENV.get("deep_max", 20_000) + 1))
    f.create_group(f"{where}/" + "/".join(["d"] * depth))
    return f"deep tree {where} x {depth}"


def h_huge_attr(f, rng):
    how = int(rng.integers(3))
    holder = str(rng.choice(["inputs", "/", "tensors/L02/q", "model/head_dim"]))
    size = int(rng.choice([17 << 20, 64 << 20, 240 << 20])) if how == 0 else int(rng.choice([1 << 20, 20 << 20]))
    if how == 0:  # fixed-length: needs dense attribute storage, so the object is rebuilt in the latest format
        if holder in ("/", "model/head_dim", "tensors/L02/q"):
            holder = "inputs"
        old, new = f[holder], f.create_group(holder + "_new")
        for k in old:
            f.copy(old[k], new, k)
        _copy_attrs(old, new)
        del f[holder]
        f.move(holder + "_new", holder)
        f[holder].attrs["prompt_text"] = np.frombuffer(b"x" * size, dtype=f"S{size}")[0]
        return f"fixed-length attribute {holder}@prompt_text of {size} bytes"
    if how == 1:  # variable-length text: its bytes live in the global heap, bounded by the file
        key = str(rng.choice(["prompt_text", "model_config", "source_dtype", "extra"]))
        f[holder].attrs[key] = "y" * size
        return f"vlen attribute {holder}@{key} of {size} bytes"
    for i in range(int(rng.choice([100, 1000, 5000]))):  # many attributes
        f[holder].attrs[f"a{i}"] = i
    return f"many attributes on {holder}"


HOSTILE = {
    "external_storage": h_external_storage,
    "external_link": h_external_link,
    "soft_link": h_soft_link,
    "hard_link": h_hard_link,
    "virtual": h_virtual,
    "sparse": h_sparse,
    "bomb": h_bomb,
    "deep": h_deep,
    "huge_attr": h_huge_attr,
}


# ---------------------------------------------------------------- version 2: encoder towers (issue 49)
# A share of the cases (TOWER_SHARE, drawn from a stream of its own, so every other case is the
# mutation it always was) starts from a version-2 trace instead of the golden: tests/support/synth.py's
# writer with a two-image vision tower and a one-clip audio tower, their sub-configs and token ids
# in the model config, the prompt holding their soft tokens. Such a case applies one TOWER class
# below (alone, or with one damage or hostile class), or the classes above alone. A TOWER class
# says, where the format decides it, that its mutant must be refused (MUST_REFUSE) or read
# (MUST_READ); a case with that mutation alone checks it: a forbidden trace read is a misread, a
# valid one refused is one too.
TOWER_SHARE = 1 / 3
TOWER_STREAM = 49  # the extra seed word of the draw that makes a case a version-2 case
MUST_REFUSE, MUST_READ = " [must be refused]", " [must read]"
# what a version-2 trace's refusal may not be when it must read (the diff may still say they differ)
REFUSALS = {
    "unreadable HDF5",
    "not a trace",
    "schema version",
    "corrupt data (checksum)",
    "damaged metadata",
    "invalid structure",
}
AUDIO = TowerInfo("audio", 1, 6, 2, 3, item_rows=(4,), item_tokens=(2,))
AUDIO_CONFIG = {"num_hidden_layers": 1, "hidden_size": 6, "num_attention_heads": 2, "head_dim": 3}
TOKEN_IDS = {"vision": ("image_token_id", 9), "audio": ("audio_token_id", 10)}
TOWER_PROMPT = (2, 9, 9, 9, 10, 10, 4, 3)  # 3 image and 2 audio soft tokens
# the table's attributes, the sub-config keys they come from and the reader's caps (traces/limits.py)
CONFIG_KEYS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "head_dim": "head_dim",
}
TOWER_CAPS = {"layers": LIM.MAX_LAYERS, "hidden": LIM.MAX_HIDDEN, "heads": LIM.MAX_HEADS, "head_dim": LIM.MAX_HEAD_DIM}


_TOWER_GOLDEN: dict = {}  # its bytes, written once per process


def tower_golden(path: Path) -> Path:
    """The version-2 golden: the synthetic text tower (4 layers), a vision and an audio tower."""
    if "bytes" in _TOWER_GOLDEN:
        path.write_bytes(_TOWER_GOLDEN["bytes"])
        return path
    from tests.support import synth

    ids = dict(TOKEN_IDS.values())
    sizes = {"hidden_size": synth.HIDDEN, "vocab_size": synth.VOCAB}  # so the text widths are bounded too
    config = synth.vision_config() | sizes | {"audio_config": AUDIO_CONFIG} | ids
    synth.write_trace(
        path,
        prompt_len=len(TOWER_PROMPT),
        prompt_ids=np.array(TOWER_PROMPT),
        towers=(synth.VISION, AUDIO),
        config=config,
        force=True,
    )
    _TOWER_GOLDEN["bytes"] = path.read_bytes()
    return path


def _towers(f) -> list[str]:
    g = f.get(S.GROUP_TOWERS)
    return sorted(g) if isinstance(g, h5py.Group) else []


def _tower(f, rng) -> str:
    return str(rng.choice(_towers(f)))


def _config(f) -> dict:
    return json.loads(f.attrs[S.ATTR_MODEL_CONFIG])


def _set_config(f, cfg) -> None:
    f.attrs[S.ATTR_MODEL_CONFIG] = cfg if isinstance(cfg, str) else json.dumps(cfg)


def _tower_dsets(f, tower: str) -> list[str]:
    out: list[str] = []
    g = f.get(S.tower_group(tower))
    if isinstance(g, h5py.Group):
        g.visititems(lambda n, o: out.append(f"{g.name[1:]}/{n}") if isinstance(o, h5py.Dataset) else None)
    return sorted(out)


def _layer_groups(f, tower: str) -> list[str]:
    g = f.get(S.tower_group(tower))
    return sorted(f"{g.name[1:]}/{n}" for n in g if n.startswith("L")) if isinstance(g, h5py.Group) else []


def _pick(rng, options: list):
    return options[int(rng.integers(len(options)))]


def t_attr(f, rng):
    """towers/<tower>'s integer attributes: the same value as another integer type (read), a wrong
    value, type or shape, deleted, or too many attributes (refused)."""
    tower = _tower(f, rng)
    g = f[S.tower_path(tower)]
    key = str(rng.choice(S.TOWER_ATTRS))
    v = int(g.attrs[key])
    how = int(rng.integers(5))
    if how == 0:
        value = _pick(rng, [np.int32(v), np.uint8(v), np.int16(v), np.uint64(v), np.array([v]), np.array([v], "u2")])
        g.attrs[key] = value
        return f"tower attribute {tower}@{key} = {value!r} (the same integer){MUST_READ}"
    if how == 1:
        cap = TOWER_CAPS[key]
        value = _pick(rng, [0, -1, np.int64(-(2**63)), 2**31, 2**62, np.uint64(2**64 - 1), cap + 1, v + 1, v * 2])
    elif how == 2:
        value = _pick(
            rng,
            [
                str(v),
                np.bytes_(str(v)),
                float(v),
                True,
                complex(v),
                np.float64("nan"),
                np.array([v, v]),
                np.array([[v]]),
                np.array([], np.int64),
                "garbage",
                h5py.Empty("i8"),
                np.array([str(v)], dtype=h5py.string_dtype()),
            ],
        )
    elif how == 3:
        del g.attrs[key]
        return f"tower attribute {tower}@{key} deleted{MUST_REFUSE}"
    else:
        for i in range(LIM.MAX_ATTRS + 1):
            g.attrs[f"x{i}"] = i
        return f"tower {tower}: {LIM.MAX_ATTRS + 1} more attributes{MUST_REFUSE}"
    g.attrs[key] = value
    return f"tower attribute {tower}@{key} = {value!r:.40}{MUST_REFUSE}"


def _bomb_items(f, path: str, rng) -> str:
    n = int(rng.choice([1 << 22, 1 << 30, 1 << 40]))
    chunk = min(n, 1 << 22)  # 32 MiB of int64 zeros, within the reader's chunk limit
    del f[path]
    ds = f.create_dataset(path, shape=(n,), dtype="int64", chunks=(chunk,), compression="gzip", maxshape=(None,))
    ds.id.write_direct_chunk((0,), _zero_chunk(chunk * 8))
    return f"items bomb {path} ({n},) int64 of gzip zeros{MUST_REFUSE}"


def t_items(f, rng):
    """towers/<tower>/item_rows or item_tokens: another integer dtype or storage (read); a float, bool or
    text dtype, another rank or length, zeros, negatives, huge values, sums past int64, a bomb (refused)."""
    tower = _tower(f, rng)
    path = S.tower_path(tower, str(rng.choice(S.TOWER_DSETS)))
    a = np.asarray(f[path][()])
    how = int(rng.integers(6))
    if how == 0:
        new = a.astype(_pick(rng, ["int8", "int32", "uint16", "uint64", ">i8"]))
        expect = MUST_READ
    elif how == 1:
        new = _pick(
            rng,
            [
                a.astype("float64"),
                a.astype(bool),
                a.astype("S4"),
                np.asarray(a.astype(str).astype(object), dtype=h5py.string_dtype()),
                a.astype("complex64"),
                a.astype("float16"),
            ],
        )
        expect = MUST_REFUSE
    elif how == 2:
        new = _pick(rng, [a[:, None], a[None, :], np.int64(a.sum()), a[:-1], np.concatenate([a, a[-1:]]), a[:0]])
        new = new if np.ndim(new) else np.asarray(new)
        expect = MUST_REFUSE
    elif how == 3:
        new = a.copy()
        bad = [0, -1, -(2**63), 2**62, 2**63 - 1, LIM.MAX_POSITIONS + 1, int(a[-1]) + 1]
        new[int(rng.integers(a.size))] = _pick(rng, bad)
        expect = MUST_REFUSE
    elif how == 4:
        new = _pick(
            rng,
            [
                np.full(a.size, 2**62, dtype=np.int64),  # each too big, the sum past int64
                np.full(a.size, 2**63, dtype=np.uint64),  # two items: the uint64 sum wraps to 0
                np.full(a.size, LIM.MAX_POSITIONS // max(1, a.size) + 1, dtype=np.int64),  # each fine, the sum not
                np.ones(LIM.MAX_EXTRA_INPUTS + 1, dtype=np.int64),  # 65 items of one row each
            ],
        )
        expect = MUST_REFUSE
    else:
        return _bomb_items(f, path, rng)
    _rewrite(f, path, new, rng)
    return f"items {path} {a.dtype}{a.shape} {a.tolist()} -> {new.dtype}{np.shape(new)} {_brief(new)}{expect}"


def _brief(a) -> str:
    return f"{np.asarray(a).reshape(-1)[:4].tolist()}"[:60]


def _bomb_rows(f, rng) -> str:
    """A consistent header of many patches: every vision patch-row kind is gzip-compressed zeros."""
    n = int(rng.choice([1 << 14, 1 << 17, 1 << 20]))
    items = f[S.tower_path("vision", S.DSET_ITEM_ROWS)]
    split = np.array([n // 2, n - n // 2], dtype=np.int64)[: items.shape[0]]
    split[-1] = n - int(split[:-1].sum())
    del f[items.name]
    f[S.tower_path("vision", S.DSET_ITEM_ROWS)] = split
    kinds = 0
    for name in _tower_dsets(f, "vision"):
        ds = f[name]
        if ds.shape[0] != 9:  # the soft tokens keep their rows
            continue
        row, attrs = ds.shape[1:], dict(ds.attrs)
        del f[name]
        rows = max(1, (1 << 20) // (4 * int(np.prod(row))))
        chunks = (min(n, rows), *row)
        new = f.create_dataset(name, shape=(n, *row), dtype="float32", chunks=chunks, compression="gzip")
        raw = _zero_chunk(int(np.prod(chunks)) * 4)
        for r in range(0, n, chunks[0]):
            new.id.write_direct_chunk((r,) + (0,) * len(row), raw)
        for k, v in attrs.items():
            new.attrs[k] = v
        kinds += 1
    return f"rows bomb: vision item_rows {split.tolist()}, {kinds} kinds of ({n}, ...) float32 zeros"


def t_tensors(f, rng):
    """A dataset under tensors/<tower>/: rows past or short of its tower's count, rows wider than the
    limits (or within them: read), another rank or dtype (float16, bfloat16 bits: read), no
    source_dtype, a rows_present flag, a declared 10^9 rows, a bomb behind a consistent header."""
    tower = _tower(f, rng)
    names = _tower_dsets(f, tower)
    name = str(rng.choice(names))
    a = f[name][()]
    n, row = a.shape[0], a.shape[1:]
    how = int(rng.integers(6))
    if how == 0:
        other = 9 if n != 9 else 3  # the vision tower's patches vs its soft tokens
        rows = _pick(rng, [n + 1, n - 1, 0, 2 * n, other])
        new, expect = np.resize(a, (rows, *row)), MUST_REFUSE
    elif how == 1:
        width = _pick(rng, [row[-1] * LIM.ROW_SLACK + 1, 0, row[-1] * 2])
        new = np.zeros((n, *row[:-1], width), dtype=a.dtype)
        expect = MUST_READ if width == row[-1] * 2 else MUST_REFUSE
    elif how == 2:
        new, expect = (
            _pick(rng, [a[..., None], a.reshape(n, -1) if a.ndim > 2 else a[:, :, None, None], a[0]]),
            MUST_REFUSE,
        )
    elif how == 3:
        target = _pick(rng, ["float16", "float64", "int32", "bool", "longdouble", "complex64", "uint16"])
        with np.errstate(all="ignore"):
            new = a.astype(target)
        expect = MUST_READ if target in ("float16", "float64") else MUST_REFUSE
    elif how == 4:
        return _tensor_attrs(f, name, a, rng)
    else:
        if rng.random() < 0.5 and tower == "vision" and f[S.tower_path(tower, S.DSET_ITEM_ROWS)].shape == (2,):
            return _bomb_rows(f, rng)

        def make(shape, dtype):
            return f.create_dataset(name, shape=(10**9, *shape[1:]), dtype=dtype, chunks=(1024, *shape[1:]))

        _replace_dataset(f, name, make)
        return f"sparse {name} (10^9 rows declared){MUST_REFUSE}"
    _rewrite(f, name, new, rng)
    return f"tower tensor {name} {a.dtype}{a.shape} -> {new.dtype}{np.shape(new)}{expect}"


def _tensor_attrs(f, name: str, a, rng) -> str:
    how = int(rng.integers(5))
    ds = f[name]
    if how == 0:  # bfloat16 bit patterns, as the writer stores a bfloat16 run: the same trace
        bits = (np.asarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        attrs = dict(ds.attrs)
        del f[name]
        new = f.create_dataset(name, data=bits)
        for k, v in attrs.items():
            new.attrs[k] = v
        new.attrs[S.ATTR_STORAGE] = S.STORAGE_BF16
        return f"tower tensor {name} stored as bfloat16 bits{MUST_READ}"
    if how == 1:
        ds.attrs[S.ATTR_STORAGE] = _pick(rng, [S.STORAGE_BF16, "garbage", ""])
        return f"tower tensor {name} says storage {ds.attrs[S.ATTR_STORAGE]!r} on {ds.dtype}{MUST_REFUSE}"
    if how == 2:
        del ds.attrs[S.ATTR_SOURCE_DTYPE]
        return f"tower tensor {name} without {S.ATTR_SOURCE_DTYPE}{MUST_REFUSE}"
    if how == 3:
        f[name + S.ROWS_PRESENT_SUFFIX] = np.ones(a.shape[0], dtype=bool)
        return f"rows_present beside the encoder tensor {name}{MUST_REFUSE}"
    ds.attrs[S.ATTR_SOURCE_DTYPE] = _pick(rng, [WEIRD_ATTRS[int(rng.integers(len(WEIRD_ATTRS)))], "bfloat16"])
    return f"tower tensor {name} source_dtype {ds.attrs[S.ATTR_SOURCE_DTYPE]!r:.40}"


LAYER_NAMES = (
    "L1",
    "L001",
    "L-1",
    "L+1",
    "l00",
    "L00 ",
    "L\u0661",
    "L\u0660\u0661",
    "L",
    "L0x1",
    "L" + "0" * 5000 + "1",
)


def t_names(f, rng):
    """Objects of the tower layout renamed or moved: a layer group past the tower's layers or named
    unlike the writer names one, a kind moved to another tower, a tower group moved or renamed,
    datasets of two towers (or a tower's two tables) swapped, a group made a dataset; two layer
    groups swapped (read)."""
    towers = _towers(f)
    tower = str(rng.choice(towers))
    other = next((t for t in towers if t != tower), tower)
    groups = _layer_groups(f, tower)
    layers = int(f[S.tower_path(tower)].attrs["layers"])
    base = S.tower_group(tower)
    how = int(rng.integers(5))
    if how == 4:  # a group of the layout replaced by a dataset of its name
        name = _pick(rng, [S.GROUP_TOWERS, S.tower_path(tower), base, *groups[:1]])
        del f[name]
        f[name] = np.arange(3, dtype=np.int64)
        return f"{name} made a dataset{MUST_REFUSE}"
    if how == 0 and groups:
        src = groups[-1]
        dst = f"{base}/" + _pick(rng, [f"L{layers:02d}", "L99", f"L{10**12}", *LAYER_NAMES])
        f.move(src, dst)
        return f"rename {src} -> {dst[:60]}{MUST_REFUSE}"
    if how == 1:
        moves = [
            (f"{base}/L00", f"{S.tower_group(other)}/L{layers + 1:02d}"),
            (f"{base}/{'pooled' if tower == 'vision' else 'subsampled'}", f"{S.tower_group(other)}/pooled"),
            (f"{base}/soft_tokens", "tensors/soft_tokens"),
            ("tensors/L00/mask", f"{base}/L00/mask"),
            ("tensors/L00/q", f"{base}/L00/q_"),
            (base, "tensors/L09"),
            (base, f"{S.tower_path(tower)}/tensors"),
            (S.tower_path(tower), f"{base}/towers"),
            (base, f"tensors/{tower.capitalize()}"),
            (base, "tensors/smell"),
            (S.tower_path(tower), "towers/smell"),
        ]
        src, dst = _pick(rng, moves)
        f.move(src, dst)
        return f"move {src} -> {dst}{MUST_REFUSE}"
    if how == 2:
        swaps = [
            (f"{base}/soft_tokens", f"{S.tower_group(other)}/soft_tokens"),
            (S.tower_path(tower, S.DSET_ITEM_ROWS), S.tower_path(other, S.DSET_ITEM_ROWS)),
            (S.tower_path(tower, S.DSET_ITEM_ROWS), S.tower_path(tower, S.DSET_ITEM_TOKENS)),
            (base, S.tower_group(other)),
            (S.tower_path(tower), S.tower_path(other)),
        ]
        a, b = _pick(rng, swaps)
        if tower == other:
            return f"swap {a} (one tower)"
        f.move(a, "__swap__")
        f.move(b, a)
        f.move("__swap__", b)
        return f"swap {a} <-> {b}{MUST_REFUSE}"
    if len(groups) < 2:
        return f"swap layer groups of {tower} (only {len(groups)})"
    a, b = groups[0], groups[-1]
    f.move(a, "__swap__")
    f.move(b, a)
    f.move("__swap__", b)
    return f"swap {a} <-> {b} (the same shapes){MUST_READ}"


def t_links(f, rng):
    """An object of the tower layout replaced by (or given) a soft link, an external link (absolute or
    relative, to a valid version-2 trace) or a second hard name."""
    tower = _tower(f, rng)
    towers = _towers(f)
    other = next((t for t in towers if t != tower), tower)
    base = S.tower_group(tower)
    names = [S.GROUP_TOWERS, S.tower_path(tower), S.tower_path(tower, S.DSET_ITEM_ROWS), base]
    names += _layer_groups(f, tower)[:1] + _tower_dsets(f, tower)[:2]
    name = str(rng.choice(names))
    how = int(rng.integers(3))
    if how == 0:
        target = _pick(rng, [S.tower_path(other), S.tower_group(other), f"{base}/L00", "/nowhere", "tensors/L00/q"])
        if name == S.GROUP_TOWERS:  # the table kept under another name, reached by the link
            f.move(name, "towers_")
            target = "towers_"
        else:
            del f[name]
        f[name] = h5py.SoftLink("/" + target.lstrip("/"))
        return f"soft link {name} -> {target}{MUST_REFUSE}"
    if how == 1:
        outside = ENV["outside"]
        fname = str(outside) if rng.random() < 0.5 else outside.name
        del f[name]
        f[name] = h5py.ExternalLink(fname, "/" + name)
        return f"external link {name} -> {fname}{MUST_REFUSE}"
    pairs = [
        (S.tower_path(tower, S.DSET_ITEM_TOKENS), S.tower_path(tower, S.DSET_ITEM_ROWS)),
        (S.tower_path(other), S.tower_path(tower)),
        (f"{S.tower_group(other)}/soft_tokens", f"{base}/soft_tokens"),
        (f"{base}/L01", f"{base}/L00"),
        (f"{base}/L00/k", f"{base}/L00/q"),
        (f"{base}/L00_", f"{base}/L00"),
    ]
    alias, target = _pick(rng, pairs)
    if alias == target:
        return f"hard link {alias} (no other tower)"
    if alias in f:
        del f[alias]
    f[alias] = f[target]
    return f"hard link {alias} = {target}{MUST_REFUSE}"


def t_version(f, rng):
    """The schema version flipped between 1 and 2 (or made 0, 3, text, a float ...), with and without
    a towers/ table: refused, except where the result is a trace of the version it says (read)."""
    if not _towers(f):  # the version-1 golden
        return _v1_to_v2(f, rng)
    how = int(rng.integers(5))
    if how == 0:
        f.attrs[S.ATTR_SCHEMA_VERSION] = 1
        return f"schema_version 1 with a towers/ table{MUST_REFUSE}"
    if how == 1:
        f.attrs[S.ATTR_SCHEMA_VERSION] = 1
        del f[S.GROUP_TOWERS]
        if rng.random() < 0.5:
            return f"schema_version 1, no towers/ table, tensors/<tower> kept{MUST_REFUSE}"
        for t in ("vision", "audio"):
            del f[S.tower_group(t)]
        return f"schema_version 1, no towers/ and no tower tensors: a text trace{MUST_READ}"
    if how == 2:
        if rng.random() < 0.5:
            del f[S.GROUP_TOWERS]
            return f"schema_version 2 without towers/{MUST_REFUSE}"
        for t in _towers(f):
            del f[S.tower_path(t)]
        return f"schema_version 2, towers/ empty{MUST_REFUSE}"
    if how == 3:
        value = _pick(rng, [np.uint8(2), np.int32(2), np.array([2])])
        f.attrs[S.ATTR_SCHEMA_VERSION] = value
        return f"schema_version {value!r} (the same integer){MUST_READ}"
    value = _pick(
        rng,
        [0, -1, 3, 2**63 - 1, np.uint64(2**64 - 1), "2", np.bytes_("2"), 2.0, True, np.array([2, 2]), h5py.Empty("i8")],
    )
    f.attrs[S.ATTR_SCHEMA_VERSION] = value
    return f"schema_version {value!r}{MUST_REFUSE}"


def _v1_to_v2(f, rng):
    """The version-1 golden made version 2: a vision table as its model config's vision_config says
    (read when the config names no image token, which its prompt does not hold), or none."""
    how = int(rng.integers(3))
    f.attrs[S.ATTR_SCHEMA_VERSION] = 2
    if how == 0:
        return f"schema_version 2 on a text trace, no towers/{MUST_REFUSE}"
    cfg = _config(f)
    sub = cfg.get("vision_config") or {}
    g = f.create_group(S.tower_path("vision"))
    for attr, key in CONFIG_KEYS.items():
        g.attrs[attr] = int(sub.get(key, 0) or 0)
    g[S.DSET_ITEM_ROWS] = np.array([4], dtype=np.int64)
    g[S.DSET_ITEM_TOKENS] = np.array([1], dtype=np.int64)
    if how == 1:
        return f"schema_version 2 on a text trace, a vision table, image_token_id kept (no image token){MUST_REFUSE}"
    cfg.pop("image_token_id", None)
    _set_config(f, cfg)
    return f"schema_version 2 on a text trace, a vision table as its config says, no image_token_id{MUST_READ}"


# JSON no writer makes: nested past the parser's recursion limit, a lone surrogate, numbers of
# 4,000 digits (Python parses up to 4,300), NaN and Infinity, duplicated keys (the last one wins)
DEEP_JSON = "[" * 100_000 + "]" * 100_000


def t_config(f, rng):
    """The model config's vision_config / audio_config / image_token_id / audio_token_id changed to
    disagree with the tower table or the prompt, or made hostile JSON."""
    tower = _tower(f, rng)
    cfg = _config(f)
    sub_key = S.TOWER_BY_NAME[tower].config
    sub = dict(cfg[sub_key])
    how = int(rng.integers(5))
    if how == 0:  # the sub-config gone, or not an object
        value = _pick(rng, ["missing", None, "garbage", "\udcff", [], [1, 2], 5, True, 1e400, {}])
        if value == "missing":
            cfg.pop(sub_key)
        else:
            cfg[sub_key] = value
        _set_config(f, cfg)
        return f"model_config {sub_key} = {value!r:.30}{MUST_REFUSE}"
    if how == 1:  # one size changed
        attr = str(rng.choice(list(CONFIG_KEYS)))
        key, v = CONFIG_KEYS[attr], sub[CONFIG_KEYS[attr]]
        value = _pick(
            rng, [v + 1, v * 3, 0, -v, 2**63, 10**30, str(v), float(v), True, None, [v], {"v": v}, float("nan")]
        )
        sub[key] = value
        cfg[sub_key] = sub
        _set_config(f, cfg)
        same = isinstance(value, int) and not isinstance(value, bool) and value == v
        # a head_dim that is no positive integer is derived from hidden / heads: the same here
        derived = attr == "head_dim" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
        expect = MUST_READ if same or derived else MUST_REFUSE
        return f"model_config {sub_key}.{key} {v} -> {value!r:.30}{expect}"
    if how == 2:  # the soft tokens' token id
        key, tid = TOKEN_IDS[tower]
        prompt = f[S.DSET_PROMPT_IDS][()]
        tokens = int(f[S.tower_path(tower, S.DSET_ITEM_TOKENS)][()].sum())
        value = _pick(
            rng, [int(prompt[0]), int(prompt[-1]), 7, -1, 2**70, 10**3999, True, float(tid), str(tid), None, "missing"]
        )
        if value == "missing":
            cfg.pop(key)
        else:
            cfg[key] = value
        _set_config(f, cfg)
        counted = isinstance(value, int) and not isinstance(value, bool)
        expect = MUST_REFUSE if counted and int((prompt == value).sum()) != tokens else MUST_READ
        return f"model_config {key} {tid} -> {value!r:.30}{expect}"
    if how == 3:  # the token id moved, the prompt's soft tokens with it
        key, tid = TOKEN_IDS[tower]
        prompt = f[S.DSET_PROMPT_IDS][()]
        prompt[prompt == tid] = 7
        f[S.DSET_PROMPT_IDS][...] = prompt
        cfg[key] = 7
        _set_config(f, cfg)
        return f"model_config {key} {tid} -> 7, the prompt's tokens too{MUST_READ}"
    text = json.dumps(cfg)
    key, tid = TOKEN_IDS[tower]
    raw, expect = _pick(
        rng,
        [
            (text[:-1] + f', "{sub_key}": "garbage"}}', MUST_REFUSE),  # a second key: the last one wins
            (text.replace(f'"{sub_key}": ', f'"{sub_key}": {DEEP_JSON}, "x": ', 1), MUST_REFUSE),
            (text[:-1] + ', "pad": "' + "p" * (8 << 20) + '"}', MUST_READ),  # 8 MiB, under the attribute limit
            (text.replace(f'"{key}": {tid}', f'"{key}": {"9" * 5000}'), MUST_REFUSE),  # past Python's 4,300 digits
            (DEEP_JSON, MUST_REFUSE),
            (text[:-1] + ', "\\ud800": NaN, "y": Infinity}', MUST_READ),
        ],
    )
    _set_config(f, raw)
    return f"model_config hostile JSON ({len(raw)} characters: {raw[:20]!r}...){expect}"


def t_valid(f, rng):
    """Changes that leave a valid version-2 trace (each must read): another layer count for a tower
    (more layers than the text tower too), the items split otherwise, a tower's kinds or whole
    tower dropped, the table rebuilt with its attributes in another order."""
    tower = _tower(f, rng)
    how = int(rng.integers(5))
    if how == 0:
        return _relayer(f, tower, int(rng.choice([1, 3, 6, 9])))
    if how == 1:
        return _resplit(f, tower, rng)
    if how == 2:
        names = _tower_dsets(f, tower)
        drop = str(rng.choice(names)) if rng.random() < 0.7 else S.tower_group(tower)
        del f[drop]
        return f"drop {drop}{MUST_READ}"
    if how == 3:
        if len(_towers(f)) < 2:
            return f"drop the {tower} tower (the last one)"
        del f[S.tower_path(tower)]
        del f[S.tower_group(tower)]
        return f"drop the {tower} tower (its sub-config kept){MUST_READ}"
    g = f[S.tower_path(tower)]
    attrs = {k: g.attrs[k] for k in reversed(list(g.attrs))}
    f.move(g.name, "table_")
    new = f.create_group(S.tower_path(tower))
    for k, v in attrs.items():
        new.attrs[k] = v
    for k in S.TOWER_DSETS:
        f.move(f"table_/{k}", f"{new.name}/{k}")
    del f["table_"]
    return f"rebuild towers/{tower} (attributes reversed){MUST_READ}"


def _relayer(f, tower: str, n: int) -> str:
    cfg = _config(f)
    sub_key = S.TOWER_BY_NAME[tower].config
    cfg[sub_key] = dict(cfg[sub_key], num_hidden_layers=n)
    _set_config(f, cfg)
    f[S.tower_path(tower)].attrs["layers"] = n
    groups = _layer_groups(f, tower)
    for i in range(len(groups), n):
        f.copy(f[groups[0]], S.layer_group(i, tower))
    for i in range(n, len(groups)):
        del f[S.layer_group(i, tower)]
    return f"{tower} tower of {n} layers (config, table, layer groups){MUST_READ}"


def _resplit(f, tower: str, rng) -> str:
    rows = f[S.tower_path(tower, S.DSET_ITEM_ROWS)][()]
    tokens = f[S.tower_path(tower, S.DSET_ITEM_TOKENS)][()]
    if rng.random() < 0.5 or tokens.sum() < 2:  # one item
        new_rows, new_tokens = [int(rows.sum())], [int(tokens.sum())]
    else:  # two items, split elsewhere
        r, t = int(rows.sum()), int(tokens.sum())
        a, b = int(rng.integers(1, r)), int(rng.integers(1, t))
        new_rows, new_tokens = [a, r - a], [b, t - b]
    for name, vals in ((S.DSET_ITEM_ROWS, new_rows), (S.DSET_ITEM_TOKENS, new_tokens)):
        path = S.tower_path(tower, name)
        del f[path]
        f[path] = np.array(vals, dtype=np.int64)
    return f"{tower} items {rows.tolist()}/{tokens.tolist()} -> {new_rows}/{new_tokens}{MUST_READ}"


def t_images(f, rng):
    """inputs/extra/image_position_ids beside the vision tower (the trace's own images, which its
    table must agree with): positions giving other patch or soft-token counts, another dtype, rank or
    width, a declared patch count past the bound. All refused: the synthetic table (6+3 patches, 2+1
    soft tokens) has no positions that agree with it at any pooling kernel."""
    cfg = _config(f)
    cfg.setdefault("vision_config", {})["pooling_kernel_size"] = int(rng.choice([1, 2, 3]))
    _set_config(f, cfg)
    patches = int(rng.choice([8, 16, 64]))
    pos = np.full((2, patches, 2), -1, dtype=np.int64)
    for i in range(2):
        n = int(rng.integers(patches + 1))
        pos[i, :n] = np.stack([np.arange(n) % 4, np.arange(n) // 4], axis=-1)
    how = int(rng.integers(4))
    if how == 1:
        pos = pos.astype(_pick(rng, ["float32", "bool", "S4"]))
    elif how == 2:
        pos = _pick(rng, [pos[..., 0], pos[:1], np.concatenate([pos, pos[:1]]), np.concatenate([pos, pos], -1)])
    path = S.input_extra_path("image_position_ids")
    if how == 3:  # declared past the bound: never read
        f.create_dataset(path, shape=(2, (1 << 16) + 1, 2), dtype=np.int64)
        return f"image_position_ids declared (2, 65537, 2){MUST_REFUSE}"
    f[path] = pos
    return f"image_position_ids {pos.dtype} {pos.shape}{MUST_REFUSE}"


TOWER = {
    "tower_images": t_images,
    "tower_attr": t_attr,
    "tower_items": t_items,
    "tower_tensors": t_tensors,
    "tower_names": t_names,
    "tower_links": t_links,
    "tower_version": t_version,
    "tower_config": t_config,
    "tower_valid": t_valid,
}


# ---------------------------------------------------------------- byte-level corruptions
def _in_chunk(info: Info, off: int) -> bool:
    return any(a <= off < b for a, b in info.chunk_ranges)


def b_flip(path, rng, info, meta_only=False):
    data = bytearray(path.read_bytes())
    offs = []
    for _ in range(int(rng.integers(1, 9))):
        for _try in range(200):
            off = int(rng.integers(len(data)))
            if not meta_only or not _in_chunk(info, off):
                break
        data[off] ^= 1 << int(rng.integers(8))
        offs.append(off)
    path.write_bytes(bytes(data))
    return f"{'meta-' if meta_only else ''}flip at {offs}"


def b_smash(path, rng, info):
    data = bytearray(path.read_bytes())
    off = int(rng.integers(len(data)))
    n = int(rng.integers(1, 65))
    data[off : off + n] = (
        bytes(rng.integers(0, 256, size=len(data[off : off + n]), dtype=np.uint8))
        if rng.random() < 0.5
        else bytes(len(data[off : off + n]))
    )
    path.write_bytes(bytes(data))
    return f"smash {n} bytes at {off}"


def b_truncate(path, rng, info):
    size = path.stat().st_size
    cut = int(rng.integers(size)) if rng.random() < 0.7 else size - int(rng.integers(1, 2049))
    with open(path, "r+b") as fh:
        fh.truncate(max(0, cut))
    return f"truncate at {max(0, cut)} of {size}"


BYTES = {
    "flip": b_flip,
    "meta_flip": lambda p, r, i: b_flip(p, r, i, meta_only=True),
    "smash": b_smash,
    "truncate": b_truncate,
}
DAMAGE = list(STRUCTURAL) + list(BYTES)
ALL = DAMAGE + list(HOSTILE) + list(TOWER)


def generic_picks(rng) -> list[str]:
    """Half the cases hostile (one hostile class, maybe with damage), half damage only."""
    picks = [str(x) for x in rng.choice(DAMAGE, size=int(rng.integers(1, 4)))]
    if rng.random() < 0.5:
        picks = [str(rng.choice(list(HOSTILE)))] + picks[: int(rng.integers(0, 2))]
    return picks


def plan_case(seed: int, case: int, rng, only: str | None, share: float = TOWER_SHARE) -> tuple[str, list[str] | None]:
    """Which golden a case starts from ("v1": the golden, "v2": the version-2 one) and, for a
    version-2 case, its classes (None: `corrupt` draws them). A case is a version-2 case by a draw
    of its own (TOWER_SHARE), so every version-1 case is the mutation it was before towers."""
    side = np.random.default_rng([seed, case, TOWER_STREAM])
    if only in TOWER:
        picks = [only]
    elif side.random() >= share:
        return "v1", None
    elif only is not None:
        return "v2", None
    else:  # one tower class alone (60%), with one damage or hostile class (20%), or those alone (20%)
        r = rng.random()
        picks = [str(rng.choice(list(TOWER)))] if r < 0.8 else None
        if picks and r >= 0.6:
            picks.append(str(rng.choice(DAMAGE + list(HOSTILE))))
    # the version flip also starts from the text-only golden (made version 2, with a table or not)
    v1 = picks == ["tower_version"] and side.random() < 0.4
    return ("v1" if v1 else "v2"), picks


def corrupt(
    src: Path, dst: Path, rng, info: Info, only: str | None = None, picks: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Copy src to dst and corrupt it; return (mutation names, descriptions). Without `picks`, half
    the cases are hostile (one hostile mutation, maybe with damage), half damage only; `only`
    forces one class."""
    shutil.copyfile(src, dst)
    if picks is None:
        picks = [only] if only is not None else generic_picks(rng)
    # the tower class first (it needs the layout it changes), damage next, the hostile class last:
    # walking a 20,000-deep tree to pick a name is quadratic
    structural = [p for p in picks if p in TOWER] + [p for p in picks if p in STRUCTURAL]
    structural += [p for p in picks if p in HOSTILE]
    byte_level = [p for p in picks if p in BYTES]
    done = []
    if structural:
        with h5py.File(dst, "r+") as f:
            for p in structural:
                try:
                    done.append({**STRUCTURAL, **HOSTILE, **TOWER}[p](f, rng))
                except (KeyError, ValueError, TypeError, OSError, RuntimeError) as e:  # e.g. its target is gone
                    done.append(f"{p} failed ({type(e).__name__}: {str(e)[:80]})")
    for p in byte_level:
        done.append(BYTES[p](dst, rng, info))
    return picks, done


def expectation(picks: list[str], done: list[str]) -> str | None:
    """MUST_REFUSE or MUST_READ when the case is one tower class alone that says which, else None."""
    if len(picks) == 1 and picks[0] in TOWER and len(done) == 1:
        return next((e for e in (MUST_REFUSE, MUST_READ) if done[0].endswith(e)), None)
    return None


def expect_problem(expect: str | None, tower_only: bool, command: str, code, err: str) -> str | None:
    """What the format's verdict on the case makes of an outcome the generic check let through."""
    kind = message_kind(err) if code == 2 else None
    if tower_only and kind == "damaged metadata":  # h5py wrote this file whole: an exception of ours
        return "an exception inside the checks reported as damage (the file is whole HDF5)"
    if expect == MUST_REFUSE and code != 2:
        return f"exit {code}: read a trace the format forbids (a misread; it must be refused)"
    if expect == MUST_READ and (code != 0 if command.startswith("show") else kind in REFUSALS):
        return f"exit {code}: refused a valid trace ({kind})"
    return None


# ---------------------------------------------------------------- running the CLI
def _alarm(signum, frame):
    raise CaseTimeout


def run_cli(args: list[str], timeout: float):
    """(exit code, stdout, stderr, problem or None) of one in-process CLI run."""
    runner = CliRunner()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        r = runner.invoke(cli_main, args, env={"GEMMA4_TRACE_DEBUG": "1"})
    except CaseTimeout:
        return None, "", "", f"no result after {timeout:.0f} s (hang)"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        tb = "".join(traceback.format_exception(*r.exc_info)) if r.exc_info else repr(r.exception)
        return r.exit_code, r.stdout, r.stderr, f"unhandled {type(r.exception).__name__}: {r.exception}\n{tb}"
    return r.exit_code, r.stdout, r.stderr, None


def check(command: str, code, out: str, err: str) -> str | None:
    if code not in ALLOWED[command]:
        return f"exit {code}, allowed {sorted(ALLOWED[command])}"
    text = out + err
    if "Traceback" in text:
        return "traceback in the output"
    if "internal error" in text:
        return "internal error (an exception we should have handled)"
    if code == 2:
        lines = err.splitlines()
        if len(lines) != 1 or not lines[0].startswith("error: ") or len(lines[0]) <= len("error: "):
            return f"exit 2 with stderr {err!r} (want exactly one line 'error: ...')"
        if out.strip():
            return f"exit 2 with stdout {out[:200]!r}"
    return None


def message_kind(err: str) -> str:
    for needle, label in MESSAGE_KINDS:
        if needle in err:
            return label
    return "other: " + err.strip()[:80]


def run_case(
    case: int,
    seed: int,
    goldens: dict[str, tuple[Path, Info]],
    bad: Path,
    timeout: float,
    talk: bool = False,
    keep: Path | None = None,
    on_event=None,
    only: str | None = None,
    watch: OutsideWatch | None = None,
    share: float = TOWER_SHARE,
) -> dict:
    """Corrupt a copy of a golden (`goldens`: "v1" and "v2", each a path and its Info) as case
    `case` of `seed` says, run every command on it, check each."""
    rng = np.random.default_rng([seed, case])  # each case reproducible alone: --seed S --case K
    which, picks = plan_case(seed, case, rng, only, share)
    ref, info = goldens[which]
    ENV["outside"] = ENV[f"outside_{which}"]  # a valid trace of the same version: following a link "works"
    picks, done = corrupt(ref, bad, rng, info, only, picks)
    expect, tower_only = expectation(picks, done), all(p in TOWER for p in picks)
    if watch is not None:
        watch.events()  # making the case touched nothing outside, but drain anyway
    if keep is not None:
        shutil.copyfile(bad, keep)
    if talk:
        print(f"case {case} ({which} golden): {'; '.join(done)}", flush=True)
    argv = {
        "show": ["show", str(bad)],
        "show --hash": ["show", "--hash", str(bad)],
        "diff GOLDEN CORRUPT": ["diff", str(ref), str(bad)],
        "diff CORRUPT GOLDEN": ["diff", str(bad), str(ref)],
    }
    results = []
    for command in COMMANDS:
        if on_event is not None:
            on_event({"begin": case, "command": command, "done": done, "golden": which})
        t0, rss0 = time.perf_counter(), peak_rss()
        code, out, err, problem = run_cli(argv[command], timeout)
        seconds = time.perf_counter() - t0
        problem = problem or check(command, code, out, err) or expect_problem(expect, tower_only, command, code, err)
        if CANARY[:20].decode() in out + err:
            problem = (problem or "") + " canary bytes in the output (read outside the file)"
        outside = sorted(set(watch.events())) if watch is not None else []
        kind = message_kind(err) if code == 2 and problem is None else None
        results.append(
            {
                "command": command,
                "code": code,
                "problem": problem,
                "message": kind,
                "seconds": seconds,
                "rss": peak_rss(),
                "rss_grew": peak_rss() > rss0,
                "outside": outside,
            }
        )
        if talk:
            print(
                f"    {command:<20} exit {code}  {ascii((err.strip() or out.strip()).splitlines()[:1])[:400]}"
                + (f"  FAIL: {problem}" if problem else ""),
                flush=True,
            )
    return {"case": case, "picks": picks, "done": done, "results": results, "golden": which, "expect": expect}


def add_case(rep: Report, seed: int, res: dict) -> None:
    rep.cases += 1
    rep.mutations.update(res["picks"])
    rep.goldens[res.get("golden", "v1")] += 1
    if res.get("expect"):
        rep.verdicts[res["expect"].strip(" []")] += 1
    for r in res["results"]:
        rep.outcomes[(r["command"], r["code"])] += 1
        where = f"case {res['case']} (--seed {seed} --case {res['case']}) [{'; '.join(res['done'])}] {r['command']}"
        if r["message"]:
            rep.messages[r["message"]] += 1
        if r["problem"]:
            rep.failures.append(f"{where}: {r['problem']}")
        rep.max_seconds = max(rep.max_seconds, r.get("seconds", 0.0))
        rep.max_rss = max(rep.max_rss, r.get("rss", 0))
        if r.get("seconds", 0.0) > SLOW_SECONDS:
            rep.slow.append(f"{where}: {r['seconds']:.1f} s")
        if r.get("rss", 0) > BIG_RSS and r.get("rss_grew"):  # this command raised the process's peak past it
            rep.big.append(f"{where}: peak RSS {r['rss'] >> 20} MiB")
        if r.get("outside"):
            rep.outside.append(f"{where}: opened {', '.join(r['outside'])}")
    rep.watch_ok = rep.watch_ok and res.get("watch_ok", True)


def fuzz(
    cases: int,
    seed: int,
    golden: Path = GOLDEN,
    timeout: float = 20.0,
    first: int = 0,
    talk: bool = False,
    keep: Path | None = None,
    on_event=None,
    only: str | None = None,
    deep_max: int = 20_000,
    tower_share: float = TOWER_SHARE,
) -> Report:
    """Run cases first..first+cases-1 in this process (what the test suite does)."""
    rep = Report()
    with (
        tempfile.TemporaryDirectory(prefix="trace-fuzz-") as tmp,
        tempfile.TemporaryDirectory(prefix="trace-fuzz-outside-") as outside_dir,
    ):
        ref, ref2, bad = Path(tmp) / "golden.h5", Path(tmp) / "golden-v2.h5", Path(tmp) / "corrupt.h5"
        shutil.copyfile(golden, ref)
        tower_golden(ref2)
        goldens = {"v1": (ref, golden_info(ref)), "v2": (ref2, golden_info(ref2))}
        # what hostile traces point at, in a folder of its own: nothing a clean run ever opens
        out = Path(outside_dir)
        ENV.update(canary=out / "canary.bin", outside_v1=out / "outside.h5", outside_v2=out / "outside-v2.h5")
        ENV.update(outside=ENV["outside_v1"], deep_max=deep_max)
        ENV["canary"].write_bytes(CANARY)
        shutil.copyfile(golden, ENV["outside_v1"])
        shutil.copyfile(ref2, ENV["outside_v2"])
        watch = OutsideWatch([outside_dir])
        rep.watch_ok = watch.ok
        t0 = time.perf_counter()
        for case in range(first, first + cases):
            res = run_case(case, seed, goldens, bad, timeout, talk, keep, on_event, only, watch, tower_share)
            res["watch_ok"] = watch.ok
            add_case(rep, seed, res)
            if on_event is not None:
                on_event({"result": res})
        rep.seconds = time.perf_counter() - t0
    return rep


# ---------------------------------------------------------------- isolation: crashes inside HDF5
def worker(
    seed: int,
    golden: Path,
    timeout: float,
    hang_after: float,
    start: int,
    stop: int,
    only: str | None = None,
    deep_max: int = 20_000,
    tower_share: float = TOWER_SHARE,
) -> int:
    """Run cases start..stop-1 here; report each command begun and each case finished as JSON lines."""
    out = sys.stdout
    sys.stdout = sys.stderr  # only the protocol on the real stdout
    faulthandler.enable()  # a crash prints the Python stack (to stderr, read by the supervisor)

    def event(msg):
        if "begin" in msg:  # HDF5 stuck in C code holds the GIL: only faulthandler's thread can end it
            faulthandler.dump_traceback_later(hang_after, exit=True)
        else:
            faulthandler.cancel_dump_traceback_later()
        out.write(json.dumps(msg) + "\n")
        out.flush()

    fuzz(
        stop - start,
        seed,
        golden,
        timeout,
        first=start,
        on_event=event,
        only=only,
        deep_max=deep_max,
        tower_share=tower_share,
    )
    faulthandler.cancel_dump_traceback_later()
    return 0


def _inside_hdf5(stderr: str) -> bool:
    """Whether the dumped stack's innermost frame is a call into h5py (so the process was in HDF5's C code)."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if "most recent call first" in line and i + 1 < len(lines):
            return "/h5py/" in lines[i + 1]
    return False


def supervise(
    cases: int,
    seed: int,
    golden: Path = GOLDEN,
    timeout: float = 20.0,
    jobs: int = 2,
    hang_after: float = 60.0,
    only: str | None = None,
    deep_max: int = 20_000,
    budget: float | None = None,
    tower_share: float = TOWER_SHARE,
) -> Report:
    """Run the cases in `jobs` worker processes. A worker that dies (a crash, or a hang that outlived
    `hang_after` seconds) ends its case: counted as a library defect when it died inside an h5py
    call, as a failure otherwise; a new worker resumes after that case."""
    rep = Report()
    lock = threading.Lock()
    bounds = np.linspace(0, cases, max(1, jobs) + 1).astype(int)
    deadline = None if budget is None else time.perf_counter() + budget

    def run_range(start: int, stop: int) -> None:
        while start < stop:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--seed",
                str(seed),
                "--golden",
                str(golden),
                "--timeout",
                str(timeout),
                "--hang-after",
                str(hang_after),
                "--start",
                str(start),
                "--stop",
                str(stop),
                "--deep-max",
                str(deep_max),
                "--tower-share",
                repr(tower_share),
            ] + (["--only", only] if only else [])
            with tempfile.TemporaryFile("w+") as err:
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
                begun = None
                for line in p.stdout:
                    if deadline is not None and time.perf_counter() > deadline:  # out of time: stop here
                        p.kill()
                        p.wait()
                        with lock:
                            rep.stopped = True
                        return
                    msg = json.loads(line)
                    if "begin" in msg:
                        begun = msg
                    else:
                        with lock:
                            add_case(rep, seed, msg["result"])
                        begun, start = None, msg["result"]["case"] + 1
                code = p.wait()
                if begun is None and code == 0:
                    return
                err.seek(0)
                dump = err.read()
            if begun is None:  # died between cases: our harness, not a case
                with lock:
                    rep.failures.append(f"worker for cases {start}..{stop - 1} died (exit {code}): {dump[-800:]}")
                return
            case, command, which = begun["begin"], begun["command"], begun.get("golden", "v1")
            hang = "Timeout (" in dump
            what = "hang" if hang else f"crash ({'signal ' + str(-code) if code < 0 else 'exit ' + str(code)})"
            top = [ln.strip() for ln in dump.splitlines() if ln.strip().startswith("File ")][:2]
            text = (
                f"case {case} (--seed {seed} --case {case}, {which} golden) [{'; '.join(begun['done'])}] {command}: "
                f"{what}; innermost frames: {' <- '.join(top)}"
            )
            with lock:
                rep.cases += 1
                rep.goldens[which] += 1
                rep.library_goldens[which] += _inside_hdf5(dump)
                rep.outcomes[(command, "hdf5 " + what.split()[0] if _inside_hdf5(dump) else what.split()[0])] += 1
                (rep.library if _inside_hdf5(dump) else rep.failures).append(text)
            start = case + 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run_range, args=(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rep.seconds = time.perf_counter() - t0
    return rep


def format_report(rep: Report, command_line: str) -> str:
    lines = [
        f"$ {command_line}",
        f"{rep.cases} cases in {rep.seconds:.1f} s ({rep.cases / max(rep.seconds, 1e-9):.1f} cases/s, "
        f"{len(COMMANDS)} commands each); failures: {len(rep.failures)}"
        + (" (stopped by --budget before the rest)" if rep.stopped else ""),
        "exit codes by command:",
    ]
    for command in COMMANDS:
        counts = {c: rep.outcomes[(command, c)] for c in (0, 1, 2)}
        other = Counter({str(c): n for (cmd, c), n in rep.outcomes.items() if cmd == command and c not in (0, 1, 2)})
        lines.append(
            f"  {command:<20} exit 0: {counts[0]:>5}  exit 1: {counts[1]:>5}  exit 2: {counts[2]:>5}"
            + "".join(f"  {'exit ' + c if c.lstrip('-').isdigit() else c}: {n}" for c, n in other.items())
        )
    lines.append(
        f"reads outside the file (inotify on the files hostile traces point at): "
        f"{len(rep.outside) if rep.watch_ok else 'NOT CHECKED (no inotify)'}"
    )
    lines.append(
        f"commands over {SLOW_SECONDS:.0f} s: {len(rep.slow)} (slowest {rep.max_seconds:.1f} s); "
        f"over {BIG_RSS >> 30} GiB RSS: {len(rep.big)} (peak {rep.max_rss / 2**20:.0f} MiB)"
    )
    by = ", ".join(f"{k} golden: {n}" for k, n in sorted(rep.library_goldens.items()) if n)
    lines.append(
        f"library defects (the process hung or crashed inside an HDF5 call; see docs/robustness.md): {len(rep.library)}"
        + (f" ({by})" if by else "")
    )
    lines.append("exit-2 messages by kind:")
    lines += [f"  {label:<26} {n:>5}" for label, n in rep.messages.most_common()]
    lines.append("corruptions applied: " + ", ".join(f"{k} {v}" for k, v in sorted(rep.mutations.items())))
    lines.append(
        f"cases from the version-2 golden: {rep.goldens['v2']} of {rep.cases}; tower cases with a verdict: "
        + (", ".join(f"{k} {v}" for k, v in sorted(rep.verdicts.items())) or "none")
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- trace import: hostile maps and dumps
# `--import-cases N` fuzzes `trace import` instead: each case builds a clean dump of the golden's own
# rows (npy, npz, safetensors, raw), applies one hostile class below and runs the import. Allowed:
# exit 0 or 2 (one line); a failure is anything else, 'internal error', canary bytes in the output
# text or in the trace it wrote, an open of the watched outside folder, a run over SLOW_SECONDS or
# BIG_RSS, or a dump file changed by the import.
IMPORT_STEPS = [(0, 13), (13, 14), (14, 15)]
IMPORT_MAP = """runtime = "fuzz"
[[tensor]]
kind = "embeddings"
file = "step{step:03d}/embeddings.npy"
[[tensor]]
kind = "per_layer_inputs"
file = "step{step:03d}/ple.npz"
key = "ple"
[[tensor]]
kind = "final_hidden"
file = "step{step:03d}/head.safetensors"
key = "final_hidden"
[[tensor]]
kind = "rope_cos_sliding"
file = "step{step:03d}/rope.bin"
dtype = "float32"
shape = ["n", 16]
[[tensor]]
kind = "mask"
file = "step{step:03d}/mask{layer}.npy"
layers = [0]
[[tensor]]
kind = "layer_out"
file = "pos{position:03d}/out{layer}.npy"
layers = [0]
"""
IMPORT_FILES = ("embeddings.npy", "ple.npz", "head.safetensors", "rope.bin", "mask0.npy")


def _safetensors_bytes(tensors: dict) -> bytes:
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + b"".join(blobs)


def build_dump(folder: Path) -> Path:
    """The golden's rows as a dump in four formats; IMPORT_MAP imports it to a valid trace."""
    from gemma4_trace.traces.reader import TraceReader

    with TraceReader(GOLDEN) as g:
        rows = {k: g.read(k) for k in ("embeddings", "per_layer_inputs", "final_hidden", "rope_cos_sliding")}
        mask, out = g.read("mask", 0), g.read("layer_out", 0)
    dump = folder / "dump"
    for s, (a, b) in enumerate(IMPORT_STEPS):
        d = dump / f"step{s:03d}"
        d.mkdir(parents=True)
        np.save(d / "embeddings.npy", rows["embeddings"][a:b])
        np.savez_compressed(d / "ple.npz", ple=rows["per_layer_inputs"][a:b])
        (d / "head.safetensors").write_bytes(_safetensors_bytes({"final_hidden": rows["final_hidden"][a:b]}))
        rows["rope_cos_sliding"][a:b].astype("<f4").tofile(d / "rope.bin")
        np.save(d / "mask0.npy", mask[a:b])
    for p in range(IMPORT_STEPS[-1][1]):
        (dump / f"pos{p:03d}").mkdir()
        np.save(dump / f"pos{p:03d}" / "out0.npy", out[p])
    (dump / "map.toml").write_text(IMPORT_MAP)
    return dump


def _pick_file(dump: Path, rng) -> Path:
    return dump / f"step{int(rng.integers(3)):03d}" / str(rng.choice(IMPORT_FILES))


def _set_file(text: str, kind: str, pattern: str) -> str:
    """The map with the file pattern of `kind`'s entry replaced."""
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("kind = "):
            current = line.split('"')[1]
        if line.startswith("file = ") and current == kind:
            line = "file = " + json.dumps(pattern)
        out.append(line)
    return "\n".join(out) + "\n"


def i_outside_pattern(dump, m, rng):
    target = str(
        rng.choice(
            [
                str(ENV["canary"]),
                str(ENV["rows"]),
                "../outside/rows.bin",
                "/etc/passwd",
                "/proc/self/environ",
                "step000/../../outside/rows.bin",
                "./step000/rope.bin",
                "step000//rope.bin",
                "/dev/zero",
                "{step}/../../outside/rows.bin",
            ]
        )
    )
    if target.startswith("../outside"):
        target = os.path.relpath(ENV["rows"], dump)
    return _set_file(m.read_text(), "rope_cos_sliding", target), f"file pattern {target}"


def i_link(dump, m, rng):
    """A dump file (or folder) replaced by a link leaving the dump."""
    if rng.random() < 0.5:
        victim = _pick_file(dump, rng)
        victim.unlink()
        target = ENV["rows"] if victim.name == "rope.bin" else ENV["canary"]
        victim.symlink_to(target)
        return None, f"link {victim.relative_to(dump)} -> {target.name}"
    victim = dump / f"step{int(rng.integers(3)):03d}"
    shutil.rmtree(victim)
    victim.symlink_to(ENV["canary"].parent, target_is_directory=True)
    return None, f"folder link {victim.name} -> outside"


def i_special(dump, m, rng):
    """A FIFO or a device where a dump file or the map should be."""
    how = int(rng.integers(4))
    if how == 0:
        victim = _pick_file(dump, rng)
        victim.unlink()
        os.mkfifo(victim)
        return None, f"fifo {victim.relative_to(dump)}"
    if how == 1:
        m.unlink()
        os.mkfifo(m)
        return None, "fifo map"
    if how == 2:
        return "MAP:/dev/zero", "map /dev/zero"
    victim = _pick_file(dump, rng)
    victim.unlink()
    victim.symlink_to("/dev/zero")
    return None, f"link {victim.relative_to(dump)} -> /dev/zero"


def i_pattern(dump, m, rng):
    """Hostile format fields in a file or key pattern."""
    bad = str(
        rng.choice(
            [
                "{step:>2000000000}",
                "{step:{n}}",
                "{kind[99]}",
                "{step.real}",
                "{step!r}",
                "{0}",
                "{}",
                "{",
                "}",
                "{layer:0999999d}",
                "{position:,}",
                "{kind:>99999999}",
                "{step:.5f}",
                "\0",
            ]
        )
    )
    text = m.read_text()
    if rng.random() < 0.5:
        return text.replace('key = "ple"', f'key = "ple{bad}"'), f"key pattern ple{bad!r}"
    return text.replace("embeddings.npy", f"embeddings{bad}.npy"), f"file pattern embeddings{bad!r}"


def _npy_header(path: Path, header: str, data: bytes = b"") -> None:
    h = header.encode("latin1")
    h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data)


def i_npy(dump, m, rng):
    victim = dump / f"step{int(rng.integers(3)):03d}" / str(rng.choice(["embeddings.npy", "mask0.npy"]))
    shape = str(
        rng.choice(
            [
                "(-13, 64)",
                "(1e400, 64)",
                "(13, 1099511627776)",
                f"({2**62}, {2**62})",
                "(13, 67108864)",
                "(" * 2000 + ")" * 2000,
                "'x'",
                "(13, 64, 1, 1, 1)",
                "(13,)",
                "()",
                "(13, -1)",
            ]
        )
    )
    descr = str(rng.choice(["'<f4'", "'|b1'", "'>f4'", "'|O'", "[('a', '<f4')]", "'<c8'", "'<U3'", "'<f2'"]))
    if shape == "(13, 67108864)" and rng.random() < 0.5:  # a sparse file that really has the bytes
        _npy_header(victim, f"{{'descr': '|b1', 'fortran_order': False, 'shape': {shape}, }}")
        with open(victim, "r+b") as fh:
            fh.truncate(victim.stat().st_size + 13 * 67108864)
        return None, f"npy {victim.name} sparse {shape}"
    _npy_header(
        victim,
        f"{{'descr': {descr}, 'fortran_order': {bool(rng.integers(2))}, 'shape': {shape}, }}",
        bytes(int(rng.choice([0, 64, 3328]))),
    )
    return None, f"npy header {victim.name} {descr} {shape[:20]}"


def i_npz(dump, m, rng):
    import zipfile

    victim = dump / f"step{int(rng.integers(3)):03d}" / "ple.npz"
    how = int(rng.integers(5))
    if how == 0:  # a member named without .npy
        with zipfile.ZipFile(victim, "w") as z:
            z.writestr("ple", b"data")
        return None, "npz member without .npy"
    if how == 1:  # a bomb: a huge declared array of compressed zeros, right or wrong row width
        wide = rng.random() < 0.5
        shape = (13, 8, 8 << int(rng.integers(10, 20))) if wide else (1 << int(rng.integers(18, 26)), 8, 8)
        header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}".encode()
        header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
        with zipfile.ZipFile(victim, "w", zipfile.ZIP_DEFLATED) as z, z.open("ple.npy", "w", force_zip64=True) as w:
            w.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
            chunk = bytes(1 << 20)
            for _ in range(64):  # 64 MiB inflated, ~64 KiB stored; the header declares more
                w.write(chunk)
        return None, f"npz bomb {shape}"
    data = bytearray(victim.read_bytes())
    if how == 2:  # sizes that lie (local header and central directory)
        for sig, off in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
            i = data.find(sig)
            if i >= 0:
                data[i + off : i + off + 4] = int(rng.choice([1, 100, 2**31, 2**32 - 1])).to_bytes(4, "little")
    elif how == 3:
        for _ in range(int(rng.integers(1, 9))):
            data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    else:
        data = data[: int(rng.integers(len(data)))]
    victim.write_bytes(bytes(data))
    return None, f"npz damage {how}"


def i_safetensors(dump, m, rng):
    victim = dump / f"step{int(rng.integers(3)):03d}" / "head.safetensors"
    how = int(rng.integers(6))
    if how == 0:
        h = b"[" * 100000 + b"]" * 100000
        victim.write_bytes(len(h).to_bytes(8, "little") + h)
    elif how == 1:  # a header length past the file, or huge
        victim.write_bytes(int(rng.choice([2**63, 2**40, 1 << 30])).to_bytes(8, "little") + b"{}")
    else:
        entry = {"dtype": "F32", "shape": [13, 64], "data_offsets": [0, 3328]}
        field_, value = [
            ("shape", [1e400, 64]),
            ("shape", [-13, 64]),
            ("shape", [2**62, 2**62]),
            ("data_offsets", [0, 2**62]),
            ("dtype", ["F32"]),
            ("shape", "13"),
            ("data_offsets", [5, 1]),
            ("shape", [13, 1 << 26]),
        ][int(rng.integers(8))]
        entry[field_] = value
        h = json.dumps({"final_hidden": entry}).encode()
        victim.write_bytes(len(h).to_bytes(8, "little") + h + bytes(3328))
        return None, f"safetensors {field_} = {str(value)[:30]}"
    return None, f"safetensors header {how}"


def i_raw(dump, m, rng):
    """A raw buffer far longer than the rows taken (sparse), or a shape that does not fit its size."""
    text = m.read_text()
    rows = int(rng.choice([1 << 20, 1 << 24, 1 << 40]))
    if rows <= 1 << 24:
        for s in range(3):
            with open(dump / f"step{s:03d}" / "rope.bin", "r+b") as fh:
                fh.truncate(rows * 16 * 4)
    return text.replace('shape = ["n", 16]', f'shape = [{rows}, 16]\nrows = "padded"'), f"raw {rows} rows padded"


def i_map(dump, m, rng):
    """Hostile map text: nesting, size, values of the wrong type."""
    how = int(rng.integers(5))
    text = m.read_text()
    if how == 0:
        return "x = " + "[" * 100000 + "]" * 100000 + "\n", "map nested 100000 deep"
    if how == 1:
        return text + "#" * (2 << 20) + "\n", "map of 2 MiB"
    if how == 2:
        key = str(
            rng.choice(["kind", "format", "dtype", "rows", "values", "byteorder", "layers", "axes", "shape", "key"])
        )
        value = str(rng.choice(['["q"]', "{a = 1}", "1e400", "-1", "9223372036854775807", '"\\u0000"', "[[]]", "nan"]))
        lines = text.splitlines()
        i = [j for j, ln in enumerate(lines) if ln.startswith("file = ")][int(rng.integers(6))]
        lines.insert(i + 1, f"{key} = {value}")
        out = [ln for k, ln in enumerate(lines) if not (k == i + 2 and ln.startswith(key + " = "))]
        return "\n".join(out) + "\n", f"map {key} = {value}"
    if how == 3:
        return text.replace("[[tensor]]", "[[tensor]]\nlayers = " + str(list(range(100000))), 1), "map layers x 100000"
    return "steps = " + str(int(rng.choice([0, 10**18, 4]))) + "\n" + text, "map steps"


def i_force_over_input(dump, m, rng):
    victim = _pick_file(dump, rng)
    return f"OUT:{victim}", f"-o {victim.relative_to(dump)} --force"


IMPORT = {
    "import_outside_pattern": i_outside_pattern,
    "import_link": i_link,
    "import_special": i_special,
    "import_pattern": i_pattern,
    "import_npy": i_npy,
    "import_npz": i_npz,
    "import_safetensors": i_safetensors,
    "import_raw": i_raw,
    "import_map": i_map,
    "import_force_over_input": i_force_over_input,
}


def _tree_digest(folder: Path) -> dict:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p)] = p.stat().st_mtime_ns, p.stat().st_size
    return out


def _case_record(case, pick, done, watch, command, code, se, problem, seconds, rss0, outside) -> dict:
    """One in-process case's record, as the supervisor's worker results are shaped."""
    return {
        "case": case,
        "picks": [pick],
        "done": [done],
        "watch_ok": watch is None or watch.ok,
        "results": [
            {
                "command": command,
                "code": code,
                "problem": problem,
                "message": (se.strip()[7:60] if code == 2 and problem is None else None),
                "seconds": seconds,
                "rss": peak_rss(),
                "rss_grew": peak_rss() > rss0,
                "outside": outside,
            }
        ],
    }


def run_import_case(
    case: int,
    seed: int,
    work: Path,
    timeout: float,
    watch: OutsideWatch | None = None,
    only: str | None = None,
    talk: bool = False,
) -> dict:
    rng = np.random.default_rng([seed, case, 18])
    pick = only or str(rng.choice(list(IMPORT)))
    folder = work / f"case{case}"
    dump = build_dump(folder)
    m = dump / "map.toml"
    text, done = IMPORT[pick](dump, m, rng)
    map_arg, out = m, folder / "imp.h5"
    if text and text.startswith("MAP:"):
        map_arg = Path(text[4:])
    elif text and text.startswith("OUT:"):
        out = Path(text[4:])
    elif text is not None:
        m.write_text(text)
    before = _tree_digest(dump)
    if watch is not None:
        watch.events()
    argv = ["import", str(dump), "--reference", str(GOLDEN), "--map", str(map_arg), "-o", str(out), "--force"]
    t0, rss0 = time.perf_counter(), peak_rss()
    code, so, se, problem = run_cli(argv, timeout)
    seconds = time.perf_counter() - t0
    problem = problem or check("show", code, so, se)  # exit 0 or 2, one line
    if CANARY[:20].decode() in so + se:
        problem = (problem or "") + " canary bytes in the output (read outside the dump)"
    if out.is_file() and not out.is_symlink() and CANARY[:20] in out.read_bytes():
        problem = (problem or "") + " canary bytes in the trace written (read outside the dump)"
    if _tree_digest(dump) != before:
        problem = (problem or "") + " a dump file was changed"
    outside = sorted(set(watch.events())) if watch is not None else []
    if talk:
        print(
            f"case {case}: {pick}: {done}\n    exit {code} {(se.strip() or so.strip())[:200]}"
            + (f"  FAIL: {problem}" if problem else ""),
            flush=True,
        )
    shutil.rmtree(folder, ignore_errors=True)
    return _case_record(case, pick, done, watch, "import", code, se, problem, seconds, rss0, outside)


def fuzz_import(
    cases: int,
    seed: int,
    timeout: float = 60.0,
    only: str | None = None,
    talk: bool = False,
    budget: float | None = None,
) -> Report:
    """Run import cases 0..cases-1 in this process (a FIFO open is ended by the case's alarm)."""
    rep = Report()
    with (
        tempfile.TemporaryDirectory(prefix="trace-fuzz-import-") as tmp,
        tempfile.TemporaryDirectory(prefix="trace-fuzz-outside-") as outside_dir,
    ):
        ENV.update(
            canary=Path(outside_dir) / "canary.bin",
            rows=Path(outside_dir) / "rows.bin",
            outside=Path(outside_dir) / "outside.h5",
        )
        ENV["canary"].write_bytes(CANARY)
        ENV["rows"].write_bytes((CANARY * 4)[: 13 * 16 * 4])  # the size of rope.bin's step-0 rows
        watch = OutsideWatch([outside_dir])
        rep.watch_ok = watch.ok
        t0 = time.perf_counter()
        for case in range(cases):
            if budget is not None and time.perf_counter() - t0 > budget:
                rep.stopped = True
                break
            add_case(rep, seed, run_import_case(case, seed, Path(tmp), timeout, watch, only, talk))
        rep.seconds = time.perf_counter() - t0
    return rep


def format_import_report(rep: Report, command_line: str) -> str:
    codes = Counter({c: n for (_cmd, c), n in rep.outcomes.items()})
    return "\n".join(
        [
            f"$ {command_line}",
            f"{rep.cases} import cases in {rep.seconds:.1f} s; failures: {len(rep.failures)}"
            + (" (stopped by --budget before the rest)" if rep.stopped else ""),
            "exit codes: " + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items(), key=str)),
            f"reads outside the dump (inotify on the files hostile maps point at): "
            f"{len(rep.outside) if rep.watch_ok else 'NOT CHECKED (no inotify)'}",
            f"runs over {SLOW_SECONDS:.0f} s: {len(rep.slow)} (slowest {rep.max_seconds:.1f} s); "
            f"over {BIG_RSS >> 30} GiB RSS: {len(rep.big)} (peak {rep.max_rss / 2**20:.0f} MiB)",
            "classes: " + ", ".join(f"{k} {v}" for k, v in sorted(rep.mutations.items())),
        ]
    )


# ---------------------------------------------------------------- tolerance files and generated names
# `--tolerance-cases N` fuzzes the tolerance surfaces instead. Classes tol_*: a crafted tolerances
# file (or a link, FIFO, device or folder in its place) passed to `trace diff GOLDEN COPY
# --tolerances FILE`: exit 0, 1 or 2 (one line). calibrate_name: `trace calibrate REF BASE -o OUT`
# where REF's or BASE's file name holds newlines, quotes, TOML syntax or terminal escapes: exit 0,
# and OUT must load and resolve to the same thresholds as a calibration from plain names. Both: no
# 'internal error', no raw control character in the output, no run over SLOW_SECONDS or BIG_RSS, no
# open of the watched outside folder.
ALLOWED.update({"diff --tolerances": {0, 1, 2}, "calibrate": {0}})
TOL_VALID = '[[rule]]\nkind = "layer_out"\nrel_l2 = 0.001\n'


def _tol_limits():
    from gemma4_trace.diff import tolerances as T

    return T


def t_huge(folder, rng):
    """Files at and past the size limit: sparse 2 GiB, a comment or a string just over or under."""
    T = _tol_limits()
    p, how = folder / "tol.toml", int(rng.integers(4))
    if how == 0:
        with open(p, "wb") as fh:
            fh.truncate(2 << 30)
        return p, "sparse 2 GiB file"
    size = T.MAX_FILE_BYTES + (1 if how in (1, 3) else -64)
    if how == 3:
        p.write_text(TOL_VALID + 'note = "' + "a" * (size - len(TOL_VALID) - 10) + '"\n')
        return p, f"a note string in {p.stat().st_size} bytes"
    p.write_text(TOL_VALID + "#" * (size - len(TOL_VALID) - 1) + "\n")
    return p, f"a comment in {p.stat().st_size} bytes"


def t_rules(folder, rng):
    """Many rules, at, past and far past MAX_RULES, each matching every tensor."""
    T = _tol_limits()
    n = int(rng.choice([T.MAX_RULES, T.MAX_RULES + 1, 100_000]))
    rule = str(rng.choice(['kind = "*"\nrel_l2 = 0.001', 'layer = "0-3"\nstep = "decode"\nskip = true', "max_abs = 1"]))
    p = folder / "tol.toml"
    p.write_text(f"[[rule]]\n{rule}\n" * n)
    return p, f"{n} rules ({rule.splitlines()[0]})"


def t_alternatives(folder, rng):
    """Comma-separated pattern alternatives: many, wide ranges, long globs, spread over rules."""
    T = _tol_limits()
    how = int(rng.integers(5))
    p = folder / "tol.toml"
    if how == 0:
        n = int(rng.choice([T.MAX_ALTERNATIVES, T.MAX_ALTERNATIVES + 1, 40_000, 100_000]))
        p.write_text(
            f'[[rule]]\nkind = "{",".join(["embeddings", "layer_*", "q"] * (n // 3 + 1))[: n * 4]}"\nrel_l2 = 0.01\n'
        )
        return p, f"kind with ~{n} alternatives"
    if how == 1:
        n = int(rng.choice([T.MAX_ALTERNATIVES, 40_000]))
        p.write_text(f'[[rule]]\nlayer = "{",".join(str(i) for i in range(n))}"\nrel_l2 = 0.01\n')
        return p, f"layer with {n} alternatives"
    if how == 2:
        rng_ = str(rng.choice(["0-1000000000000", "0-" + "9" * 5000, "5-2", "-1", "0-", "decode,prefill," * 500]))
        p.write_text(f'[[rule]]\nstep = "{rng_}"\nrel_l2 = 0.01\n')
        return p, f"step {rng_[:30]!r}"
    if how == 3:
        glob = str(rng.choice(["*" * 100_000, "?" * 100_000, "[" * 10_000, "[!a-z]" * 10_000, "*a" * 50_000]))
        p.write_text(f'[[rule]]\nkind = "{glob}"\nrel_l2 = 0.01\n')
        return p, f"glob {glob[:12]!r}... ({len(glob)} chars)"
    p.write_text('[[rule]]\nkind = "q,k,v,layer_out,embeddings,mask,logits,token,attn_out"\nrel_l2 = 0.01\n' * 2000)
    return p, "2000 rules x 9 alternatives"


def t_nesting(folder, rng):
    """Arrays, inline tables, dotted keys and table headers nested deep."""
    n = int(rng.choice([1000, 100_000]))
    how = int(rng.integers(5))
    p = folder / "tol.toml"
    texts = [
        "x = " + "[" * n + "]" * n,
        "rule = [" + "{a = " * n + "1" + "}" * n + "]",
        "[tokens]\nnear_tie_margin = " + "[" * n + "]" * n,
        "a" + ".a" * n + " = 1",
        "[" + ".".join(["rule"] * n) + "]",
    ]
    p.write_text(texts[how] + "\n")
    return p, f"nesting {n} deep ({['array', 'inline table', 'margin array', 'dotted key', 'table header'][how]})"


def t_numbers(folder, rng):
    """Non-finite, huge, tiny, negative and malformed numbers in every numeric field."""
    T = _tol_limits()
    value = str(
        rng.choice(
            ["inf", "-inf", "nan", "+nan", "1e400", "-1e400", "1e308", "-0.0", "0", "5e-324", "-1"]
            + ["9223372036854775807", "-9223372036854775808", "1" + "0" * 5000, "0x7fffffffffffffff", "1_000", "0b1"]
        )
    )
    if rng.random() < 0.2:
        p = folder / "tol.toml"
        p.write_text(f"[tokens]\nnear_tie_margin = {value}\naccept_near_ties = true\n")
        return p, f"near_tie_margin = {value[:30]}"
    key = str(rng.choice(list(T.THRESHOLD_FIELDS)))
    p = folder / "tol.toml"
    p.write_text(f'[[rule]]\nkind = "*"\n{key} = {value}\n')
    return p, f"{key} = {value[:30]}"


def t_types(folder, rng):
    """Values of the wrong TOML type for every key, at the top level, in a rule and in [tokens]."""
    T = _tol_limits()
    value = str(
        rng.choice(
            ['"x"', '[1, "a"]', "{a = 1}", "1979-05-27T07:32:00Z", "07:32:00", "1979-05-27", "true", "[]", "{}"]
            + ["-1", '""', '"\\u0000"', "1.5", '["*"]', "[[1]]"]
        )
    )
    where = int(rng.integers(3))
    p = folder / "tol.toml"
    if where == 0:
        key = str(rng.choice(["rule", "tokens", "version"]))
        p.write_text(f"{key} = {value}\n")
    elif where == 1:
        key = str(rng.choice(list(T.RULE_FIELDS)))
        p.write_text(
            f"[[rule]]\nrel_l2 = 0.01\n{key} = {value}\n" if key != "rel_l2" else f"[[rule]]\n{key} = {value}\n"
        )
    else:
        key = str(rng.choice(list(T.TOKEN_FIELDS)))
        p.write_text(f"[tokens]\n{key} = {value}\n")
    return p, f"{key} = {value}"


def t_control(folder, rng):
    """Control characters, escapes, invalid UTF-8 and odd line ends, raw in the file or in strings."""
    how = int(rng.integers(8))
    p = folder / "tol.toml"
    datas = [
        b'[[rule]]\nkind = "\\u001b[2J\\u001b]0;pwned\\u0007embeddings"\nrel_l2 = 0.01\n',  # ESC in a kind (echoed)
        b'[[rule]]\nkind = "layer_out"\nrel_l2 = 0.01 \x1b[2J\n',  # raw ESC
        b'[[rule]]\nkind = "layer\x00out"\nrel_l2 = 0.01\n',  # raw NUL
        b'[[rule]]\r\nkind = "layer_out"\rrel_l2 = 0.01\r',  # lone CR
        b'\xef\xbb\xbf[[rule]]\nkind = "layer_out"\nrel_l2 = 0.01\n',  # BOM
        b'[[rule]]\nkind = "\xff\xfe"\nrel_l2 = 0.01\n',  # invalid UTF-8
        '[[rule]]\nkind = "q\u2028\u202ek"\nrel_l2 = 0.01\n'.encode(),  # line separator, RTL override
        b'[[rule]]\nkind = "' + b"\\u009b" * 100_000 + b'"\nrel_l2 = 0.01\n',  # 100,000 C1 CSI
    ]
    p.write_bytes(datas[how])
    return p, f"control characters, form {how}"


def t_special(folder, rng):
    """A FIFO, a device, a folder or a dangling or looping link as the tolerances file."""
    how = int(rng.integers(7))
    p = folder / "tol.toml"
    if how == 0:
        os.mkfifo(p)
        return p, "fifo"
    if how == 1:
        return Path("/dev/zero"), "/dev/zero"
    if how == 2:
        p.symlink_to("/dev/zero")
        return p, "link to /dev/zero"
    if how == 3:
        p.mkdir()
        return p, "folder"
    if how == 4:
        p.symlink_to(folder / "missing.toml")
        return p, "dangling link"
    if how == 5:
        p.symlink_to(p)
        return p, "link to itself"
    return Path("/dev/null"), "/dev/null (empty: the defaults)"


TOLERANCE = {
    "tol_huge": t_huge,
    "tol_rules": t_rules,
    "tol_alternatives": t_alternatives,
    "tol_nesting": t_nesting,
    "tol_numbers": t_numbers,
    "tol_types": t_types,
    "tol_control": t_control,
    "tol_special": t_special,
}
HOSTILE_NAMES = (
    "b\ntokens = {accept_near_ties = true, near_tie_margin = 1e308}\n.h5",
    'b"; x = 1 #.h5',
    "b'''\n[[rule]]\nkind = \"*\"\nskip = true\n'''.h5",
    'b"""\n[tokens]\naccept_near_ties = true\n""".h5',
    "b\x1b[2J\x1b]0;pwned\x07.h5",
    "b\r[tokens]\raccept_near_ties = true.h5",
    "b\u2028[tokens]\u2029accept_near_ties = true\u0085.h5",
    "b\\u000a[tokens]\\n.h5",
    "b\x7f\x01\x1f\x9b.h5",
    "b\udcff\udcfe.h5",  # bytes that are not UTF-8
    ("\"\n[[rule]]\nkind = '*'\nskip = true\n" * 5)[:200] + ".h5",
)


def _fingerprint(path) -> list:
    """What a tolerances file means: every threshold, floor and skip it resolves to, per kind, layer
    (and none), precision and step."""
    T = _tol_limits()
    from gemma4_trace.traces import schema as S

    tol = T.load_tolerances(path)
    out: list = [tol.near_tie_margin, tol.accept_near_ties, len(tol.rules)]
    for kind in S.ALL_KIND_KEYS:  # every tower's kinds (a rule may name vision.layer_out)
        for layer in (None, *range(8)):
            for prec in sorted(T.DEFAULTS):
                st = tol.resolve(kind, layer, prec, 4)
                out.append([{f: v.tolist() for f, v in st.limits.items()}, st.l2_floor.tolist(), st.skip.tolist()])
    return out


def _plain_calibration(work: Path, n_bases: int) -> list:
    key = ("plain", n_bases)
    if key not in ENV:
        d = work / f"plain{n_bases}"
        d.mkdir(exist_ok=True)
        bases = []
        for i in range(n_bases):
            bases.append(d / f"base{i}.h5")
            shutil.copyfile(GOLDEN, bases[-1])
        code, so, se, problem = run_cli(["calibrate", str(GOLDEN), *map(str, bases), "-o", str(d / "t.toml")], 60)
        if code != 0:
            raise RuntimeError(f"plain calibration failed: exit {code} {se} {problem}")
        ENV[key] = _fingerprint(d / "t.toml")
    return ENV[key]


def calibrate_case(folder: Path, rng, work: Path):
    """(argv, what it did, check of the result): REF and BASE copies under hostile names."""
    names = [str(n) for n in rng.choice(HOSTILE_NAMES, size=3)]
    n_bases = int(rng.integers(1, 3))
    ref = folder / ("r" + names[0] if rng.random() < 0.5 else "ref.h5")
    shutil.copyfile(GOLDEN, ref)
    bases = []
    for i in range(n_bases):
        d = folder / f"b{i}"
        d.mkdir()
        bases.append(d / names[1 + i])
        shutil.copyfile(GOLDEN, bases[-1])
    out = folder / ("o" + names[2] if rng.random() < 0.3 else "tol.toml")
    plain = _plain_calibration(work, n_bases)

    def verify(code) -> str | None:
        if code != 0:
            return None  # check() reports the exit
        try:
            got = _fingerprint(out)
        except Exception as e:  # noqa: BLE001 -- the written file must load
            return f"the written TOML does not load: {e}"
        return None if got == plain else "the written TOML gives other tolerances than a plain name's"

    argv = ["calibrate", str(ref), *map(str, bases), "-o", str(out)]
    return argv, f"names {ascii([ref.name, *(b.name for b in bases), out.name])[:120]}", verify


def _raw_control(text: str) -> bool:
    return any((ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0 for c in text)


def run_tolerance_case(
    case: int,
    seed: int,
    work: Path,
    timeout: float,
    watch: OutsideWatch | None = None,
    only: str | None = None,
    talk: bool = False,
) -> dict:
    rng = np.random.default_rng([seed, case, 1818])
    pick = only or str(rng.choice([*TOLERANCE, "calibrate_name"]))
    folder = work / f"case{case}"
    folder.mkdir()
    if pick == "calibrate_name":
        command = "calibrate"
        argv, done, verify = calibrate_case(folder, rng, work)
    else:
        command, verify = "diff --tolerances", None
        run = folder / "run.h5"
        shutil.copyfile(GOLDEN, run)
        tol, done = TOLERANCE[pick](folder, rng)
        argv = ["diff", str(GOLDEN), str(run), "--tolerances", str(tol)]
    if watch is not None:
        watch.events()
    t0, rss0 = time.perf_counter(), peak_rss()
    code, so, se, problem = run_cli(argv, timeout)
    seconds = time.perf_counter() - t0
    problem = problem or check(command, code, so, se)
    if problem is None and _raw_control(so + se):
        problem = "a raw control character in the output"
    if problem is None and command == "calibrate" and len(so.splitlines()) != 1:
        problem = f"calibrate printed {len(so.splitlines())} lines, not one (a file name's newline printed raw)"
    if problem is None and verify is not None:
        problem = verify(code)
    outside = sorted(set(watch.events())) if watch is not None else []
    if talk:
        print(
            f"case {case}: {pick}: {done}\n    exit {code} {ascii((se.strip() or so.strip())[:200])}"
            + (f"  FAIL: {problem}" if problem else ""),
            flush=True,
        )
    shutil.rmtree(folder, ignore_errors=True)
    return _case_record(case, pick, done, watch, command, code, se, problem, seconds, rss0, outside)


def fuzz_tolerances(
    cases: int,
    seed: int,
    timeout: float = 60.0,
    only: str | None = None,
    talk: bool = False,
    budget: float | None = None,
) -> Report:
    """Run tolerance cases 0..cases-1 in this process (a FIFO open would be ended by the case's alarm).
    The outside folder holds a canary no case names: any open of it is a read outside the inputs."""
    import resource

    rep = Report()
    # a parse that grows without bound ends in MemoryError (a failure) instead of taking the machine
    old_as = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + (3 << 30)
    if old_as[1] != resource.RLIM_INFINITY:
        cap = min(cap, old_as[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, old_as[1]))
    try:
        _run_tolerance_cases(rep, cases, seed, timeout, only, talk, budget)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old_as)
    return rep


def _run_tolerance_cases(rep: Report, cases, seed, timeout, only, talk, budget) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="trace-fuzz-tolerances-") as tmp,
        tempfile.TemporaryDirectory(prefix="trace-fuzz-outside-") as outside_dir,
    ):
        (Path(outside_dir) / "canary.toml").write_bytes(CANARY)
        watch = OutsideWatch([outside_dir])
        rep.watch_ok = watch.ok
        t0 = time.perf_counter()
        for case in range(cases):
            if budget is not None and time.perf_counter() - t0 > budget:
                rep.stopped = True
                break
            add_case(rep, seed, run_tolerance_case(case, seed, Path(tmp), timeout, watch, only, talk))
            gc.collect()  # a parse that ran into the cap holds its memory in a traceback's frames
        rep.seconds = time.perf_counter() - t0
        for key in [k for k in ENV if isinstance(k, tuple)]:  # plain calibrations lived in tmp
            del ENV[key]


def _vm_size() -> int:
    """This process's virtual size in bytes (Linux), 0 where unknown."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(ln.split()[1]) << 10 for ln in fh if ln.startswith("VmSize:"))
    except (OSError, StopIteration):
        return 0


def format_tolerance_report(rep: Report, command_line: str) -> str:
    codes = Counter()
    for (cmd, c), n in rep.outcomes.items():
        codes[f"{cmd.split()[0]} {c}"] += n
    return "\n".join(
        [
            f"$ {command_line}",
            f"{rep.cases} tolerance cases in {rep.seconds:.1f} s; failures: {len(rep.failures)}"
            + (" (stopped by --budget before the rest)" if rep.stopped else ""),
            "exit codes: " + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())),
            f"reads outside the inputs (inotify on a canary folder): "
            f"{len(rep.outside) if rep.watch_ok else 'NOT CHECKED (no inotify)'}",
            f"runs over {SLOW_SECONDS:.0f} s: {len(rep.slow)} (slowest {rep.max_seconds:.1f} s); "
            f"over {BIG_RSS >> 30} GiB RSS: {len(rep.big)} (peak {rep.max_rss / 2**20:.0f} MiB)",
            "classes: " + ", ".join(f"{k} {v}" for k, v in sorted(rep.mutations.items())),
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--golden", type=Path, default=GOLDEN)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds a command may run (Python-level alarm)")
    ap.add_argument(
        "--hang-after",
        type=float,
        default=60.0,
        help="seconds after which a command stuck in C code ends its worker process",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--case", type=int, default=None, help="run only this case, in this process, and describe it")
    ap.add_argument("--keep", type=Path, default=None, help="with --case: copy the corrupted file here")
    ap.add_argument("--show-failures", type=int, default=10, help="print at most this many failures")
    ap.add_argument("--only", choices=ALL, default=None, help="apply only this corruption class (one per case)")
    ap.add_argument("--deep-max", type=int, default=20_000, help="deepest group nesting the 'deep' class makes")
    ap.add_argument(
        "--tower-share",
        type=float,
        default=TOWER_SHARE,
        help="share of the cases that start from the version-2 golden (0: every case as before towers)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds: stop starting cases after this and report the cases run (a shared machine)",
    )
    ap.add_argument(
        "--import-cases",
        type=int,
        default=None,
        help="fuzz `trace import` with this many hostile maps and dumps instead (in this process)",
    )
    ap.add_argument("--import-only", choices=list(IMPORT), default=None, help="with --import-cases: only this class")
    ap.add_argument(
        "--tolerance-cases",
        type=int,
        default=None,
        help="fuzz tolerance files (`trace diff --tolerances`) and calibrate's file names instead (in this process)",
    )
    ap.add_argument(
        "--tolerance-only",
        choices=[*TOLERANCE, "calibrate_name"],
        default=None,
        help="with --tolerance-cases: only this class",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.import_cases is not None:
        rep = fuzz_import(
            args.import_cases,
            args.seed,
            max(args.timeout, SLOW_SECONDS),
            args.import_only,
            talk=args.case is not None,
            budget=args.budget,
        )
        print(format_import_report(rep, " ".join(["python scripts/fuzz_traces.py", *(argv or sys.argv[1:])])))
        for line in (rep.failures + rep.outside + rep.slow + rep.big)[: args.show_failures]:
            print("FAIL " + line)
        return 1 if rep.failures or rep.outside or rep.slow or rep.big or not rep.watch_ok else 0
    if args.tolerance_cases is not None:
        rep = fuzz_tolerances(
            args.tolerance_cases,
            args.seed,
            max(args.timeout, SLOW_SECONDS),
            args.tolerance_only,
            talk=args.case is not None,
            budget=args.budget,
        )
        print(format_tolerance_report(rep, " ".join(["python scripts/fuzz_traces.py", *(argv or sys.argv[1:])])))
        for line in (rep.failures + rep.outside + rep.slow + rep.big)[: args.show_failures]:
            print("FAIL " + ascii(line)[1:-1])
        return 1 if rep.failures or rep.outside or rep.slow or rep.big or not rep.watch_ok else 0
    if args.worker:
        return worker(
            args.seed,
            args.golden,
            args.timeout,
            args.hang_after,
            args.start,
            args.stop,
            args.only,
            args.deep_max,
            args.tower_share,
        )
    if args.case is not None:
        faulthandler.enable()
        faulthandler.dump_traceback_later(args.hang_after, exit=True)
        rep = fuzz(
            1,
            args.seed,
            args.golden,
            args.timeout,
            first=args.case,
            talk=True,
            keep=args.keep,
            only=args.only,
            deep_max=args.deep_max,
            tower_share=args.tower_share,
        )
    else:
        rep = supervise(
            args.cases,
            args.seed,
            args.golden,
            args.timeout,
            args.jobs,
            args.hang_after,
            args.only,
            args.deep_max,
            args.budget,
            args.tower_share,
        )
    shown = " ".join(["python scripts/fuzz_traces.py", *(argv if argv is not None else sys.argv[1:])])
    print(format_report(rep, shown))
    for line in rep.library[: args.show_failures]:
        print("HDF5 " + line)
    for fail in rep.failures[: args.show_failures]:
        print("FAIL " + fail)
    for line in (rep.outside + rep.slow + rep.big)[: args.show_failures]:
        print("FAIL " + line)
    return 1 if rep.failures or rep.outside or rep.slow or rep.big or not rep.watch_ok else 0


if __name__ == "__main__":
    sys.exit(main())
