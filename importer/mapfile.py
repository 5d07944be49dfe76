"""The map of `trace import` (docs/import.md): which file holds which kind, and its layout.

A map is untrusted input like the dump it describes: it is read only when it is a regular
file of at most MAX_MAP_BYTES (never a FIFO or a device), and its file and key patterns may
use only the fields below with the format specs a file name needs (a zero-padded width), so
a pattern can neither name a file outside the dump folder nor make formatting allocate.
"""

from __future__ import annotations

import os
import re
import stat
import string
from dataclasses import dataclass
from pathlib import PurePosixPath

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError, one_line

MAX_MAP_BYTES = 1 << 20  # a map is a few KiB
ROWS = ("step", "padded", "absolute")
VALUES = ("bool", "additive")
FORMATS = {".npy": "npy", ".npz": "npz", ".safetensors": "safetensors", ".bin": "raw", ".raw": "raw"}
TOP_KEYS = {"runtime", "mode", "steps", "dtype", "device", "tensor"}
ENTRY_KEYS = {"kind", "file", "layers", "format", "key", "dtype", "shape", "axes", "rows", "values", "byteorder"}
INT_FIELDS = ("step", "layer", "position", "start", "stop", "n")
FIELDS = set(INT_FIELDS) | {"kind"}
ENCODER_FIELDS = {"step", "layer", "kind"}  # an encoder kind's file holds the whole prefill's rows
INT_SPEC = re.compile(r"(0?[1-9][0-9]?)?d?")  # what a file name needs: {step}, {step:03d}, {layer:2}
KIND_SPEC = re.compile(r"s?")
SHAPE_WORDS = ("n", "start", "stop")
DUMP_MODES = ("teacher-forced", "free-running")
NUMPY_DTYPES = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
)
FILE_DTYPES = NUMPY_DTYPES + ("bfloat16",)


def fail(msg: str):
    raise TraceToolError(msg)


def row_axes(kind: str) -> tuple[str, ...]:
    """The axis names of a kind's rows after "pos" (docs/import.md)."""
    return tuple(a.dump for a in S.KIND_BY_NAME[kind].axes)


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


def _fields(text: str) -> list[tuple[str, str, str | None, str | None]]:
    """(literal, field, spec, conversion) parts of a pattern; ValueError when it is not one."""
    return list(string.Formatter().parse(text))


def check_pattern(text, what: str, where: str) -> str:
    """A file or key pattern: only our fields, by plain name, with at most a zero-padded width."""
    if not isinstance(text, str) or not text:
        fail(f"{where}: {what} must be a non-empty string")
    if "\0" in text:
        fail(f"{where}: {what} contains a NUL character")
    shown = one_line(repr(text), 120)
    try:
        parts = _fields(text)
    except ValueError as e:
        fail(f"{where}: {what} {shown} is not a valid pattern ({one_line(e, 80)})")
    for _literal, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in FIELDS:
            fail(
                f"{where}: {what} {shown} uses {one_line('{' + name + '}', 40)}; patterns may use "
                + ", ".join(f"{{{f}}}" for f in sorted(FIELDS))
                + " (by name only)"
            )
        if conversion is not None or not (KIND_SPEC if name == "kind" else INT_SPEC).fullmatch(spec or ""):
            fail(
                f"{where}: {what} {shown}: {{{name}}} may have only a width such as {{step:03d}}, "
                f"got {one_line(spec or '!' + str(conversion), 40)!r}"
            )
    return text


def check_file_pattern(text: str, where: str) -> None:
    """A file pattern names a file inside the dump folder: relative, no '..', and every number
    field bounded by something other than a digit (so a file name tells its fields apart)."""
    sample = "".join(lit + ("0" if name else "") for lit, name, _spec, _conv in _fields(text))
    if any(part in ("", ".", "..") for part in sample.split("/")):  # absolute, '..', or not written plainly
        fail(
            f"{where}: file {one_line(repr(text), 120)} must be a plain relative path inside DUMP_DIR "
            "(no leading '/', no '.', '..' or empty parts)"
        )
    prev = ""  # "number": the text so far ends in a number field; "digit": in a digit
    for lit, name, _spec, _conv in _fields(text):
        if lit:
            if prev == "number" and lit[0].isdigit():
                prev = "clash"
                break
            prev = "digit" if lit[-1].isdigit() else ""
        if name in INT_FIELDS:
            if prev:
                prev = "clash"
                break
            prev = "number"
        elif name is not None:
            prev = ""
    if prev == "clash":
        fail(
            f"{where}: file {one_line(repr(text), 120)}: a number field touches a digit or another number "
            "field; put a separator between them"
        )


