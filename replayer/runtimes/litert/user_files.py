"""`trace replay REF --tflite PATH`: the user's own litert-torch export run per layer by the `litert`
runtime's engine (runtime.py) against REF's checkpoint, every kind the built-in export gives
(spec.py's FILES). PATH is a folder of the files `litert_torch.generative.export_hf` writes
(model.tflite, embedder.tflite, per_layer_embedder.tflite; other files are ignored) or a .litertlm
bundle, whose TFLite sections (tf_lite_prefill_decode, tf_lite_embedder, tf_lite_per_layer_embedder)
are extracted within bounds into a private folder and run the same way.

PATH is untrusted input and read before any model loads (`read_files`): each file a regular file
within MAX_FILE bytes, a TFLite flatbuffer read by graph.py's bounded reader, every buffer inside the
file, its signatures those of litert-torch's Gemma 4 export (decode and prefill_N with embeddings,
input_pos, mask and K/V caches laid out (1, heads, S, dim) and (1, heads, dim, S); the embedders'
decode and prefill_N signatures); a bundle's header read within MAX_HEADER bytes with LiteRT-LM's own
schema (litert_lm_builder), each section inside the file; every file read hashed. The signatures'
shapes are then compared with REF's checkpoint config (`differences`: hidden size, vocabulary, layer
count and per-layer width, the layers that write K/V): a difference is one line naming it unless
--allow-config-mismatch; a cache shorter than the replay's rows is always one line.

What loads: a private folder of links to the user's files (sizes and times checked again first), or
the extracted sections; the provenance names the files and their sha256, never the path.
"""

from __future__ import annotations

import atexit
import hashlib
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line
from gemma4_trace.traces.inputs import open_regular
from gemma4_trace.traces.layers import layer_infos_from_config

from . import graph as G

NAME = "litert-files"  # what the provenance calls a replay of the user's files
OPTION = "--tflite"
ROLES = {"model": "model.tflite", "embedder": "embedder.tflite", "per_layer_embedder": "per_layer_embedder.tflite"}
SECTIONS = {"tf_lite_prefill_decode": "model", "tf_lite_embedder": "embedder"}
SECTIONS["tf_lite_per_layer_embedder"] = "per_layer_embedder"
MAX_FILE = 32 << 30  # bytes of one .tflite file or bundle
MIN_FILE = 16  # bytes: shorter is no flatbuffer
MAX_HEADER = 16 << 20  # bytes of a .litertlm header (litert-lm-builder writes about a kilobyte)
MAX_SECTIONS = 256
MAGIC = b"LITERTLM"
TFLITE_SECTION = 3  # litert_lm_builder's AnySectionDataType.TFLiteModel
BLOCK = 1 << 22


@dataclass
class UserFiles:
    """A litert-torch export of the user's, read and checked (read_files): what the replay runs and names."""

    path: Path  # what the user named (never in the provenance)
    folder: Path  # where the .tflite files are: the user's folder, or the bundle's sections extracted
    bundle: bool = False
    files: dict = field(default_factory=dict)  # name -> sha256 (a bundle: the bundle, then its sections)
    stamps: dict = field(default_factory=dict)  # name -> (size, mtime_ns): the user's files, checked again
    sigs: dict = field(default_factory=dict)  # role -> {signature: ({input: shape}, {output: shape})}
    prefill: list = field(default_factory=list)  # the model's prefill lengths
    cache: int = 0  # S: the keys of its mask and caches
    hidden: int = 0
    vocab: int = 0
    caches: int = 0  # the layers that write K/V
    ple: tuple | None = None  # (layers, width) of its per-layer embeddings

    def files_text(self) -> str:
        return ", ".join(f"{one_line(n, 100)} sha256:{h}" for n, h in self.files.items())

    def discard(self) -> None:
        if self.bundle:
            shutil.rmtree(self.folder, ignore_errors=True)


def _fail(path, why: str):
    raise TraceToolError(f"{OPTION} {one_line(str(path), 200)}: {why}")


