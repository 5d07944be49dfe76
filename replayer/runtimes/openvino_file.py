"""`trace replay REF --ir PATH`: the user's OpenVINO IR read and checked before any model loads.

PATH is a folder holding the tool's own step graphs (prefill.xml/.bin and decode.xml/.bin, as
`trace export-openvino` writes them) or one .xml file with its .bin beside it (same name) in the
KV-cache layout (input_ids, attention_mask, position_ids, past_key_values.N.key/.value in; logits,
present.N.key/.value out; a map's [inputs] and [outputs] rename them). It is untrusted input
(`read_ir`): each file a regular file within bounds (a FIFO, device or folder is refused before a
byte is read), the .bin a plain file beside its .xml (no link); the .xml parsed first by Python's
expat with no document type allowed (so no entity is ever declared or expanded: "billion laughs"
and external entities are refused), bounded in depth and elements, its root an IR `<net>`; every
constant's offset and size inside the .bin, its size the one its type and shape need. Only then
does OpenVINO's own reader (`Core.read_model`) read the graph; both files are hashed, and their
size and time checked again once it has read them and before the copy that runs is written. The
user's files are never written: what runs is a copy in the artifact cache (openvino_user.py). The
provenance names the files by their basename and sha256, never the path.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import open_regular

from . import onnx_map as M

OPTION = "--ir"
STEPS = ("prefill", "decode")  # a folder of the tool's own IR: prefill.xml/.bin, decode.xml/.bin
MIN_XML = 16  # bytes: shorter is no IR
MAX_XML = 1 << 30  # bytes of one .xml (the graph's text; its weights are in the .bin)
MAX_BIN = 64 << 30  # bytes of one .bin
MAX_DEPTH = 16  # element nesting of an IR (net/layers/layer/output/port/dim: 6; rt_info a few more)
MAX_ELEMENTS = 1 << 24  # elements of one .xml
IR_VERSIONS = ("10", "11")
BLOCK = 1 << 22
# bits per element of the constants' types whose size is fixed (others: only the bounds are checked)
BITS = {
    **dict.fromkeys(("f64", "i64", "u64"), 64),
    **dict.fromkeys(("f32", "i32", "u32"), 32),
    **dict.fromkeys(("f16", "bf16", "i16", "u16"), 16),
    **dict.fromkeys(("i8", "u8", "boolean", "f8e4m3", "f8e5m2"), 8),
    **dict.fromkeys(("i4", "u4", "nf4"), 4),
    "u2": 2,
    "u1": 1,
}


@dataclass
class UserIR:
    """The user's IR (one .xml and its .bin, or the folder of step graphs), read and checked (read_ir)."""

    path: Path  # what the user named (never in the provenance)
    folder: Path  # where its files are
    steps: bool  # a folder of prefill.xml and decode.xml (the step-graphs layout)
    models: dict = field(default_factory=dict)  # graph ("prefill", "decode" or "model") -> openvino.Model
    files: dict = field(default_factory=dict)  # file name -> sha256 (each graph's .xml, then its .bin)
    stamps: dict = field(default_factory=dict)  # file name -> (size, mtime_ns), checked again

    def files_text(self) -> str:
        return ", ".join(f"{one_line(n, 100)} sha256:{h}" for n, h in self.files.items())

    def file_name(self, graph: str) -> str:
        return f"{graph}.xml" if self.steps else one_line(self.path.name, 100)

    def shown(self) -> str:
        return one_line(self.path.name, 100) + ("/" if self.steps else "")

    def fail(self, why: str):
        fail(self.path, why)

    def mobius_like(self) -> bool:
        """The graph's op names are mobius-onnx's (onnx_map.MOBIUS_NODES): mobius's graph converted by
        `openvino.convert_model` keeps its node names as the ops' friendly names."""
        model = self.models.get("model")
        names = [op.get_friendly_name() for op in model.get_ordered_ops()] if model is not None else []
        return bool(names) and all(any(n.startswith(p) for n in names) for p in M.MOBIUS_NODES)


