"""`trace import`: build a candidate trace from a folder of dumped tensors (docs/import.md).

Many NPU toolchains cannot run Python inside the runtime but can dump intermediate tensors
to files. A map (TOML) says which file holds which canonical kind at which step and layer,
and how the file's layout maps to ours; this module reads the files with numpy only (no
torch), converts each to canonical rows and writes them with TraceWriter (atomic output).
The header (inputs, provenance, per-layer metadata) comes from the reference trace.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.writer import TraceWriter

ROWS = ("step", "padded", "absolute")
VALUES = ("bool", "additive")
FORMATS = {".npy": "npy", ".npz": "npz", ".safetensors": "safetensors", ".bin": "raw", ".raw": "raw"}
TOP_KEYS = {"runtime", "mode", "steps", "dtype", "device", "tensor"}
ENTRY_KEYS = {"kind", "file", "layers", "format", "key", "dtype", "shape", "axes", "rows", "values", "byteorder"}
FIELDS = {"step", "layer", "position", "start", "stop", "n", "kind"}
SHAPE_WORDS = ("n", "start", "stop")
DUMP_MODES = ("teacher-forced", "free-running")
ADDITIVE_ALLOWED_ABOVE = -1.0  # additive masks: 0 where allowed, a large negative number (or -inf) where not

NUMPY_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                "uint32", "uint64", "bool")
FILE_DTYPES = NUMPY_DTYPES + ("bfloat16",)
SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I8": "int8",
                      "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8", "U16": "uint16",
                      "U32": "uint32", "U64": "uint64", "BOOL": "bool"}


def row_axes(kind: str) -> tuple[str, ...]:
    """The axis names of a kind's rows after "pos" (docs/import.md)."""
    return tuple(a.dump for a in S.KIND_BY_NAME[kind].axes)


def _fail(msg: str):
    raise TraceToolError(msg)


# ---------------------------------------------------------------- the map
@dataclass
class Entry:
    kind: str
    file: str
    layers: list[int] | None
    format: str | None
    key: str | None
    dtype: str | None
    shape: list | None
    axes: tuple[str, ...]
    rows: str
    values: str
    byteorder: str
    per_position: bool


def _check_pattern(text, what: str, where: str) -> str:
    if not isinstance(text, str) or not text:
        _fail(f"{where}: {what} must be a non-empty string")
    try:
        names = {f[1].split(".")[0].split("[")[0] for f in string.Formatter().parse(text) if f[1] is not None}
    except ValueError as e:
        _fail(f"{where}: {what} {text!r} is not a valid pattern ({e})")
    unknown = names - FIELDS
    if unknown:
        _fail(f"{where}: {what} {text!r} uses {{{sorted(unknown)[0]}}}; patterns may use "
              + ", ".join(f"{{{f}}}" for f in sorted(FIELDS)))
    return text