def read_files(path) -> UserFiles:
    """The files' headers read and checked within bounds (module docstring); one line for anything
    that is not a litert-torch export of Gemma 4."""
    path = Path(path)
    if not os.path.lexists(path):
        _fail(path, "no such file or folder")
    if os.path.isdir(path):
        return _read_folder(path)
    with open_regular(path, OPTION) as f:  # a FIFO, device or socket: one line
        head = f.read(len(MAGIC))
    if head != MAGIC:
        _fail(path, "neither a folder of litert-torch's .tflite files nor a .litertlm bundle")
    return _read_bundle(path)


def _read_folder(path: Path) -> UserFiles:
    out = UserFiles(path, path)
    for name in ("model.tflite", "embedder.tflite"):
        if not os.path.lexists(path / name):
            _fail(path, f"not a litert-torch export folder (no {name}; export_hf writes {', '.join(ROLES.values())})")
    for role, name in ROLES.items():
        if os.path.lexists(path / name):
            _read_tflite(out, role, name)
    _summarise(out)
    return out


def _read_tflite(out: UserFiles, role: str, name: str, shown: str | None = None) -> None:
    """One .tflite file of out.folder: a regular file within bounds, its signatures read by graph.py's
    bounded reader, its buffers inside the file, its bytes hashed (as `shown`: a bundle's section)."""
    where = out.path
    with open_regular(out.folder / name, f"{OPTION}'s {name}") as f:
        st = os.fstat(f.fileno())
        if not MIN_FILE <= st.st_size <= MAX_FILE:
            _fail(where, f"{shown or name} is {st.st_size} bytes (a .tflite file: {MIN_FILE} to {MAX_FILE})")
        try:
            sigs = G.read(shown or name, file=f)
            _check_buffers(f, st.st_size)
        except TraceToolError as e:
            _fail(where, str(e))
        f.seek(0)
        h = hashlib.sha256()
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    out.files[shown or name] = h.hexdigest()
    if not out.bundle:
        out.stamps[name] = (st.st_size, st.st_mtime_ns)
    out.sigs[role] = {
        k: ({a: s.tensors[i].shape for a, i in s.inputs.items()}, {a: s.tensors[i].shape for a, i in s.outputs.items()})
        for k, s in sigs.items()
    }


def _check_buffers(f, size: int) -> None:
    """Every buffer of the flatbuffer inside the file: inline, or at (offset, size) past the flatbuffer."""
    from ai_edge_litert import schema_py_generated as fb

    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        model = fb.Model.GetRootAsModel(buf, 0)
        n = model.BuffersLength()
        if n > G.MAX_ENTRIES:
            raise ValueError(f"{n} buffers, more than {G.MAX_ENTRIES}")
        for i in range(n):
            b = model.Buffers(i)
            if b.Offset() > 1:
                lo, hi = int(b.Offset()), int(b.Offset()) + int(b.Size())
            else:
                lo = b._tab.Vector(b._tab.Offset(4)) if b.DataLength() else 0
                hi = lo + b.DataLength()
            if hi > size:
                raise ValueError(f"buffer {i} ends at byte {hi}, past the end of the file ({size} bytes): truncated?")
    except Exception as e:  # noqa: BLE001 - flatbuffers fails on a hostile file in its own ways
        why = str(e) if isinstance(e, ValueError) and str(e) else type(e).__name__
        raise TraceToolError(f"not a LiteRT model ({why[:160]})") from None
    finally:
        buf.close()


def _shape(out: UserFiles, role: str, sig: str, side: int, name: str) -> tuple:
    shapes = out.sigs[role][sig][side]
    if name not in shapes:
        what = "takes no input" if side == 0 else "returns no output"
        _fail(out.path, f"{ROLES[role]}'s {sig} signature {what} {name!r} (not litert-torch's Gemma 4 export)")
    return tuple(shapes[name])


