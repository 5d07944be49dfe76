"""`trace replay REF --onnx PATH`: the user's ONNX graph read and checked before any model loads.

PATH is a folder holding the tool's own step graphs (prefill.onnx and decode.onnx, as `trace
export-onnx` writes them) or one .onnx file in the KV-cache layout (input_ids, attention_mask,
position_ids, past_key_values.N.key/.value in; logits, present.N.key/.value out; a map's [inputs]
and [outputs] rename them). It is untrusted input (`read_graph`): each file a regular file within
MAX_FILE bytes (a FIFO, device or folder is refused before a byte is read), parsed by onnx's own
protobuf reader and checked by onnx's checker (its external weights set aside), every external-data
file (`.onnx.data`) a plain name inside the model's own folder, no link, a regular file within
MAX_DATA bytes that holds every tensor's bytes; every file read is hashed. The user's files are
never written: what runs is a copy in the artifact cache (onnx_user.py). The provenance names the
files by their basename and sha256, never the path.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import open_regular

from . import onnx_map as M

OPTION = "--onnx"
STEPS = ("prefill", "decode")  # a folder of the tool's own export: prefill.onnx, decode.onnx
MIN_FILE = 8  # bytes: shorter is no model
MAX_FILE = (2 << 30) - 1  # bytes of one .onnx file (protobuf's own limit is 2 GiB)
MAX_DATA = 64 << 30  # bytes of one external-data file
MAX_EXTERNAL = 1 << 20  # tensors with external data in one graph
BLOCK = 1 << 22


@dataclass
class UserGraph:
    """The user's ONNX file (or the folder of step graphs), read and checked (read_graph)."""

    path: Path  # what the user named (never in the provenance)
    folder: Path  # where its files are
    steps: bool  # a folder of prefill.onnx and decode.onnx (the step-graphs layout)
    models: dict = field(default_factory=dict)  # graph ("prefill", "decode" or "model") -> ModelProto, no weights
    files: dict = field(default_factory=dict)  # file name -> sha256 (the graphs, then their external data)
    stamps: dict = field(default_factory=dict)  # external-data file name -> (size, mtime_ns), checked again
    data: dict = field(default_factory=dict)  # graph -> the external-data file names it reads

    def files_text(self) -> str:
        return ", ".join(f"{one_line(n, 100)} sha256:{h}" for n, h in self.files.items())

    def file_name(self, graph: str) -> str:
        return f"{graph}.onnx" if self.steps else one_line(self.path.name, 100)

    def shown(self) -> str:
        return one_line(self.path.name, 100) + ("/" if self.steps else "")

    def fail(self, why: str):
        fail(self.path, why)

    def mobius_like(self) -> bool:
        """The graph's node names are mobius-onnx's (onnx_map.MOBIUS_NODES): its built-in map fits."""
        model = self.models.get("model")
        names = [n.name for n in model.graph.node] if model is not None else []
        return bool(names) and all(any(n.startswith(p) for n in names) for p in M.MOBIUS_NODES)


def fail(path, why: str):
    raise TraceToolError(f"{OPTION} {one_line(str(path), 200)}: {why}")


def read_graph(path) -> UserGraph:
    """PATH read and checked within bounds (module docstring); one line for anything that is not an
    ONNX graph this replay can take."""
    path = Path(path)
    if not os.path.lexists(path):
        fail(path, "no such file or folder")
    if os.path.isdir(path):
        missing = [f"{g}.onnx" for g in STEPS if not os.path.lexists(path / f"{g}.onnx")]
        if missing:
            fail(path, f"a folder must hold the tool's own export (prefill.onnx and decode.onnx; no {missing[0]}); "
                 "give another graph as one .onnx file")  # fmt: skip
        out = UserGraph(path, path, True)
        for g in STEPS:
            _read_model(out, g, path / f"{g}.onnx")
        return out
    out = UserGraph(path, path.parent, False)
    _read_model(out, "model", path)
    return out


def _read_model(out: UserGraph, graph: str, file: Path) -> None:
    """One .onnx file: regular, within bounds, parsed by onnx, checked, its external data inside its folder."""
    import onnx

    name = out.file_name(graph) if out.steps else "the file"
    with open_regular(file, f"{OPTION}'s {name}" if out.steps else OPTION) as f:  # a FIFO, device, folder: one line
        size = os.fstat(f.fileno()).st_size
        if not MIN_FILE <= size <= MAX_FILE:
            fail(out.path, f"{name} is {size} bytes (an .onnx file: {MIN_FILE} to {MAX_FILE})")
        raw = f.read(MAX_FILE + 1)
    if len(raw) != size:
        fail(out.path, f"{name} changed while it was read")
    out.files[name] = hashlib.sha256(raw).hexdigest()
    try:
        model = onnx.load_model_from_string(raw)
    except Exception as e:  # noqa: BLE001 - protobuf fails on a damaged file in its own ways
        fail(out.path, f"{name} is not an ONNX model ({type(e).__name__}: {one_line(e, 120)})")
    del raw
    g = model.graph
    if not len(g.node) or not len(g.input) or not len(g.output):
        fail(out.path, f"{name} is not an ONNX model of a decoder (a graph without nodes, inputs or outputs)")
    external = _external(out, name, model)
    _check(out, name, model, external)
    out.models[graph] = model
    out.data[graph] = sorted({info[0] for info in external.values()})