def load_map(path) -> dict:
    """Read and check a map file; every problem is one line naming the map and the entry."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        _fail(f"map {path}: no such file")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"map {path} cannot be read ({getattr(e, 'strerror', None) or e})")
    except tomllib.TOMLDecodeError as e:
        _fail(f"map {path} is not valid TOML ({one_line(e)})")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        _fail(f"map {path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(TOP_KEYS))})")
    mode = raw.get("mode", "teacher-forced")
    if mode not in DUMP_MODES:
        _fail(f"map {path}: mode must be one of {', '.join(DUMP_MODES)}, got {mode!r}")
    steps = raw.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        _fail(f"map {path}: steps must be an integer >= 1, got {steps!r}")
    for k in ("runtime", "dtype", "device"):
        if k in raw and (not isinstance(raw[k], str) or not raw[k]):
            _fail(f"map {path}: {k} must be a non-empty string")
    tensors = raw.get("tensor", [])
    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, dict) for t in tensors):
        _fail(f"map {path}: no [[tensor]] entries (each names a kind and a file pattern)")
    entries = [_entry(t, f"map {path}, [[tensor]] #{i + 1}") for i, t in enumerate(tensors)]
    return dict(runtime=raw.get("runtime", "import"), mode=mode, steps=steps, dtype=raw.get("dtype"),
                device=raw.get("device", "unknown"), entries=entries)


def _entry(t: dict, where: str) -> Entry:
    unknown = sorted(set(t) - ENTRY_KEYS)
    if unknown:
        _fail(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(ENTRY_KEYS))})")
    kind = t.get("kind")
    if kind not in S.KIND_BY_NAME:
        _fail(f"{where}: kind {kind!r} is not a canonical kind ({', '.join(S.KIND_NAMES)})")
    where = f"{where} (kind {kind})"
    spec = S.KIND_BY_NAME[kind]
    file = _check_pattern(t.get("file"), "file", where)
    key = _check_pattern(t["key"], "key", where) if "key" in t else None
    layers = t.get("layers")
    if layers is not None:
        if not spec.per_layer:
            _fail(f"{where}: layers given for a kind that is not per layer")
        if not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in layers):
            _fail(f"{where}: layers must be a list of layer indices, got {layers!r}")
    fmt = t.get("format")
    if fmt is not None and fmt not in set(FORMATS.values()):
        _fail(f"{where}: format must be one of {', '.join(sorted(set(FORMATS.values())))}, got {fmt!r}")
    if fmt is None:
        fmt = FORMATS.get(Path(file).suffix.lower())
        if fmt is None:
            _fail(f"{where}: cannot tell the format of {file!r} from its extension; give format = "
                  f"npy, npz, safetensors or raw")
    dtype = t.get("dtype")
    if dtype is not None and dtype not in FILE_DTYPES:
        _fail(f"{where}: dtype {dtype!r} is not one of {', '.join(FILE_DTYPES)}")
    shape = t.get("shape")
    if shape is not None and (not isinstance(shape, list) or not all(
            (isinstance(x, int) and not isinstance(x, bool) and x >= 0) or x in SHAPE_WORDS for x in shape)):
        _fail(f"{where}: shape must be a list of sizes (integers, or \"n\", \"start\", \"stop\"), got {shape!r}")
    if fmt == "raw" and (dtype is None or shape is None):
        _fail(f"{where}: a raw file needs dtype and shape in the map")
    if fmt in ("npz", "safetensors") and key is None:
        _fail(f"{where}: a {fmt} file needs key (the tensor's name in the file)")
    per_position = "position" in {f[1] for f in string.Formatter().parse(file) if f[1]}
    if per_position and spec.index == "step":
        _fail(f"{where}: {{position}} in file is for position-indexed kinds; {kind} has one row per step")
    canon = row_axes(kind)
    default_axes = canon if (per_position or (spec.index == "step")) else ("pos",) + canon
    axes = t.get("axes", list(default_axes))
    if not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
        _fail(f"{where}: axes must be a list of axis names, got {axes!r}")
    named = [a for a in axes if a != "_"]
    allowed = set(canon) | {"pos"}
    bad = [a for a in named if a not in allowed]
    if bad:
        _fail(f"{where}: axis {bad[0]!r} is not one of {', '.join(sorted(allowed))} or '_' (a size-1 axis)")
    if len(set(named)) != len(named):
        _fail(f"{where}: axes {axes} name an axis twice")
    missing = [a for a in canon if a not in named]
    if missing:
        _fail(f"{where}: axes {axes} lack {missing[0]!r} ({kind} rows have axes {list(canon)})")
    if "pos" not in named and spec.index == "position" and not per_position:
        _fail(f"{where}: axes {axes} lack 'pos' (a file per step holds the step's rows; or use {{position}} in file)")
    if shape is not None and len(shape) != len(axes):
        _fail(f"{where}: shape {shape} has {len(shape)} sizes for {len(axes)} axes {axes}")
    rows = t.get("rows", "step")
    if rows not in ROWS:
        _fail(f"{where}: rows must be one of {', '.join(ROWS)}, got {rows!r}")
    values = t.get("values", "bool")
    if values not in VALUES:
        _fail(f"{where}: values must be one of {', '.join(VALUES)}, got {values!r}")
    if values != "bool" and kind != "mask":
        _fail(f"{where}: values applies to the mask only")
    byteorder = t.get("byteorder", "little")
    if byteorder not in ("little", "big"):
        _fail(f"{where}: byteorder must be little or big, got {byteorder!r}")
    return Entry(kind, file, layers, fmt, key, dtype, shape, tuple(axes), rows, values, byteorder, per_position)


# ---------------------------------------------------------------- reading files
def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _read_raw(path: Path, e: Entry, shape: tuple) -> tuple[np.ndarray, str]:
    itemsize = 2 if e.dtype == "bfloat16" else np.dtype(e.dtype).itemsize
    want = math.prod(shape) * itemsize
    size = path.stat().st_size
    if size != want:
        _fail(f"{path}: holds {size} bytes; the map's dtype {e.dtype} and shape {list(shape)} make {want}")
    order = "<" if e.byteorder == "little" else ">"
    if e.dtype == "bfloat16":
        return _bf16_to_f32(np.fromfile(path, dtype=f"{order}u2").reshape(shape)), "bfloat16"
    dt = np.dtype(e.dtype).newbyteorder(order) if np.dtype(e.dtype).itemsize > 1 else np.dtype(e.dtype)
    return np.fromfile(path, dtype=dt).reshape(shape).astype(np.dtype(e.dtype).newbyteorder("=")), e.dtype


def _read_safetensors(path: Path, key: str) -> tuple[np.ndarray, str]:
    # parsed here (a JSON header, then raw little-endian bytes): numpy has no bfloat16, and only
    # the one tensor asked for is read
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            _fail(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            _fail(f"{path}: not a safetensors file (its header is not JSON)")
        info = header.get(key) if isinstance(header, dict) else None
        if not isinstance(info, dict):
            names = sorted(k for k in header if k != "__metadata__") if isinstance(header, dict) else []
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            _fail(f"{path}: no tensor {key!r} (it holds: {shown or 'nothing'})")
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        shape, offs = info.get("shape"), info.get("data_offsets")
        if dtype is None:
            _fail(f"{path}: tensor {key!r} has dtype {info.get('dtype')!r}, which this importer does not read")
        try:
            shape = tuple(int(s) for s in shape)
            a, b = (int(o) for o in offs)
        except (TypeError, ValueError):
            _fail(f"{path}: tensor {key!r} has a malformed shape or offsets in the header")
        itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        if min(shape, default=0) < 0 or b - a != math.prod(shape) * itemsize or a < 0 or 8 + n + b > size:
            _fail(f"{path}: tensor {key!r}: its offsets do not match its shape and dtype (damaged file)")
        f.seek(8 + n + a)
        buf = f.read(b - a)
    if dtype == "bfloat16":
        return _bf16_to_f32(np.frombuffer(buf, dtype="<u2").reshape(shape)), dtype
    return np.frombuffer(buf, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape).astype(dtype), dtype


def _read_numpy(path: Path, e: Entry, key: str | None) -> tuple[np.ndarray, str]:
    try:
        if e.format == "npy":  # memory-mapped: only the rows taken are read (a whole KV cache may be dumped)
            arr = np.load(path, allow_pickle=False, mmap_mode="r")
        else:
            with np.load(path, allow_pickle=False) as z:
                if key not in z.files:
                    shown = ", ".join(z.files[:8]) + (", ..." if len(z.files) > 8 else "")
                    _fail(f"{path}: no array {key!r} (it holds: {shown or 'nothing'})")
                # a compressed member is inflated whole: refuse one that cannot fit before inflating it
                LIM.check_fits(z.zip.getinfo(f"{key}.npy").file_size, f"{path} [{key}]")
                arr = z[key]
    except TraceToolError:
        raise
    except (ValueError, OSError, EOFError) as ex:
        _fail(f"{path}: not a readable .{e.format} file ({one_line(ex, 120)})")
    if not isinstance(arr, np.ndarray) or arr.dtype.name not in NUMPY_DTYPES:
        _fail(f"{path}: holds {getattr(arr, 'dtype', type(arr).__name__)} data; expected numbers")
    return arr, arr.dtype.name


def read_file(path: Path, e: Entry, fields: dict) -> tuple[np.ndarray, str]:
    """The file's array as stored, and its dtype name; shape and dtype checked against the map."""
    shape = None
    if e.shape is not None:
        shape = tuple(fields[x] if isinstance(x, str) else x for x in e.shape)
    key = e.key.format(**fields) if e.key else None
    try:
        if e.format == "raw":
            arr, dtype = _read_raw(path, e, shape)
        elif e.format == "safetensors":
            arr, dtype = _read_safetensors(path, key)
        else:
            arr, dtype = _read_numpy(path, e, key)
    except IsADirectoryError:
        _fail(f"{path}: is a folder, not a tensor file")
    except PermissionError:
        _fail(f"{path}: cannot be read (permission denied)")
    what = f"{path}" + (f" [{key}]" if key else "")
    if e.dtype is not None and dtype != e.dtype:
        _fail(f"{what}: dtype {dtype}, but the map says {e.dtype}")
    if shape is not None and tuple(arr.shape) != shape:
        _fail(f"{what}: shape {list(arr.shape)}, but the map says {list(shape)}")
    return arr, dtype