def _summarise(out: UserFiles) -> None:
    """The export's shapes, read from its signatures, and its files' agreement with each other."""
    model = out.sigs["model"]
    out.prefill = sorted(int(k[8:]) for k in model if k.startswith("prefill_") and k[8:].isdigit())
    if "decode" not in model or not out.prefill:
        _fail(out.path, f"model.tflite has signatures {sorted(model)[:6]}, not litert-torch's decode and prefill_N")
    out.hidden = _shape(out, "model", "decode", 0, "embeddings")[-1]
    out.cache = _shape(out, "model", "decode", 0, "mask")[-1]
    out.vocab = _shape(out, "model", "decode", 1, "logits")[-1]
    ins = out.sigs["model"]["decode"][0]
    out.caches = sum(1 for k in ins if k.startswith(G.K_CACHE))
    for j in range(out.caches):
        k, v = (
            _shape(out, "model", "decode", 0, f"{G.K_CACHE}{j}"),
            _shape(out, "model", "decode", 0, f"kv_cache_v_{j}"),
        )
        if len(k) != 4 or len(v) != 4 or k[2] != out.cache or v[3] != out.cache:
            _fail(
                out.path,
                f"model.tflite's K/V cache {j} is {k} and {v}, not (1, heads, {out.cache}, dim) and "
                f"(1, heads, dim, {out.cache}) (export_hf --k_ts_idx=2 --v_ts_idx=3)",
            )
    if "per_layer_embeddings" in ins:
        out.ple = tuple(ins["per_layer_embeddings"][-2:])
        if "per_layer_embedder" not in out.sigs:
            _fail(out.path, "model.tflite takes per-layer embeddings; there is no per_layer_embedder.tflite")
    for P in out.prefill:
        _shape(out, "model", f"prefill_{P}", 0, "embeddings")
        if _shape(out, "model", f"prefill_{P}", 0, "mask")[-1] != out.cache:
            _fail(out.path, f"model.tflite's prefill_{P} mask is not {out.cache} keys wide, as decode's")
    for role in ("embedder", "per_layer_embedder") if out.ple else ("embedder",):
        for sig in [f"decode_{role}", *(f"prefill_{role}_{P}" for P in out.prefill)]:
            if sig not in out.sigs[role]:
                _fail(out.path, f"{ROLES[role]} has no {sig} signature (model.tflite has prefill {out.prefill})")
            width = next(iter(out.sigs[role][sig][1].values()), ())
            want = (out.hidden,) if role == "embedder" else out.ple
            if tuple(width[-len(want) :]) != want:
                _fail(out.path, f"{ROLES[role]}'s {sig} writes {width}; model.tflite takes {want} a row")


# ------------------------------------------------------------------ a .litertlm bundle
def _read_bundle(path: Path) -> UserFiles:
    """The bundle's TFLite sections, each inside the file, copied into a private folder and read as
    the folder's files are; the bundle's sha256 and each section's."""
    folder = Path(tempfile.mkdtemp(prefix="gemma4-trace-litert-bundle-"))
    atexit.register(shutil.rmtree, folder, True)
    out = UserFiles(path, folder, bundle=True)
    try:
        with open_regular(path, OPTION) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE:
                _fail(path, f"{size} bytes (at most {MAX_FILE})")
            found = _sections(path, f, size)
            h = hashlib.sha256()
            for block in iter(lambda: f.read(BLOCK), b""):
                h.update(block)
            out.files[path.name] = h.hexdigest()
            for role, (_, lo, hi) in found.items():
                _extract(f, lo, hi, folder / ROLES[role])
        for role, (i, _, _) in found.items():
            _read_tflite(out, role, ROLES[role], f"{ROLES[role]} (section {i})")
        _summarise(out)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return out