def read_map_text(path) -> str:
    """The map's text: a regular file (opened without blocking, so a FIFO is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        fail(f"map {path}: no such file")
    except (OSError, ValueError) as e:
        fail(f"map {path} cannot be read ({getattr(e, 'strerror', None) or one_line(e, 80)})")
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            fail(f"map {path}: not a regular file")
        try:
            data = fh.read(MAX_MAP_BYTES + 1)
        except OSError as e:
            fail(f"map {path} cannot be read ({e.strerror})")
    if len(data) > MAX_MAP_BYTES:
        fail(f"map {path}: larger than the {MAX_MAP_BYTES >> 20} MiB a map may be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        fail(f"map {path}: not UTF-8 text")


TOML_STRINGS_AND_COMMENTS = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'[^\'\n]*\'|#[^\n]*')
MAX_NESTING = 16  # arrays and inline tables; a map nests 2 deep


def nesting(text: str) -> int:
    """How deep arrays and inline tables nest in TOML text (strings and comments skipped): checked
    before parsing, which recurses once per level."""
    depth = deepest = 0
    for c in re.findall(r"[\[\]{}]", TOML_STRINGS_AND_COMMENTS.sub("", text)):
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def load_map(path) -> dict:
    """Read and check a map file; every problem is one line naming the map and the entry."""
    text = read_map_text(path)
    if nesting(text) > MAX_NESTING:
        fail(f"map {path}: nested more than {MAX_NESTING} deep; a map is a list of [[tensor]] tables")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        fail(f"map {path} is not valid TOML ({one_line(e, 200)})")
    except RecursionError:
        fail(f"map {path}: nested too deeply to be a map")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        fail(f"map {path}: unknown key {one_line(repr(unknown[0]), 80)} (known: {', '.join(sorted(TOP_KEYS))})")
    mode = raw.get("mode", "teacher-forced")
    if mode not in DUMP_MODES:
        fail(f"map {path}: mode must be one of {', '.join(DUMP_MODES)}, got {one_line(repr(mode), 80)}")
    steps = raw.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        fail(f"map {path}: steps must be an integer >= 1, got {one_line(repr(steps), 80)}")
    for k in ("runtime", "dtype", "device"):
        if k in raw and (not isinstance(raw[k], str) or not raw[k]):
            fail(f"map {path}: {k} must be a non-empty string")
    tensors = raw.get("tensor", [])
    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, dict) for t in tensors):
        fail(f"map {path}: no [[tensor]] entries (each names a kind and a file pattern)")
    entries = [_entry(t, f"map {path}, [[tensor]] #{i + 1}") for i, t in enumerate(tensors)]
    return dict(
        runtime=raw.get("runtime", "import"),
        mode=mode,
        steps=steps,
        dtype=raw.get("dtype"),
        device=raw.get("device", "unknown"),
        entries=entries,
    )


def unknown_kind(kind) -> str:
    """Why a map's kind names no kind: an unknown word, tower, or kind of a tower."""
    shown = one_line(repr(kind), 80)
    tower, dot, name = kind.partition(".") if isinstance(kind, str) else ("", "", "")
    if not dot:
        return f"kind {shown} is not a canonical kind ({', '.join(S.KIND_NAMES)}; an encoder's: vision.q, ...)"
    if tower == S.TEXT:
        return f"kind {shown}: a text kind is named alone ({one_line(name, 40)}, not text.{one_line(name, 40)})"
    if tower not in S.ENCODER_TOWERS:
        return f"kind {shown}: no tower {one_line(repr(tower), 40)} (encoder towers: {', '.join(S.ENCODER_TOWERS)})"
    kinds = ", ".join(k.name for k in S.TOWER_BY_NAME[tower].kinds)
    return f"kind {shown}: the {tower} tower has no kind {one_line(repr(name), 40)} (its kinds: {kinds})"


def check_encoder_entry(t: dict, patterns: dict, where: str) -> None:
    """An encoder kind's entry: one file (per layer) holding its tower's rows for the whole prefill, so
    its patterns ({what: text}) name no position, and its rows are all the tower's (step) or those first
    (padded)."""
    for what, text in patterns.items():
        other = sorted({name for _lit, name, _spec, _conv in _fields(text) if name} - ENCODER_FIELDS)
        if other:
            fail(
                f"{where}: {what} uses {{{other[0]}}}; an encoder kind's file holds all its tower's rows of "
                "the prefill, so its patterns may use only {step} (always 0), {layer} and {kind}"
            )
    if t.get("rows", "step") == "absolute":
        fail(f"{where}: rows = 'absolute' is for text kinds; an encoder kind's rows are step or padded")