# ---------------------------------------------------------------- to canonical rows
def to_rows(arr: np.ndarray, dtype: str, e: Entry, fields: dict, expect: tuple | None, what: str) -> np.ndarray:
    """Permute the file's axes to (pos, *row axes), pick the step's rows, check the row shape."""
    spec = S.KIND_BY_NAME[e.kind]
    if arr.ndim != len(e.axes):
        _fail(f"{what}: has {arr.ndim} axes {list(arr.shape)}, but the map names {len(e.axes)}: {list(e.axes)}")
    if spec.dtype == "float" and not dtype.startswith(("float", "bfloat")):
        _fail(f"{what}: dtype {dtype}; {e.kind} needs floating-point data")
    if spec.dtype == "int" and not np.issubdtype(arr.dtype, np.integer):
        _fail(f"{what}: dtype {dtype}; {e.kind} needs integer data")
    if e.kind == "mask" and e.values == "additive" and not np.issubdtype(arr.dtype, np.floating):
        _fail(f"{what}: dtype {dtype}; an additive mask needs floating-point data")
    for name, size in zip(e.axes, arr.shape):
        if name == "_" and size != 1:
            _fail(f"{what}: axis '_' (dropped) has size {size}, expected 1 (shape {list(arr.shape)})")
    keep = [i for i, a in enumerate(e.axes) if a != "_"]
    arr = arr.reshape([arr.shape[i] for i in keep])
    names = [e.axes[i] for i in keep]
    canon = list(row_axes(e.kind))
    if "pos" in names:
        arr = np.moveaxis(arr, [names.index(a) for a in ["pos"] + canon], range(len(canon) + 1))
        start, stop, n = fields["start"], fields["stop"], fields["n"]
        if e.per_position:  # one position per file: the pos axis holds that row (rows as for a step of 1)
            start, stop, n = fields["position"], fields["position"] + 1, 1
        if spec.index == "step":  # logits/token at the step's last position
            a = {"step": n - 1, "padded": n - 1, "absolute": stop - 1}[e.rows]
            b = a + 1
        else:
            a, b = {"step": (0, n), "padded": (0, n), "absolute": (start, stop)}[e.rows]
        rows = arr.shape[0]
        if (e.rows == "step" and rows != n) or rows < b:
            need = {"step": f"{n} (the rows fed at this step)", "padded": f">= {b} (padded)",
                    "absolute": f">= {b} (indexed by absolute position)"}[e.rows]
            _fail(f"{what}: {rows} rows on axis 'pos', expected {need}")
        arr = arr[a:b]
        if spec.index == "step":
            arr = arr[0]
    else:
        arr = np.moveaxis(arr, [names.index(a) for a in canon], range(len(canon)))
        if spec.index == "position":
            arr = arr[None]
    row = arr.shape[1:] if spec.index == "position" else arr.shape
    if expect is not None and tuple(row) != tuple(expect):
        _fail(f"{what}: rows of shape {list(row)} after the map's layout, expected {list(expect)} for {e.kind}")
    if e.kind == "mask":
        arr = arr > ADDITIVE_ALLOWED_ABOVE if e.values == "additive" else arr != 0
    return np.ascontiguousarray(arr)


