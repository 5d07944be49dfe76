"""`trace replay REF --mlx-model DIR`: the user's own mlx-lm folder (a community conversion, or one
made with `mlx_lm.convert -q`) run by the `mlx` runtime's engine against REF's checkpoint, every kind
the `mlx` runtime captures; `--mlx-model-dq DIR`: the same folder's quantized weights dequantized
into float32 layers, its `--baseline` (mlx_spec.py's FILES).

The folder is untrusted input and read before any model loads (`read_folder`): config.json within
hf/config_check.py's bound and checks, a Gemma 4 model type, mlx-lm's own quantization (bits, group
size, mode, the layers it skipped or set otherwise) and no `model_file` (code mlx-lm would run); each
`model*.safetensors` (what mlx-lm loads) a regular file whose header is read within bounds (its
size, JSON, every tensor's dtype, shape and offsets inside the file); every file read hashed. Its
config is then compared with REF's checkpoint config (`check_config`): a difference in the fields
that set the computation is refused in one line naming the field, unless --allow-config-mismatch.

What loads: a private folder with the config fixed for mlx-lm (mlx.py's fixed_config) and links to
the folder's weight files, whose sizes and times are checked again first; mlx-lm's `load_model`
quantizes the modules its config says, at the folder's own bits and group size. The vision and
audio towers come from REF's checkpoint (mlx-lm's conversion drops them), as the `mlx` runtime's.
The provenance names the folder's files and their sha256, never its path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.hf import config_check
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import open_regular

from .mlx import MLXEngine, MLXRuntime, fixed_config, staged_checkpoint

ENGINE = "gemma4_trace.replayer.runtimes.mlx_folder:FolderEngine"
NAME = "mlx-folder"  # what the provenance calls a user's folder's run (its -dq: NAME-dq)
WEIGHTS = "model*.safetensors"  # what mlx-lm's load_model reads
INDEX = "model.safetensors.index.json"
MAX_FILES = 4096  # weight files in one folder
MAX_HEADER = 100 << 20  # safetensors' own bound on a header's JSON
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4}
DTYPES |= {"U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
BITS, GROUPS, MODES = (2, 3, 4, 5, 6, 8), (32, 64, 128), ("affine", "mxfp4", "mxfp8", "nvfp4")
# the text config fields that set what the model computes (compared with REF's, after mlx.py's fixes)
FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "num_global_key_value_heads",
    "vocab_size",
    "vocab_size_per_layer_input",
    "hidden_size_per_layer_input",
    "num_kv_shared_layers",
    "sliding_window",
    "final_logit_softcapping",
    "layer_types",
)


@dataclass
class Folder:
    """An mlx-lm folder read and checked (read_folder): what the replay loads and names."""

    path: Path
    config: dict  # config.json as read
    weights: list[str]  # the model*.safetensors files' names
    quantization: dict | None  # mlx-lm's: bits, group_size, mode, and per-module settings
    tensors: int = 0
    files: dict = field(default_factory=dict)  # name -> sha256 (config.json, the index, the weights)
    stamps: dict = field(default_factory=dict)  # name -> (size, mtime_ns): checked again before it loads

    def quant_text(self) -> str:
        q = self.quantization
        if q is None:
            return "not quantized"
        special = [k for k, v in q.items() if isinstance(v, (dict, bool))]
        skipped = sum(1 for k in special if q[k] is False)
        other = len(special) - skipped
        more = (f", {skipped} modules kept float" if skipped else "") + (f", {other} set otherwise" if other else "")
        return f"{q['bits']}-bit {q.get('mode', 'affine')}, group size {q['group_size']}{more}"

    def files_text(self) -> str:
        return ", ".join(f"{one_line(n, 100)} sha256:{h}" for n, h in sorted(self.files.items()))


def _fail(path, why: str):
    raise TraceToolError(f"--mlx-model {one_line(str(path), 200)}: {why}")


def read_folder(path) -> Folder:
    """The folder's config and weight headers, read and checked within bounds (module docstring);
    one line for anything that is not a Gemma 4 mlx-lm folder."""
    path = Path(path)
    if not os.path.lexists(path):
        _fail(path, "no such folder")
    if not os.path.isdir(path) or not os.access(path, os.R_OK | os.X_OK):
        _fail(path, "not a folder (an mlx-lm folder: config.json and model*.safetensors)")
    if not os.path.lexists(path / "config.json"):
        _fail(path, "not an mlx-lm folder (no config.json)")
    folder = Folder(path, {}, [], None)
    folder.files["config.json"], raw = _read_hashed(path, "config.json", config_check.MAX_CONFIG_BYTES)
    config = _config(path, raw)
    folder.config, folder.quantization = config, _quantization(path, config)
    names = sorted(p.name for p in path.glob(WEIGHTS))
    if not names:
        _fail(path, f"not an mlx-lm folder (no {WEIGHTS})")
    if len(names) > MAX_FILES:
        _fail(path, f"{len(names)} weight files (at most {MAX_FILES})")
    for name in names:
        folder.tensors += _read_weights(path, name, folder)
    folder.weights = names
    if os.path.lexists(path / INDEX):
        folder.files[INDEX], raw = _read_hashed(path, INDEX, config_check.MAX_CONFIG_BYTES)
        _check_index(path, raw, names)
    return folder


def _read_hashed(folder: Path, name: str, limit: int) -> tuple[str, bytes]:
    """(sha256, bytes) of a small file of the folder, a regular file within `limit` bytes."""
    with open_regular(folder / name, f"--mlx-model's {name}") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            _fail(folder, f"{name} is {size} bytes (at most {limit})")
        raw = f.read(limit + 1)[:limit]
    return hashlib.sha256(raw).hexdigest(), raw


def _config(path: Path, raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except RecursionError:
        _fail(path, "config.json is nested too deeply to be a model config")
    except ValueError as e:
        _fail(path, f"config.json is not readable JSON ({one_line(e, 120)})")
    config_check.check(config, f"--mlx-model {one_line(str(path), 200)}/config.json")
    kind = config.get("model_type")
    if kind not in ("gemma4", "gemma4_text"):
        _fail(path, f"config.json's model_type is {one_line(repr(kind), 60)}, not a Gemma 4 model (gemma4)")
    if "model_file" in config:
        _fail(path, "config.json names a model_file (code mlx-lm would import and run); it is not run")
    return config


def _quantization(path: Path, config: dict) -> dict | None:
    """mlx-lm's quantization settings (`quantization`, or `quantization_config` of the same form)."""
    q = config.get("quantization", config.get("quantization_config"))
    if q is None:
        return None
    if not isinstance(q, dict) or "quant_method" in q:
        _fail(path, "config.json's quantization is not mlx-lm's (bits, group_size, mode)")
    for key, allowed in (("bits", BITS), ("group_size", GROUPS)):
        if q.get(key) not in allowed or isinstance(q.get(key), bool):
            _fail(path, f"config.json's quantization {key} is {one_line(repr(q.get(key)), 40)} (mlx-lm: {allowed})")
    if q.get("mode", "affine") not in MODES:
        _fail(path, f"config.json's quantization mode is {one_line(repr(q.get('mode')), 40)} (mlx-lm: {MODES})")
    for module, v in q.items():
        if module in ("bits", "group_size", "mode"):
            continue
        ok = v is False or (isinstance(v, dict) and v.get("bits") in BITS and v.get("group_size") in GROUPS)
        if not ok:
            _fail(
                path,
                f"config.json's quantization of {one_line(module, 80)!r} is not mlx-lm's (false or bits, group_size)",
            )
    return q