def fail(path, why: str):
    raise TraceToolError(f"{OPTION} {one_line(str(path), 200)}: {why}")


def core():
    """OpenVINO's Core, its usage telemetry off (openvino.py's no_telemetry)."""
    from .openvino import no_telemetry

    no_telemetry()
    try:
        import openvino
    except ImportError as e:
        raise TraceToolError(f"{OPTION} needs openvino ({e})") from None
    return openvino.Core()


def read_ir(path) -> UserIR:
    """PATH read and checked within bounds (module docstring); one line for anything that is not an
    IR this replay can take."""
    path = Path(path)
    if not os.path.lexists(path):
        fail(path, "no such file or folder")
    if os.path.isdir(path):
        missing = [f"{g}.xml" for g in STEPS if not os.path.lexists(path / f"{g}.xml")]
        if missing:
            fail(path, f"a folder must hold the tool's own IR (prefill.xml and decode.xml, each with its .bin; "
                 f"no {missing[0]}); give another IR as one .xml file")  # fmt: skip
        out = UserIR(path, path, True)
        ov = core()
        for g in STEPS:
            _read_model(out, ov, g, path / f"{g}.xml")
        return out
    if path.suffix != ".xml":
        fail(path, "an OpenVINO IR is a .xml file with its .bin beside it (or a folder of prefill.xml, decode.xml)")
    out = UserIR(path, path.parent, False)
    _read_model(out, core(), "model", path)
    return out


def _read_model(out: UserIR, ov, graph: str, xml: Path) -> None:
    """One .xml and its .bin: checked (the module docstring), then read by OpenVINO."""
    name = out.file_name(graph)
    weights = xml.with_suffix(".bin")
    consts = scan_xml(out, name, _read_xml(out, name, xml))
    size = _read_bin(out, weights)
    for layer, offset, length, etype, shape in consts:
        if offset + length > size:
            fail(out.path, f"{name}: constant {one_line(layer, 80)!r} ends at byte {offset + length} of "
                 f"{weights.name}, which holds {size} (truncated?)")  # fmt: skip
        need = _nbytes(etype, shape)
        if need is not None and need != length:
            fail(out.path, f"{name}: constant {one_line(layer, 80)!r} declares {length} bytes; its type "
                 f"{one_line(etype, 20)} and shape [{one_line(shape, 60)}] need {need}")  # fmt: skip
    try:
        model = ov.read_model(str(xml), str(weights))
    except Exception as e:  # noqa: BLE001 - OpenVINO's reader refuses a graph in its own ways
        fail(out.path, f"{name}: OpenVINO cannot read it ({one_line(' '.join(str(e).split()), 160)})")
    for f in (xml, weights):
        unchanged(out, f.name, f)
    if not model.inputs or not model.outputs:
        fail(out.path, f"{name} is not an IR of a decoder (no inputs or no outputs)")
    out.models[graph] = model


def _stamp(out: UserIR, key: str, f) -> os.stat_result:
    st = os.fstat(f.fileno())
    out.stamps[key] = (st.st_size, st.st_mtime_ns)
    return st


def _read_xml(out: UserIR, name: str, xml: Path) -> bytes:
    with open_regular(xml, f"{OPTION}'s {name}" if out.steps else OPTION) as f:  # a FIFO, device, folder: one line
        size = _stamp(out, xml.name, f).st_size
        if not MIN_XML <= size <= MAX_XML:
            fail(out.path, f"{name} is {size} bytes (an IR's .xml: {MIN_XML} to {MAX_XML})")
        raw = f.read(MAX_XML + 1)
    if len(raw) != size:
        fail(out.path, f"{name} changed while it was read")
    out.files[xml.name] = hashlib.sha256(raw).hexdigest()
    return raw