def _tensors(graph):
    """Every tensor of a graph: its initializers and the tensors in its nodes' attributes, subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("g"):
                yield from _tensors(a.g)
            for sub in a.graphs:
                yield from _tensors(sub)


def _external(out: UserGraph, name: str, model) -> dict:
    """{tensor name: (file, offset, length)} of the tensors whose bytes are in external-data files,
    each file a plain name in the model's folder (no link, no path), regular, within bounds, hashed,
    holding every tensor's bytes."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    found = {}
    for t in _tensors(model.graph):
        if not uses_external_data(t):
            continue
        if len(found) >= MAX_EXTERNAL:
            fail(out.path, f"{name} has more than {MAX_EXTERNAL} tensors with external data")
        try:
            info = ExternalDataInfo(t)
            offset, length = int(info.offset or 0), info.length
        except Exception:  # noqa: BLE001 - a damaged entry in its own ways
            fail(out.path, f"{name}: tensor {one_line(t.name, 80)!r} has a malformed external-data entry")
        loc = str(info.location or "")
        if not loc or loc in (".", "..") or "/" in loc or "\\" in loc or os.path.isabs(loc) or "\0" in loc:
            fail(out.path, f"{name}: tensor {one_line(t.name, 80)!r} reads {one_line(loc, 80)!r}: external data must "
                 "be a file beside the model, named without a path")  # fmt: skip
        need = _nbytes(t, onnx)
        if length is None:
            length = need
        if offset < 0 or length is None or length < 0 or (need is not None and length != need):
            fail(out.path, f"{name}: tensor {one_line(t.name, 80)!r} has external bytes at {offset}+{length} "
                 f"(its shape needs {need})")  # fmt: skip
        size = _data_file(out, loc)
        if offset + length > size:
            fail(out.path, f"{name}: tensor {one_line(t.name, 80)!r} ends at byte {offset + length} of "
                 f"{one_line(loc, 80)}, which holds {size} (truncated?)")  # fmt: skip
        found[t.name] = (loc, offset, length)
    return found


def _nbytes(t, onnx) -> int | None:
    """A tensor's bytes by its dims and element type (None where its type has no fixed size)."""
    try:
        item = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except Exception:  # noqa: BLE001 - an unknown or string type
        return None
    n = 1
    for d in t.dims:
        if d < 0:
            return None
        n *= int(d)
    return n * item


def _data_file(out: UserGraph, loc: str) -> int:
    """An external-data file beside the model: its size (hashed once, stamped to be checked again)."""
    path = out.folder / loc
    if loc in out.stamps:
        return out.stamps[loc][0]
    try:
        st = os.lstat(path)
    except OSError:
        fail(out.path, f"its external data {one_line(loc, 80)} does not exist beside it")
    if stat.S_ISLNK(st.st_mode):
        fail(out.path, f"its external data {one_line(loc, 80)} is a link (it must be a file in the model's folder)")
    with open_regular(path, f"{OPTION}'s external data") as f:
        st = os.fstat(f.fileno())
        if st.st_size > MAX_DATA:
            fail(out.path, f"its external data {one_line(loc, 80)} is {st.st_size} bytes (at most {MAX_DATA})")
        h = hashlib.sha256()
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    out.files[loc] = h.hexdigest()
    out.stamps[loc] = (st.st_size, st.st_mtime_ns)
    return st.st_size


def _check(out: UserGraph, name: str, model, external: dict) -> None:
    """onnx's checker on the graph, its external weights made inputs (their bytes are checked above)."""
    import onnx

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    g = probe.graph
    if set(external) - {t.name for t in g.initializer}:
        return  # external tensors inside node attributes: the checker would read them; onnxruntime checks at load
    keep = [t for t in g.initializer if t.name not in external]
    moved = [t for t in g.initializer if t.name in external]
    del g.initializer[:]
    g.initializer.extend(keep)
    g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
    try:
        onnx.checker.check_model(probe)
    except Exception as e:  # noqa: BLE001 - the checker's ValidationError, or protobuf's on a damaged graph
        fail(out.path, f"{name} fails onnx's checker ({one_line(str(e).splitlines()[0] if str(e) else e, 160)})")


def unchanged(user: UserGraph, name: str) -> None:
    """An external-data file still as it was read (size and time), before it is copied."""
    size, mtime = user.stamps[name]
    try:
        st = os.lstat(user.folder / name)
    except OSError:
        st = None
    if st is None or (st.st_size, st.st_mtime_ns) != (size, mtime):
        fail(user.path, f"its external data {one_line(name, 80)} changed since it was read")
