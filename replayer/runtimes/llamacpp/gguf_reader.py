"""A user's GGUF file, read as untrusted input: `trace replay REF --gguf FILE` and
`trace replay REF --runtime static --weights-from FILE.gguf` (extra `llamacpp`).

`read_header` parses the header itself, every size bounded before it is used: the counts of
keys and tensors, string and array lengths (each no larger than the bytes left in the file),
tensor ranks, dims and types, and every tensor's data range (aligned, inside the file, not
overlapping another). Only then does anything else (gguf's dequantizers, llama.cpp) read
the file. Anything malformed is one line naming the file.

`config_differences` compares the file's metadata with what the project's writer would write
for REF's model (replayer/gguf_writer.py): layers, widths, head dims, window, RoPE bases,
softcap, KV sharing, vocab, per-layer-input width. `load_weights` writes the file's tensors,
dequantized by `gguf.quants.dequantize`, into REF's model through the writer's own name table
(`gguf_writer.sources`), so the static runtime runs on the file's rounded weights.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import open_regular

from . import gguf_writer as GW

MAX_KEYS = 1 << 16  # metadata keys (a real Gemma 4 file has about 50)
MAX_TENSORS = 1 << 16  # tensors (E2B has about 600)
MAX_KEY_LEN = 1 << 16  # bytes of a key or tensor name
MAX_STRING = 1 << 24  # bytes of one string value (a chat template is some 10 KiB)
MAX_NAME = 64  # ggml's GGML_MAX_NAME, with its terminating zero: names of 63 bytes at most
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY = 1 << 22  # items of one array value (a vocabulary has some 262144)
MAX_ITEMS = 1 << 23  # items of all array values together (a real file: about 4 x 262144); bounds the parse time
KEEP_ARRAY = 1 << 12  # numeric arrays up to this many items are kept; longer ones only counted
VERSIONS = (2, 3)
# GGUF value types (gguf.GGUFValueType): struct format of the fixed-size ones
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class MalformedGGUF(TraceToolError):
    pass


@dataclass
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: innermost first
    type: int  # ggml type (gguf.GGMLQuantizationType)
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (outermost first): an HF Linear weight's (out, in)."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        """The ggml type's name: F32, F16, Q8_0, Q4_K, ..."""
        return _ggml_name(self.type)


@dataclass
class ArrayInfo:
    """An array value too long to keep (a vocabulary): its item type and length."""

    item_type: int
    count: int


@dataclass
class Header:
    path: Path
    version: int
    metadata: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # name -> TensorInfo, file order
    fd: int | None = None  # the descriptor the header was read from, kept open: what runs is what was checked
    stamp: tuple = ()  # (size, mtime_ns) when it was checked

    def descriptor(self) -> int:
        """The checked file's open descriptor, refused when the file changed since (rewritten in place:
        a file swapped in under its name is no matter, the descriptor still reads the checked one)."""
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self.stamp:
            raise TraceToolError(f"{one_line(self.path, 200)}: the file changed after its header was checked")
        return self.fd

    def weight_types(self) -> Counter:
        """How many weight tensors (two or more dimensions) the file holds of each ggml type, by name."""
        return Counter(t.type_name for t in self.tensors.values() if len(t.dims) >= 2)

    def types_note(self, requested: str) -> str | None:
        """One phrase when the file's weights are mostly not of the type asked for (llama.cpp stores a
        weight whose rows do not fill its blocks in another type, and says nothing), else None."""
        counts = self.weight_types()
        main = requested.removesuffix("_M").removesuffix("_S")
        quantized = {k: v for k, v in counts.items() if k != "F32"} or dict(counts)
        if not quantized or max(quantized, key=lambda k: (quantized[k], k)) == main:
            return None
        held = ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        return f"the file holds {held} weights, mostly not {main} (rows that do not fill {main}'s blocks)"

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def type_name(self) -> str:
        """The file's type as llama.cpp names it (general.file_type), e.g. Q4_K_M."""
        ft = self.metadata.get("general.file_type")
        for name, value in GW.GGUF_TYPES.items():
            if ft == value:
                return name
        try:
            import gguf

            return gguf.LlamaFileType(ft).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (ImportError, ValueError, TypeError):
            return "type ?"


