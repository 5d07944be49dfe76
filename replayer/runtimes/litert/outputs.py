"""A variant of a LiteRT model.tflite whose signatures also return chosen tensors: the taps of the
kinds a `--kinds` replay keeps, added to each signature's subgraph outputs and to its SignatureDef
as `tap_<tensor index>`. The interpreter then runs without experimental_preserve_all_tensors
(which makes XNNPACK run op by op): only the tensors asked for are kept from fusion.

The file is rewritten with LiteRT's own flatbuffer schema (`ai_edge_litert.schema_py_generated`,
object API) as a skeleton: every buffer of more than INLINE_MAX bytes is written after the
flatbuffer and named by (offset, size), as the converter does for files above 2 GiB (and as their
large custom options are), so the object API never copies a weight: the bytes are copied from the
source file block by block (memory: the flatbuffer's tables, not the weights). Nothing is trusted
beyond graph.py's checks: every index, offset and size is checked against the file.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.inputs import sha256_file

from ...artifacts import MANIFEST, artifact_folder, code_digest

ALIGN = 64  # each moved buffer starts at a multiple of this (the converter's own alignment is 16)
INLINE_MAX = 1024  # bytes: a buffer this small stays inside the flatbuffer (metadata, scalars)
BLOCK = 1 << 24  # bytes copied at a time


def output_name(index: int) -> str:
    """The SignatureDef output that returns tensor `index` of the signature's subgraph."""
    return f"tap_{int(index)}"


def tapped(source, kinds, wanted: dict[str, list[int]]):
    """The artifact holding source's model.tflite (`source`: its artifact) with the tensors
    `wanted` ({signature: [tensor index]}, graph.py's taps of `kinds`) as extra outputs."""
    src = Path(source.path) / "model.tflite"
    key = {
        "source": _content_digest(Path(source.path)),
        "kinds": sorted(kinds),
        "outputs": {sig: sorted({int(i) for i in idx}) for sig, idx in sorted(wanted.items())},
        "code": code_digest("runtimes/litert/outputs.py"),
    }

    def build(folder: Path) -> None:
        add_outputs(src, folder / "model.tflite", wanted)

    what = f"adding the {', '.join(sorted(kinds))} tensors to model.tflite's outputs"
    return artifact_folder("litert-outputs", key, build, what=what)


def _content_digest(folder: Path) -> str:
    """sha256 of folder's model.tflite: from the artifact's manifest (hashed again when the
    artifact was handed out), else from the file itself (the cache off)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        digest = json.loads((folder / MANIFEST).read_text())["files"]["model.tflite"]["sha256"]
        if isinstance(digest, str):
            return digest
    return sha256_file(folder / "model.tflite")


def add_outputs(src, dst, wanted: dict[str, list[int]]) -> None:
    """Write src with each signature of `wanted` also returning its tensors (output_name)."""
    from ai_edge_litert import schema_py_generated as fb

    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    if mm is None:
        raise TraceToolError(f"{src}: not a LiteRT model (empty)")
    try:
        skeleton, segments = _rewrite(src, mm, wanted, fb)
        _write(dst, skeleton, segments, mm)
    finally:
        with contextlib.suppress(BufferError):  # a numpy view still alive: the mapping goes with it
            mm.close()


def _rewrite(src, mm, wanted, fb) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The new flatbuffer and the bytes to write after it: (source start, length, new offset)."""
    try:
        if len(mm) < 8 or not fb.Model.ModelBufferHasIdentifier(mm, 0):
            raise ValueError("no TFL3 identifier")
        raw = fb.Model.GetRootAsModel(mm, 0)
        if raw.ExternalBuffersLength() or raw.ExternalBufferGroupsLength():
            raise ValueError("it names external weight files")
        places = [_place(raw.Buffers(i), len(mm)) for i in range(raw.BuffersLength())]
        model = fb.ModelT.InitFromObj(raw)
        _add(model, wanted)
        model.buffers = [fb.BufferT() for _ in places]  # the object API's views of the weights dropped
        moved = []  # (object, start, length): bytes written after the flatbuffer, named by offset and size
        for b, p in zip(model.buffers, places):
            if p is not None and p[1] <= INLINE_MAX and p[2]:  # small and inline: stays
                b.data = bytes(mm[p[0] : p[0] + p[1]])
            elif p is not None:
                moved.append((b, p[0], p[1]))
        for op in (op for sg in model.subgraphs or [] for op in sg.operators or []):
            if op.largeCustomOptionsOffset > 1:  # custom options past the flatbuffer (files above 2 GiB)
                moved.append((op, *_span(op.largeCustomOptionsOffset, op.largeCustomOptionsSize, len(mm))))
        for obj, _, n in moved:  # stand-ins: the table's layout is the same for any nonzero offset
            _set(obj, 2, n)
        first = _pack(model)
        at, segments, seen = _align(len(first)), [], {}
        for obj, start, n in moved:
            if (start, n) not in seen:
                seen[(start, n)] = at
                segments.append((start, n, at))
                at = _align(at + n)
            _set(obj, seen[(start, n)], n)
        skeleton = _pack(model)
        if len(skeleton) != len(first):
            raise ValueError("its flatbuffer changed size when the offsets were set")
        return skeleton, segments
    except TraceToolError:
        raise
    except Exception as e:  # noqa: BLE001 - a file that is no .tflite fails in flatbuffers' own ways
        why = str(e) if isinstance(e, ValueError) and str(e) else type(e).__name__
        raise TraceToolError(f"{src}: cannot add outputs to this LiteRT model ({why[:120]})") from None