def _sections(path: Path, f, size: int) -> dict:
    """role -> (section, begin, end) of the bundle's TFLite sections, read with litert-lm-builder's schema."""
    try:
        from litert_lm_builder import litertlm_header_schema_py_generated as S
        from litert_lm_builder import litertlm_peek
    except ImportError:
        _fail(path, f"reading a .litertlm bundle needs litert-lm-builder: {install_hint('litert')}")
    f.seek(0)
    head = f.read(32)
    if len(head) < 32:
        _fail(path, f"{size} bytes, shorter than a .litertlm header")
    (end,) = struct.unpack("<Q", head[24:32])
    if not 32 < end <= min(size, MAX_HEADER):
        _fail(path, f"claims a header ending at byte {end} (at most {min(size, MAX_HEADER)} in this file)")
    data = f.read(end - 32)
    found = {}
    try:
        objects = S.LiteRTLMMetaData.GetRootAs(data, 0).SectionMetadata()
        n = objects.ObjectsLength()
        if n > MAX_SECTIONS:
            raise ValueError(f"{n} sections, more than {MAX_SECTIONS}")
        for i in range(n):
            o = objects.Objects(i)
            lo, hi = int(o.BeginOffset()), int(o.EndOffset())
            if not 0 <= lo <= hi <= size:
                _fail(path, f"section {i} spans bytes {lo} to {hi}, past the end of the file ({size} bytes)")
            role = SECTIONS.get(litertlm_peek.get_model_type(o)) if o.DataType() == TFLITE_SECTION else None
            if role is not None and role not in found:
                found[role] = (i, lo, hi)
    except TraceToolError:
        raise
    except Exception as e:  # noqa: BLE001 - flatbuffers fails on a hostile header in its own ways
        why = str(e) if isinstance(e, ValueError) and str(e) else type(e).__name__
        _fail(path, f"its header is not a .litertlm header ({why[:120]})")
    for role in ("model", "embedder"):
        if role not in found:
            kinds = ", ".join(k for k, r in SECTIONS.items() if r == role)
            _fail(path, f"the bundle has no {kinds} TFLite section (litert-torch's Gemma 4 export writes one)")
    f.seek(0)
    return found


def _extract(f, lo: int, hi: int, dest: Path) -> None:
    f.seek(lo)
    left = hi - lo
    with open(dest, "xb") as w:
        while left:
            block = f.read(min(BLOCK, left))
            if not block:
                raise TraceToolError(f"{OPTION}: the bundle ended inside a section (it changed while read?)")
            w.write(block)
            left -= len(block)


# ------------------------------------------------------------------ against REF
def differences(files: UserFiles, loaded) -> list[str]:
    """Where the export's shapes differ from REF's checkpoint config (its text config)."""
    cfg = loaded.text_config
    infos = layer_infos_from_config(cfg)
    owners = sum(1 for info in infos if info.kv_role != "reuses")
    ple = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
    pairs = [
        ("hidden size", files.hidden, int(cfg.hidden_size)),
        ("vocabulary", files.vocab, int(cfg.vocab_size)),
        ("layers that write K/V", files.caches, owners),
    ]
    if files.ple or ple:
        pairs += [("layers", files.ple[0] if files.ple else None, len(infos))]
        pairs += [("per-layer input width", files.ple[1] if files.ple else None, ple)]
    return [f"{what} {mine} (REF {ref})" for what, mine, ref in pairs if mine != ref]


def check_config(files: UserFiles, loaded, max_seq: int, allow: bool) -> list[str]:
    diffs = differences(files, loaded)
    if diffs and not allow:
        _fail(
            files.path,
            f"does not match REF's model config: {diffs[0]}"
            + (f" and {len(diffs) - 1} more" if len(diffs) > 1 else "")
            + " (--allow-config-mismatch replays it anyway)",
        )
    if files.cache < int(max_seq):
        _fail(files.path, f"its K/V caches hold {files.cache} positions; the replay needs max_seq {max_seq}")
    return diffs


def staged(files: UserFiles) -> Path:
    """The folder the engine loads: the extracted sections, or a private folder of links to the
    user's files, each checked unchanged since it was read."""
    if files.bundle:
        return files.folder
    for name, (size, mtime) in files.stamps.items():
        try:
            st = os.stat(files.path / name)
        except OSError:
            st = None
        if st is None or (st.st_size, st.st_mtime_ns) != (size, mtime):
            _fail(files.path, f"{name} changed since it was read")
    out = Path(tempfile.mkdtemp(prefix="gemma4-trace-litert-files-"))
    for name in files.stamps:
        (out / name).symlink_to((files.path / name).resolve())
    return out