class _Cursor:
    """Reads from the mapped file; every read is checked against the bytes left."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path
        self.items = 0  # array items read so far (MAX_ITEMS)

    def fail(self, what: str):
        what = what if len(what) <= 300 else what[:300] + "..."  # a name can be 64 KiB long
        raise MalformedGGUF(f"{one_line(self.path, 200)}: not a valid GGUF file: {one_line(what)}")

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > len(self.buf) - self.pos:
            self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file has {len(self.buf) - self.pos} left")
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        self.skip(n, what)
        return self.buf[self.pos - n : self.pos]  # a copy, at most the file's size

    def scalar(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int = MAX_STRING) -> str:
        n = self.scalar("Q", f"the length of {what}")
        if n > limit:
            self.fail(f"{what} claims {n} bytes (at most {limit})")
        return self.take(n, what).decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        self.skip(self.scalar("Q", f"the length of {what}"), what)

    def value(self, vtype: int, what: str):
        if vtype in SCALARS:
            return self.scalar(SCALARS[vtype], what)
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            self.fail(f"{what} has unknown value type {vtype}")
        item = self.scalar("I", f"the item type of {what}")
        count = self.scalar("Q", f"the length of {what}")
        if count > MAX_ARRAY:
            self.fail(f"{what} claims {count} items (at most {MAX_ARRAY})")
        self.items += count
        if self.items > MAX_ITEMS:
            self.fail(f"its arrays hold more than {MAX_ITEMS} items together (at {what})")
        if item in SCALARS:
            size = struct.calcsize(SCALARS[item])
            if count > (len(self.buf) - self.pos) // size:
                self.fail(f"{what} claims {count} items, more than the file holds")
            if count > KEEP_ARRAY:
                self.skip(count * size, what)
                return ArrayInfo(item, count)
            return list(struct.unpack(f"<{count}{SCALARS[item]}", self.take(count * size, what)))
        if item == STRING:
            if count > (len(self.buf) - self.pos) // 8:  # each string has at least its 8-byte length
                self.fail(f"{what} claims {count} strings, more than the file holds")
            if count > KEEP_ARRAY:
                for _ in range(count):
                    self.skip_string(f"an item of {what}")
                return ArrayInfo(item, count)
            return [self.string(f"an item of {what}") for _ in range(count)]
        self.fail(f"{what} is an array of type {item} (arrays of arrays are not read)")


def _ggml_name(t: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(t).name
    except (ImportError, ValueError):
        return f"type {t}"


def read_header(path) -> Header:
    """The file's header, metadata and tensor table, every size checked (module docstring)."""
    path = Path(path)
    with open_regular(path, "GGUF file") as f:  # a FIFO, device or folder is refused before a byte is read
        st = os.fstat(f.fileno())
        if st.st_size < 24:
            short = f"{st.st_size} bytes, shorter than a GGUF header"
            raise MalformedGGUF(f"{one_line(path, 200)}: not a valid GGUF file: {short}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _parse(_Cursor(buf, path), st.st_size)
        # every later reader (the dequantizer, llama.cpp in its child) reads this descriptor, not the name
        header.fd, header.stamp = os.dup(f.fileno()), (st.st_size, st.st_mtime_ns)
        weakref.finalize(header, os.close, header.fd)
        return header


def _parse(c: _Cursor, size: int) -> Header:
    if c.take(4, "the magic") != b"GGUF":
        c.fail("it does not start with GGUF")
    version = c.scalar("I", "the version")
    if version not in VERSIONS:
        c.fail(f"version {version} (read: {', '.join(map(str, VERSIONS))})")
    n_tensors = c.scalar("Q", "the tensor count")
    n_keys = c.scalar("Q", "the key count")
    # a key takes at least 12 bytes (length, type, a one-byte value), a tensor entry at least 24
    if n_tensors > min(MAX_TENSORS, size // 24):
        c.fail(f"it claims {n_tensors} tensors (at most {min(MAX_TENSORS, size // 24)} in a file of {size} bytes)")
    if n_keys > min(MAX_KEYS, size // 12):
        c.fail(f"it claims {n_keys} metadata keys (at most {min(MAX_KEYS, size // 12)} in a file of {size} bytes)")
    h = Header(c.path, version)
    for i in range(n_keys):
        key = c.string(f"key {i}'s name", MAX_KEY_LEN)
        if key in h.metadata:
            c.fail(f"key {key!r} appears twice")
        h.metadata[key] = c.value(c.scalar("I", f"the type of key {key!r}"), f"key {key!r}")
    infos, seen = [], set()
    for i in range(n_tensors):
        name = c.string(f"tensor {i}'s name", MAX_KEY_LEN)
        if len(name.encode()) >= MAX_NAME:
            c.fail(f"tensor {i}'s name is {len(name.encode())} bytes (ggml's limit: {MAX_NAME - 1})")
        if name in seen:
            c.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        n_dims = c.scalar("I", f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            c.fail(f"tensor {name!r} has {n_dims} dims (1 to {MAX_DIMS})")
        dims = tuple(c.scalar("Q", f"a dim of tensor {name!r}") for _ in range(n_dims))
        infos.append((name, dims, c.scalar("I", f"the type of tensor {name!r}"), c.scalar("Q", f"{name!r}'s offset")))
    align = h.metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1) or align > 1 << 16:
        c.fail(f"general.alignment {align!r} is not a power of two up to 65536")
    data_start = -(-c.pos // align) * align
    sizes = _type_sizes()
    for name, dims, ggml_type, offset in infos:
        if ggml_type not in sizes:
            c.fail(f"tensor {name!r} has unknown type {ggml_type}")
        block, type_size = sizes[ggml_type]
        if any(d < 1 for d in dims) or dims[0] % block:
            c.fail(f"tensor {name!r} has dims {list(dims)} (each >= 1, the first a multiple of {block})")
        n = math.prod(dims)  # Python ints: no overflow, compared before any use
        nbytes = n // block * type_size
        if offset % align or offset > size or nbytes > size - data_start - offset:
            c.fail(
                f"tensor {name!r} ({nbytes} bytes at data offset {offset}) lies outside the file "
                f"({size} bytes, data from byte {data_start}) or is not aligned to {align}"
            )
        h.tensors[name] = TensorInfo(name, dims, ggml_type, data_start + offset, nbytes)
    ranges = sorted((t.offset, t.offset + t.nbytes, t.name) for t in h.tensors.values())
    for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
        if start < end:
            c.fail(f"tensors {a!r} and {b!r} overlap")
    end = max((e for _, e, _ in ranges), default=data_start)
    if size > -(-end // align) * align:  # llama.cpp maps the whole file: a tail would be read for nothing
        c.fail(f"it has {size - end} bytes after its last tensor's data (which ends at byte {end})")
    return h


def _type_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (elements per block, bytes per block), from the gguf library's table."""
    gguf = GW.gguf_module()
    return {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}


# ------------------------------------------------------------------ the metadata check
# (key after "gemma4.", words for it); lists are compared per layer
CHECKED = (
    ("block_count", "layers"),
    ("embedding_length", "hidden width"),
    ("feed_forward_length", "MLP widths"),
    ("attention.head_count", "heads"),
    ("attention.head_count_kv", "KV heads"),
    ("attention.key_length", "full head dim"),
    ("attention.value_length", "full value dim"),
    ("attention.key_length_swa", "sliding head dim"),
    ("attention.value_length_swa", "sliding value dim"),
    ("attention.sliding_window", "sliding window"),
    ("attention.sliding_window_pattern", "sliding layers"),
    ("rope.freq_base", "full RoPE base"),
    ("rope.freq_base_swa", "sliding RoPE base"),
    ("rope.dimension_count", "full RoPE dims"),
    ("rope.dimension_count_swa", "sliding RoPE dims"),
    ("attention.layer_norm_rms_epsilon", "RMSNorm eps"),
    ("final_logit_softcapping", "final logit softcap"),
    ("attention.shared_kv_layers", "KV-shared layers"),
    ("embedding_length_per_layer_input", "per-layer-input width"),
)
PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6)
        except (TypeError, ValueError):
            return False
    return a == b


def _words(v) -> str:
    if isinstance(v, ArrayInfo):
        return f"an array of {v.count}"
    if isinstance(v, list):
        if v and all(x == v[0] for x in v):
            return f"{_words(v[0])} x{len(v)}"
        shown = ",".join(_words(x) for x in v[:12])
        return f"[{shown}{',...' if len(v) > 12 else ''}]"
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str):
        return repr(v[:40])
    return str(v)


def config_differences(header: Header, loaded) -> list[str]:
    """Each way the file's metadata differs from what the project's writer would write for
    REF's model, in words: ["layers 6 (REF 8)", "sliding window 9 (REF 8)", ...]."""
    if header.arch != "gemma4":
        return [f"architecture {header.arch[:40]!r}{'...' if len(header.arch) > 40 else ''} (REF 'gemma4')"]
    want = GW.expected_metadata(loaded)
    n_layers = int(want["gemma4.block_count"])
    out = []
    for key, words in CHECKED:
        k = f"gemma4.{key}"
        got, exp = header.metadata.get(k), want.get(k)
        if key in PER_LAYER:  # one value for every layer, or one per layer
            got = [got] * n_layers if isinstance(got, (int, float)) and not isinstance(got, bool) else got
            exp = [exp] * n_layers if isinstance(exp, (int, float)) and not isinstance(exp, bool) else exp
        if isinstance(got, list) and isinstance(exp, list):
            same = len(got) == len(exp) and all(_same(a, b) for a, b in zip(got, exp))
        else:
            same = (got is None and exp is None) or (got is not None and exp is not None and _same(got, exp))
        if not same:
            out.append(
                f"{words} {'absent' if got is None else _words(got)} (REF {'absent' if exp is None else _words(exp)})"
            )
    experts = header.metadata.get("gemma4.expert_count")
    want_experts = want.get("gemma4.expert_count")
    if experts not in (None, 0) or want_experts not in (None, 0):
        if not _same(experts or 0, want_experts or 0):  # a mixture of experts where REF has none, or the reverse
            out.append(f"experts {_words(experts or 0)} (REF {_words(want_experts or 0)})")
    out += _rope_freqs_difference(header, loaded)
    embd = header.tensors.get("token_embd.weight")
    vocab = int(loaded.text_config.vocab_size)
    if embd is None:
        out.append("token_embd.weight absent")
    elif embd.dims[-1] != vocab:
        out.append(f"vocab {embd.dims[-1]} (REF {vocab})")
    return out


def _rope_freqs_difference(header: Header, loaded) -> list[str]:
    """Proportional RoPE is the rope_freqs tensor (1: rotated, 1e30: held): how many rotate."""
    exp = dict(GW.sources(loaded)).get("rope_freqs.weight")
    info = header.tensors.get("rope_freqs.weight")
    if exp is None and info is None:
        return []
    if exp is None or info is None:
        return [f"rope_freqs {'absent' if info is None else 'present'} (REF {'absent' if exp is None else 'present'})"]
    if info.nbytes > 1 << 20:
        return [f"rope_freqs of {info.nbytes} bytes (REF {exp.size} values)"]
    got = dequantized(header, info).reshape(-1)
    if got.size != exp.size or not np.array_equal(got < 1e29, exp < 1e29):
        n_got, n_exp = int((got < 1e29).sum()), int((exp < 1e29).sum())
        return [f"full RoPE rotated frequencies {n_got} of {got.size} (REF {n_exp} of {exp.size})"]
    return []


# ggml's integer and double types (GGML_TYPE_I8 ... GGML_TYPE_F64): no weight of a model has them, and
# llama.cpp's matrix kernels have no path for them (an I8, I32 or F64 weight crashed its child)
NOT_WEIGHT_TYPES = {24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"}


def check_weight_types(header: Header) -> None:
    """Refuse, in one line, a tensor of a type llama.cpp does not compute with."""
    for t in header.tensors.values():
        if t.type in NOT_WEIGHT_TYPES:
            raise TraceToolError(
                f"{header.path}: tensor {t.name[:64]!r} has type {NOT_WEIGHT_TYPES[t.type]}, which no Gemma 4 "
                "weight has and llama.cpp does not compute with"
            )


def check_config(header: Header, loaded, allow: bool) -> list[str]:
    """The differences (config_differences); refused in one line unless `allow`."""
    check_weight_types(header)  # not a mismatch to allow: these types reach unsafe paths in llama.cpp
    diffs = config_differences(header, loaded)
    if diffs and not allow:
        raise TraceToolError(
            f"{header.path} does not match REF's model config: {'; '.join(diffs)} "
            "(--allow-config-mismatch replays it anyway)"
        )
    return diffs


# ------------------------------------------------------------------ dequantized weights
def dequantized(header: Header, info: TensorInfo) -> np.ndarray:
    """One tensor's values as float32 in numpy order, dequantized by the gguf library."""
    gguf = GW.gguf_module()
    qtype = gguf.GGMLQuantizationType(info.type)
    with mmap.mmap(header.descriptor(), 0, access=mmap.ACCESS_READ) as buf:
        if info.offset + info.nbytes > len(buf):  # the file changed since its header was read
            raise MalformedGGUF(f"{header.path}: not a valid GGUF file: tensor {info.name!r} lies outside the file")
        raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).copy()
    rows = math.prod(info.dims[1:])
    try:
        if qtype == gguf.GGMLQuantizationType.F32:
            values = raw.view(np.float32)
        elif qtype == gguf.GGMLQuantizationType.F16:
            values = raw.view(np.float16).astype(np.float32)
        else:
            values = gguf.quants.dequantize(raw.reshape(rows, -1), qtype)
    except NotImplementedError:
        raise TraceToolError(
            f"{header.path}: tensor {info.name!r} is {qtype.name}, which the gguf library cannot dequantize"
        ) from None
    return np.asarray(values, dtype=np.float32).reshape(info.shape)


def load_weights(header: Header, loaded) -> None:
    """Replace `loaded`'s weights by the file's, dequantized, through the writer's name table.
    Every tensor the table names must be in the file with its shape, and every tensor of the
    file must be one the table names."""
    import torch

    table = list(GW.sources(loaded))
    names = {name for name, _ in table}
    missing = [n for n in names if n not in header.tensors]
    extra = [n for n in header.tensors if n not in names]
    if missing or extra:
        parts = ([f"lacks {', '.join(sorted(missing)[:4])}"] if missing else []) + (
            [f"has {', '.join(extra[:4])}, which REF's model does not"] if extra else []
        )
        raise TraceToolError(f"{header.path} does not fit REF's model: it {' and '.join(parts)}")
    for name, target in table:
        info = header.tensors[name]
        want = tuple(np.shape(target)) if isinstance(target, np.ndarray) else tuple(target.shape)
        if tuple(d for d in info.shape if d != 1) != tuple(d for d in want if d != 1):
            raise TraceToolError(
                f"{header.path}: tensor {name!r} has shape {list(info.shape)}, REF's model {list(want)}"
            )
        if isinstance(target, np.ndarray):  # derived from the config (rope_freqs): nothing to load
            continue
        values = torch.from_numpy(dequantized(header, info).reshape(want))
        with torch.no_grad():
            target.copy_(values.to(target.dtype))