def _place(b, size: int) -> tuple[int, int, bool] | None:
    """Where buffer b's bytes lie in the file: (start, length, inline), or None when it has none."""
    if b.Offset() > 1:
        return (*_span(b.Offset(), b.Size(), size), False)
    if b.DataLength():
        return (*_span(b._tab.Vector(b._tab.Offset(4)), b.DataLength(), size), True)
    return None


def _span(start, n, size: int) -> tuple[int, int]:
    start, n = int(start), int(n)
    if start < 0 or n < 0 or start + n > size:
        raise ValueError("a buffer lies past the end of the file")
    return start, n


def _set(obj, offset: int, n: int) -> None:
    if hasattr(obj, "largeCustomOptionsOffset"):
        obj.largeCustomOptionsOffset, obj.largeCustomOptionsSize = offset, n
    else:
        obj.offset, obj.size = offset, n


def _add(model, wanted: dict[str, list[int]]) -> None:
    """Append each wanted tensor to its signature's subgraph outputs and SignatureDef outputs."""
    from ai_edge_litert import schema_py_generated as fb

    sigs = {(sd.signatureKey or b"").decode(errors="replace"): sd for sd in model.signatureDefs or []}
    for key, indexes in wanted.items():
        sd = sigs.get(key)
        if sd is None or not 0 <= sd.subgraphIndex < len(model.subgraphs or []):
            raise ValueError(f"no signature {key[:40]!r}")
        sg = model.subgraphs[sd.subgraphIndex]
        outs = [int(i) for i in (sg.outputs if sg.outputs is not None else [])]
        names = {(m.name or b"").decode(errors="replace") for m in sd.outputs or []}
        sd.outputs = list(sd.outputs or [])
        for i in sorted({int(i) for i in indexes}):
            if not 0 <= i < len(sg.tensors or []):
                raise ValueError(f"signature {key[:40]!r} has no tensor {i}")
            if output_name(i) in names:
                raise ValueError(f"signature {key[:40]!r} already returns {output_name(i)}")
            if i not in outs:
                outs.append(i)
            sd.outputs.append(fb.TensorMapT(name=output_name(i).encode(), tensorIndex=i))
        sg.outputs = outs


def _pack(model) -> bytes:
    import flatbuffers

    builder = flatbuffers.Builder(1 << 20)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def _write(dst, skeleton: bytes, segments, mm) -> None:
    with open(dst, "wb") as f:
        f.write(skeleton)
        for start, n, at in segments:
            f.write(b"\0" * (at - f.tell()))
            for lo in range(start, start + n, BLOCK):
                f.write(mm[lo : min(lo + BLOCK, start + n)])