def _axes(t: dict, kind: str, spec, per_position: bool, where: str) -> list:
    """An entry's axes (the canonical row axes, with 'pos' and '_' where the file has them), checked."""
    canon = row_axes(kind)
    default_axes = canon if (per_position or spec.by_step) else ("pos",) + canon
    axes = t.get("axes", list(default_axes))
    if not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
        fail(f"{where}: axes must be a list of axis names, got {one_line(repr(axes), 80)}")
    named = [a for a in axes if a != "_"]
    allowed = set(canon) | {"pos"}
    bad = [a for a in named if a not in allowed]
    if bad:
        fail(
            f"{where}: axis {one_line(repr(bad[0]), 40)} is not one of {', '.join(sorted(allowed))} "
            "or '_' (a size-1 axis)"
        )
    if len(set(named)) != len(named):
        fail(f"{where}: axes {axes} name an axis twice")
    missing = [a for a in canon if a not in named]
    if missing:
        fail(f"{where}: axes {axes} lack {missing[0]!r} ({kind} rows have axes {list(canon)})")
    if "pos" not in named and spec.encoder:
        fail(f"{where}: axes {axes} lack 'pos' (an encoder kind's file holds its tower's rows on axis 'pos')")
    if "pos" not in named and spec.by_position and not per_position:
        fail(f"{where}: axes {axes} lack 'pos' (a file per step holds the step's rows; or use {{position}} in file)")
    return axes


def _entry(t: dict, where: str) -> Entry:
    unknown = sorted(set(t) - ENTRY_KEYS)
    if unknown:
        fail(f"{where}: unknown key {one_line(repr(unknown[0]), 80)} (known: {', '.join(sorted(ENTRY_KEYS))})")
    kind = t.get("kind")
    if not isinstance(kind, str) or kind not in S.KIND_BY_NAME:
        fail(f"{where}: {unknown_kind(kind)}")
    where = f"{where} (kind {kind})"
    spec = S.KIND_BY_NAME[kind]
    file = check_pattern(t.get("file"), "file", where)
    check_file_pattern(file, where)
    key = check_pattern(t["key"], "key", where) if "key" in t else None
    if spec.encoder:
        check_encoder_entry(t, {"file": file, "key": key or ""}, where)
    layers = t.get("layers")
    if layers is not None:
        if not S.layered(kind):
            fail(f"{where}: layers given for a kind that is not per layer")
        if not isinstance(layers, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers
        ):
            fail(f"{where}: layers must be a list of layer indices, got {one_line(repr(layers), 80)}")
    fmt = t.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt not in set(FORMATS.values())):
        fail(
            f"{where}: format must be one of {', '.join(sorted(set(FORMATS.values())))}, got {one_line(repr(fmt), 80)}"
        )
    if fmt is None:
        fmt = FORMATS.get(PurePosixPath(file).suffix.lower())
        if fmt is None:
            fail(
                f"{where}: cannot tell the format of {one_line(repr(file), 120)} from its extension; give "
                "format = npy, npz, safetensors or raw"
            )
    dtype = t.get("dtype")
    if dtype is not None and dtype not in FILE_DTYPES:
        fail(f"{where}: dtype {one_line(repr(dtype), 80)} is not one of {', '.join(FILE_DTYPES)}")
    shape = t.get("shape")
    if shape is not None and (
        not isinstance(shape, list)
        or not all((isinstance(x, int) and not isinstance(x, bool) and x >= 0) or x in SHAPE_WORDS for x in shape)
    ):
        fail(
            f'{where}: shape must be a list of sizes (integers, or "n", "start", "stop"), '
            f"got {one_line(repr(shape), 80)}"
        )
    if fmt == "raw" and (dtype is None or shape is None):
        fail(f"{where}: a raw file needs dtype and shape in the map")
    if fmt in ("npz", "safetensors") and key is None:
        fail(f"{where}: a {fmt} file needs key (the tensor's name in the file)")
    per_position = "position" in {name for _lit, name, _spec, _conv in _fields(file) if name}
    if per_position and spec.by_step:
        fail(f"{where}: {{position}} in file is for position-indexed kinds; {kind} has one row per step")
    axes = _axes(t, kind, spec, per_position, where)
    if shape is not None and len(shape) != len(axes):
        fail(f"{where}: shape {shape} has {len(shape)} sizes for {len(axes)} axes {axes}")
    rows = t.get("rows", "step")
    if rows not in ROWS:
        fail(f"{where}: rows must be one of {', '.join(ROWS)}, got {one_line(repr(rows), 80)}")
    values = t.get("values", "bool")
    if values not in VALUES:
        fail(f"{where}: values must be one of {', '.join(VALUES)}, got {one_line(repr(values), 80)}")
    if values != "bool" and kind != "mask":
        fail(f"{where}: values applies to the mask only")
    byteorder = t.get("byteorder", "little")
    if byteorder not in ("little", "big"):
        fail(f"{where}: byteorder must be little or big, got {one_line(repr(byteorder), 80)}")
    return Entry(kind, file, layers, fmt, key, dtype, shape, tuple(axes), rows, values, byteorder, per_position)