def _read_bin(out: UserIR, weights: Path) -> int:
    """The .bin beside its .xml: a regular file, no link, within MAX_BIN; hashed; its size."""
    try:
        st = os.lstat(weights)
    except OSError:
        fail(out.path, f"its weights {one_line(weights.name, 80)} do not exist beside it")
    if stat.S_ISLNK(st.st_mode):
        fail(out.path, f"its weights {one_line(weights.name, 80)} are a link (they must be a file beside the .xml)")
    with open_regular(weights, f"{OPTION}'s weights") as f:
        st = _stamp(out, weights.name, f)
        if st.st_size > MAX_BIN:
            fail(out.path, f"its weights {one_line(weights.name, 80)} are {st.st_size} bytes (at most {MAX_BIN})")
        h = hashlib.sha256()
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    out.files[weights.name] = h.hexdigest()
    return st.st_size


def scan_xml(out: UserIR, name: str, raw: bytes) -> list[tuple]:
    """The .xml parsed by expat with no document type (hence no entity) allowed, bounded in depth and
    elements, its root an IR's `<net version="10|11">`: [(layer name, offset, size, element type,
    shape)] of its constants."""
    from xml.parsers import expat

    consts, depth, count, layer = [], [0], [0], [None]

    def refuse(what):
        def handler(*args):
            fail(out.path, f"{name} holds {what}, which an IR never does (refused: entities are not expanded)")

        return handler

    def start(tag, attrs):
        depth[0] += 1
        count[0] += 1
        if depth[0] > MAX_DEPTH or count[0] > MAX_ELEMENTS:
            fail(out.path, f"{name} nests deeper than {MAX_DEPTH} or holds over {MAX_ELEMENTS} elements")
        if count[0] == 1 and (tag != "net" or attrs.get("version") not in IR_VERSIONS):
            fail(out.path, f"{name} is not OpenVINO IR (its root is <{one_line(tag, 40)} version="
                 f"{one_line(repr(attrs.get('version')), 20)}>, not <net version=\"10\"|\"11\">)")  # fmt: skip
        if tag == "layer" and depth[0] == 3:
            layer[0] = attrs
        elif tag == "data" and layer[0] is not None and layer[0].get("type") == "Const":
            consts.append(_constant(out, name, layer[0].get("name", "?"), attrs))

    def end(tag):
        depth[0] -= 1
        if tag == "layer" and depth[0] == 2:
            layer[0] = None

    p = expat.ParserCreate()
    p.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    p.StartDoctypeDeclHandler = refuse("a document type declaration")
    p.EntityDeclHandler = refuse("an entity declaration")
    p.ExternalEntityRefHandler = refuse("an external entity")
    p.StartElementHandler, p.EndElementHandler = start, end
    try:
        p.Parse(raw, True)
    except expat.ExpatError as e:
        fail(out.path, f"{name} is not well-formed XML ({one_line(e, 120)})")
    except RecursionError:
        fail(out.path, f"{name} nests too deeply")
    return consts


def _constant(out: UserIR, name: str, layer: str, attrs: dict) -> tuple:
    try:
        offset, size = int(attrs["offset"]), int(attrs["size"])
    except (KeyError, ValueError):
        fail(out.path, f"{name}: constant {one_line(layer, 80)!r} has no offset and size in its weights")
    if offset < 0 or size < 0:
        fail(out.path, f"{name}: constant {one_line(layer, 80)!r} is at {offset}+{size}")
    return layer, offset, size, attrs.get("element_type", ""), attrs.get("shape", "")


def _nbytes(etype: str, shape: str) -> int | None:
    """A constant's bytes by its type and shape (None: a type of no fixed size, or a shape that is no list)."""
    bits = BITS.get(etype)
    try:
        dims = [int(d) for d in shape.replace(" ", "").split(",") if d != ""]
    except ValueError:
        return None
    if bits is None or any(d < 0 for d in dims):
        return None
    return math.ceil(math.prod(dims) * bits / 8)


def unchanged(user: UserIR, name: str, path=None) -> None:
    """A file still as it was read (size and time): after OpenVINO read it, before the copy is written."""
    size, mtime = user.stamps[name]
    try:
        st = os.stat(path if path is not None else user.folder / name)
    except OSError:
        st = None
    if st is None or (st.st_size, st.st_mtime_ns) != (size, mtime):
        fail(user.path, f"{one_line(name, 80)} changed since it was read")