# ---------------------------------------------------------------- the import
@dataclass
class Source:
    entry: Entry
    layer: int | None
    expect: tuple | None  # canonical row shape (None: not checked, e.g. mask widths)


def _sources(entries: list[Entry], ref: TraceReader, where: str) -> list[Source]:
    n_layers = len(ref.layers)
    out, seen = [], {}
    for e in entries:
        spec = S.KIND_BY_NAME[e.kind]
        if spec.per_layer:
            owners = [i for i, li in enumerate(ref.layers) if e.kind not in ("k", "v") or li.kv_role != "reuses"]
            layers = e.layers if e.layers is not None else owners
            for i in layers:
                if i >= n_layers:
                    _fail(f"{where}: kind {e.kind} names layer {i}; the model has {n_layers} layers")
                if i not in owners:
                    _fail(f"{where}: kind {e.kind} names layer {i}, which reuses layer "
                          f"{ref.layers[i].kv_source}'s K/V and writes none")
        else:
            layers = [None]
        for i in layers:
            if (e.kind, i) in seen:
                _fail(f"{where}: kind {e.kind}{'' if i is None else f' layer {i}'} is mapped twice")
            seen[(e.kind, i)] = True
            out.append(Source(e, i, _expected_row(e.kind, i, ref)))
    return out