def _read_weights(folder: Path, name: str, out: Folder) -> int:
    """One safetensors file: a regular file, its header read within bounds and every tensor inside
    the file, its bytes hashed; the number of tensors."""
    where = f"{name}"
    with open_regular(folder / name, f"--mlx-model's {name}") as f:  # a FIFO, device or folder: one line
        st = os.fstat(f.fileno())
        if st.st_size < 8:
            _fail(folder, f"{where} is {st.st_size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if not 2 <= n <= min(MAX_HEADER, st.st_size - 8):
            _fail(folder, f"{where} claims a {n}-byte header (at most {min(MAX_HEADER, st.st_size - 8)} in this file)")
        head = f.read(n)
        try:
            table = json.loads(head)
        except (ValueError, RecursionError):
            _fail(folder, f"{where}'s header is not readable JSON (not a safetensors file)")
        if not isinstance(table, dict):
            _fail(folder, f"{where}'s header is not a JSON object (not a safetensors file)")
        data = st.st_size - 8 - n
        for key, t in table.items():
            if key == "__metadata__":
                continue
            _check_tensor(folder, where, key, t, data)
        h = hashlib.sha256(struct.pack("<Q", n) + head)
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    out.files[name], out.stamps[name] = h.hexdigest(), (st.st_size, st.st_mtime_ns)
    return len(table) - ("__metadata__" in table)


def _check_tensor(folder: Path, where: str, key: str, t, data: int) -> None:
    name = one_line(repr(key), 80)
    if not isinstance(t, dict) or t.get("dtype") not in DTYPES:
        _fail(folder, f"{where}: tensor {name} has no known dtype")
    shape, offsets = t.get("shape"), t.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
        _fail(folder, f"{where}: tensor {name} has shape {one_line(repr(shape), 60)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        _fail(folder, f"{where}: tensor {name} has data_offsets {one_line(repr(offsets), 60)}")
    a, b = offsets
    if not 0 <= a <= b <= data or b - a != math.prod(shape) * DTYPES[t["dtype"]]:
        _fail(folder, f"{where}: tensor {name} lies outside the file's {data} data bytes (truncated?)")


def _check_index(folder: Path, raw: bytes, names: list[str]) -> None:
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError):
        _fail(folder, f"{INDEX} is not readable JSON")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        _fail(folder, f"{INDEX} has no weight_map")
    missing = sorted({str(v) for v in weight_map.values()} - set(names))
    if missing:
        _fail(folder, f"{INDEX} names {one_line(missing[0], 100)}, which the folder lacks")


# ------------------------------------------------------------------ against REF
def _text(cfg: dict) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def config_differences(folder: Folder, loaded) -> list[str]:
    """The fields (FIELDS) where the folder's text config differs from REF's, both as mlx-lm reads them."""
    ref, _ = fixed_config(config_check.load(Path(loaded.model_dir) / "config.json"))
    mine, _ = fixed_config(folder.config)
    a, b = _text(mine), _text(ref)
    return [
        f"{k} {one_line(repr(a.get(k)), 60)} (REF {one_line(repr(b.get(k)), 60)})"
        for k in FIELDS
        if a.get(k) != b.get(k)
    ]


def check_config(folder: Folder, loaded, allow: bool) -> list[str]:
    diffs = config_differences(folder, loaded)
    if diffs and not allow:
        raise TraceToolError(
            f"--mlx-model {one_line(str(folder.path), 200)} does not match REF's model config: {diffs[0]}"
            + (f" and {len(diffs) - 1} more" if len(diffs) > 1 else "")
            + " (--allow-config-mismatch replays it anyway)"
        )
    return diffs


def staged_folder(folder: Folder) -> tuple[Path, list[str]]:
    """A private folder mlx-lm loads: the fixed config.json (mlx-lm's `quantization` key set from
    `quantization_config` where only that is given) and links to the weight files, each checked
    unchanged since it was read."""
    for name, (size, mtime) in folder.stamps.items():
        try:
            st = os.stat(folder.path / name)
        except OSError:
            st = None
        if st is None or (st.st_size, st.st_mtime_ns) != (size, mtime):
            _fail(folder.path, f"{name} changed since it was read")
    cfg, fixes = fixed_config(folder.config)
    if folder.quantization is not None:
        cfg["quantization"] = folder.quantization
    out = Path(tempfile.mkdtemp(prefix="gemma4-trace-mlx-folder-"))
    (out / "config.json").write_text(json.dumps(cfg))
    for name in folder.weights:
        (out / name).symlink_to((folder.path / name).resolve())
    return out, fixes


# ------------------------------------------------------------------ the runtime
def run_folder(loaded, max_seq: int, header: Folder, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --mlx-model DIR`: mlx-lm on the user's folder as it is."""
    notes = check_config(header, loaded, allow_config_mismatch)
    return FolderRuntime(loaded, max_seq, header, notes, False, choice)


def run_folder_dq(loaded, max_seq: int, header: Folder, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --mlx-model-dq DIR`: the folder's quantized weights dequantized (its --baseline)."""
    if header.quantization is None:
        _fail(header.path, "holds no quantized weights (no quantization in config.json): replay it with --mlx-model")
    notes = check_config(header, loaded, allow_config_mismatch)
    return FolderRuntime(loaded, max_seq, header, notes, True, choice)


class FolderRuntime(MLXRuntime):
    """The mlx runtime's engine on a user's folder: its text model from the folder, the towers from REF's."""

    def __init__(self, loaded, max_seq: int, folder: Folder, notes: list[str], dequantize: bool, choice=None):
        from importlib.metadata import version

        self.mode = NAME + ("-dq" if dequantize else "")
        self.capture = None if choice is None else choice.capture
        self.config, self.model_key = loaded.model.config, str(Path(loaded.model_dir).resolve())
        self.folder, _ = staged_checkpoint(Path(loaded.model_dir))  # the towers' weights: REF's
        self.user = None
        try:
            self.user, fixes = staged_folder(folder)
            v = {p: version(p) for p in ("mlx", "mlx-lm")}
            label = f"{self.mode} {one_line(folder.path.name, 100)} (mlx {v['mlx']}, mlx-lm {v['mlx-lm']})"
            print(
                f"{self.mode}: loading {one_line(folder.path.name, 100)} with mlx-lm ({folder.quant_text()})",
                file=sys.stderr,
            )
            child = self.start(label, ENGINE, streams=True)
            kinds = None if self.capture is None else sorted(self.capture)
            info = child.call("load_folder", str(self.user), str(self.folder), dequantize, kinds, phase="loading")[1]
        except BaseException:
            self.close()
            raise
        what = folder.quant_text() + (", dequantized into float32 weights" if dequantize else "")
        kept = f"; {info['quantized']} layers quantized, {info['kept']} kept float" if folder.quantization else ""
        more = "".join(f"; config differs from REF: {d}" for d in notes)
        self.fixed = f"; config fixed: {'; '.join(fixes)}" if fixes else ""
        self.head = f"{label[:-1]}, CPU; {what}{kept}; files: {folder.files_text()}{more}"
        self.name = f"{self.head}{self.fixed})"

    def close(self) -> None:
        super().close()
        if getattr(self, "user", None):
            shutil.rmtree(self.user, ignore_errors=True)


class FolderEngine(MLXEngine):
    """MLXEngine with ("load_folder", folder, towers, dequantize, kinds): mlx-lm's model from a
    quantized (or float) folder as its config says, dequantized where asked; the vision and audio
    towers later loaded from `towers` (REF's checkpoint)."""

    def handle(self, command: str, *args):
        if command == "load_folder":
            return self._load_folder(*args)
        return super().handle(command, *args)

    def _load_folder(self, folder: str, towers: str, dequantize: bool, kinds):
        model, _ = self.U.load_model(Path(folder))
        modules = [m for _, m in model.named_modules()]
        info = {"quantized": sum(hasattr(m, "scales") for m in modules)}
        info["kept"] = sum(isinstance(m, self.nn.Linear) and not hasattr(m, "scales") for m in modules)
        if dequantize:
            self._dequantize(model)
        self.model, self.cache, self.offset = model, model.make_cache(), 0
        self.folder, self.kinds = Path(towers), None if kinds is None else frozenset(kinds)
        self._tap(model, self.kinds)
        return ("ready", info)


def save_conversion(model_dir, bits: int | None, out) -> Path:
    """The `mlx`/`mlx-qN` runtime's own conversion of a checkpoint, saved as an mlx-lm folder at
    `out` (run in-process: it imports mlx): REF's checkpoint staged as the runtime stages it, loaded
    by mlx-lm and quantized by its quantize_model at `bits` (None: float32), as the child does."""
    import mlx_lm.utils as U

    from .mlx import GROUP

    staged, _ = staged_checkpoint(Path(model_dir))
    try:
        model, config = U.load_model(staged)
        if bits is not None:
            model, config = U.quantize_model(model, config, GROUP, bits)
        U.save_model(Path(out), model)
        U.save_config(config, Path(out) / "config.json")
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return Path(out)