def _expected_row(kind: str, layer: int | None, ref: TraceReader) -> tuple | None:
    if kind == "mask":
        return None  # any key width: columns past it read as "not allowed"
    if kind in ("q", "k", "v"):
        li = ref.layers[layer]
        return (li.num_heads if kind == "q" else li.num_kv_heads, li.head_dim)
    if ref.has(kind, layer):
        return tuple(ref.dataset(kind, layer).shape[1:])
    return None


def import_dump(dump_dir, reference, map_path, output, *, force: bool = False) -> str:
    """Write OUTPUT from the dump; return a one-line summary."""
    from importlib.metadata import version

    dump = Path(dump_dir)
    if not dump.is_dir():
        _fail(f"dump folder {dump}: no such folder")
    check_output_path(output, force, inputs=(reference, map_path))  # never over an input, even with --force
    m = load_map(map_path)
    with TraceReader(reference) as ref:
        sources = _sources(m["entries"], ref, f"map {map_path}")
        n_steps = m["steps"] or ref.n_steps
        if n_steps > ref.max_new_tokens:
            _fail(f"map {map_path}: steps {n_steps} exceeds REF's max_new_tokens {ref.max_new_tokens}")
        T = ref.prompt_len
        positions = [(0, T)] + [(T + s - 1, T + s) for s in range(1, n_steps)]

        def fields_of(step: int, layer, kind: str, pos: int | None = None) -> dict:
            a, b = positions[step]
            return dict(step=step, layer=layer if layer is not None else 0, kind=kind, start=a, stop=b, n=b - a,
                        position=a if pos is None else pos)

        def files(src: Source, step: int) -> list[tuple[Path, dict]]:
            a, b = positions[step]
            poss = range(a, b) if src.entry.per_position else [None]
            out = []
            for p in poss:
                f = fields_of(step, src.layer, src.entry.kind, p)
                out.append((dump / src.entry.file.format(**f), f))
            return out

        # a (kind, layer) is imported when its files exist for every step, absent when none exist
        present, absent = [], []
        for src in sources:
            have = [[p.exists() for p, _ in files(src, s)] for s in range(n_steps)]
            flat = [x for h in have for x in h]
            if not any(flat):
                absent.append(src)
                continue
            if not all(flat):
                s = next(s for s, h in enumerate(have) if not all(h))
                path = files(src, s)[have[s].index(False)][0]
                _fail(f"{path}: missing (kind {src.entry.kind}"
                      f"{'' if src.layer is None else f' layer {src.layer}'}, step {s}); other steps of it exist")
            present.append(src)
        if not present:
            _fail(f"dump folder {dump}: no file matches any pattern of map {map_path} "
                  f"(e.g. {files(sources[0], 0)[0][0]})")

        mapped = {s.entry.kind for s in present}
        ref_tokens = [int(t) for t in ref.tokens()]
        if m["mode"] == "free-running" and not mapped & {"token", "logits"}:
            _fail(f"map {map_path}: a free-running dump needs token or logits files (its tokens are its own)")
        if "token" in mapped:
            token_from = "dump"
        elif "logits" in mapped:
            token_from = "argmax of the dumped logits"
        else:
            token_from = "REF (no token or logits in the dump)"
            if n_steps > len(ref_tokens):
                _fail(f"map {map_path}: steps {n_steps} but REF has {len(ref_tokens)} tokens to copy")
        prov = dict(ref.provenance)
        prov.update(runtime=m["runtime"], mode=m["mode"], creator_version=version("gemma4-trace"), device=m["device"],
                    dtype=m["dtype"] or prov["dtype"], torch_version="n/a (import)",
                    transformers_version="n/a (import)")
        import h5py

        prov["h5py_version"] = h5py.__version__
        tokens: list[int] = []
        with TraceWriter(output, force=force) as w:
            w.write_header(prov, ref.prompt_ids, ref.layers, max_new_tokens=ref.max_new_tokens,
                           eos_token_ids=ref.eos_token_ids, prompt_text=ref.prompt_text,
                           chat_template_applied=ref.chat_template_applied, extra_inputs=ref.extra_inputs())
            for step in range(n_steps):
                a, b = positions[step]
                w.begin_step(range(a, b))
                got = {}
                for src in present:
                    blocks, src_dtype = [], None
                    for path, f in files(src, step):
                        arr, src_dtype = read_file(path, src.entry, f)
                        what = str(path) + (f" [{src.entry.key.format(**f)}]" if src.entry.key else "")
                        blocks.append(to_rows(arr, src_dtype, src.entry, f, src.expect, what))
                    rows = np.concatenate(blocks) if src.entry.per_position else blocks[0]
                    if src.entry.kind in ("logits", "token"):
                        got[src.entry.kind] = (rows, src_dtype)
                        continue
                    try:
                        w.add(src.entry.kind, rows, layer=src.layer, source_dtype=src_dtype)
                    except ValueError as ex:  # a row shape that changed between steps
                        _fail(f"{files(src, step)[0][0]}: {ex}")
                if "logits" in got:
                    w.add("logits", got["logits"][0], source_dtype=got["logits"][1])
                if "token" in got:
                    token = int(np.asarray(got["token"][0]).reshape(-1)[0])
                elif "logits" in got:
                    token = int(np.argmax(got["logits"][0]))
                else:
                    token = ref_tokens[step]
                w.add("token", token)
                w.end_step()
                tokens.append(token)
    kinds = sorted({s.entry.kind for s in present}, key=S.KIND_NAMES.index)
    miss = sorted({s.entry.kind for s in absent} - set(kinds), key=S.KIND_NAMES.index)
    agree = sum(x == y for x, y in zip(tokens, ref_tokens))
    return (f"wrote {output}: {n_steps} steps from {dump} ({len(present)} tensors: {', '.join(kinds)}"
            + (f"; absent: {', '.join(miss)}" if miss else "")
            + f"), tokens from {token_from}, {agree}/{len(tokens)} agree with the reference")
