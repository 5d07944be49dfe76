"""Mixed-precision GGUF files: `--runtime llama.cpp:TYPE` with some units at another precision.

`trace sensitivity` / `trace precision` / `trace replay --recipe` over llama.cpp need files
where a chosen set of units (the quantized static runtimes' units, replayer/recipe.py: a
layer, or a module group of one, by GGUF tensor name) is at another precision than TYPE:

    blk.N.attn_q / attn_k / attn_v      -> layer.N.qkv
    blk.N.attn_output                   -> layer.N.o
    blk.N.ffn_gate / ffn_up / ffn_down  -> layer.N.mlp
    blk.N.inp_gate / proj               -> layer.N.ple     (the per-layer-input gate and projection)
    per_layer_model_proj                -> ple_model_proj

A mixed file is written from the cached conversions (runtime.py `gguf_artifact`): the metadata
and every tensor outside the units from the TYPE file (so "every unit at TYPE" is the TYPE file
itself: the token embeddings and norms stay as llama.cpp's quantizer made them), each unit's
tensors copied as they are, raw quantized bytes included, from the file of its precision
("float": the F32 conversion; another GGUF type: that type's file). Mixed files are cached by
content (replayer/artifacts.py).

A recipe also translates into llama.cpp's quantizer options: one `--tensor-type
NAME_REGEX=ggml_type` per tensor that is not at TYPE (`llama-quantize` matches the pattern with
a regex search in each tensor's name and takes the first pattern that matches).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from gemma4_trace.traces.errors import TraceToolError

from ...artifacts import artifact_folder, code_digest, key_digest, model_hash
from . import gguf_writer as GW
from .runtime import GGUF_NAME, WRITER_CODE, LlamaCppRuntime, gguf_artifact

MIXED_NAME = "mixed.gguf"
_TENSOR = re.compile(
    r"^blk\.(0|[1-9][0-9]*)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down|inp_gate|proj)\.weight$"
)
_MODULE = {
    "attn_q": "qkv",
    "attn_k": "qkv",
    "attn_v": "qkv",
    "attn_output": "o",
    "ffn_gate": "mlp",
    "ffn_up": "mlp",
    "ffn_down": "mlp",
    "inp_gate": "ple",
    "proj": "ple",
}


def tensor_unit(name: str) -> tuple[str, str] | None:
    """(layer unit, module unit) of a GGUF tensor, or None for a tensor outside the units."""
    if name == "per_layer_model_proj.weight":
        return "ple_model_proj", "ple_model_proj"
    m = _TENSOR.match(name)
    if m is None:
        return None
    return f"layer.{m[1]}", f"layer.{m[1]}.{_MODULE[m[2]]}"


def read_tensors(path) -> dict:
    """{name: ReaderTensor} of a GGUF file, in file order."""
    gguf = GW.gguf_module()
    try:
        return {t.name: t for t in gguf.GGUFReader(path).tensors}
    except (ValueError, OSError) as e:
        raise TraceToolError(f"{path}: cannot read the GGUF file ({type(e).__name__}: {e})") from None


def units_of(path) -> dict:
    """{module unit: (layer unit, [tensor names])} of a converted file, in file order."""
    out: dict = {}
    for name in read_tensors(path):
        u = tensor_unit(name)
        if u is not None:
            out.setdefault(u[1], (u[0], []))[1].append(name)
    return out


def _copy_metadata(w, reader) -> None:
    gguf = GW.gguf_module()
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue  # the writer writes the header and the architecture itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub)


def write_mixed(files: dict, default: str, precision_of: dict, out) -> None:
    """Write `out`: `files[default]`'s metadata and tensors, each tensor named in `precision_of`
    {tensor name: precision} taken from `files[precision]` instead, bytes as they are."""
    gguf = GW.gguf_module()
    base = gguf.GGUFReader(files[default])
    others = {p: read_tensors(files[p]) for p in set(precision_of.values()) - {default}}
    arch = base.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(str(out), arch)
    _copy_metadata(w, base)
    for t in base.tensors:
        p = precision_of.get(t.name, default)
        src = t if p == default else others[p][t.name]
        data = np.asarray(src.data)
        if src.tensor_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=src.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class MixedFiles:
    """The cached conversions of one model, and mixed files built from them on demand; close()
    lets go of them (a temporary folder, with the cache off, is removed)."""

    def __init__(self, loaded, gguf_type: str):
        self.loaded, self.gguf_type = loaded, gguf_type
        self.artifacts: dict = {}  # precision or mixed file's key digest -> Artifact
        self.units = units_of(self.file("float"))

    def file(self, precision: str) -> Path:
        """The converted file of a precision ("float" = F32, or a GGUF type name)."""
        if precision not in self.artifacts:
            self.artifacts[precision] = gguf_artifact(self.loaded, "F32" if precision == "float" else precision)
        return self.artifacts[precision].path / GGUF_NAME

    def tensor_precisions(self, cfg: dict) -> dict:
        """{tensor name: precision} of the tensors whose unit is not at the runtime's TYPE."""
        return {name: p for unit, p in cfg.items() if p != self.gguf_type for name in self.units[unit][1]}

    def path(self, cfg: dict) -> Path:
        """The GGUF of a module-level configuration {module unit: precision}: the TYPE file
        when every unit is at TYPE, else a mixed file (built once, cached by content)."""
        precisions = self.tensor_precisions(cfg)
        if not precisions:
            return self.file(self.gguf_type)
        files = {p: self.file(p) for p in {self.gguf_type, *precisions.values()}}
        key = {
            "model": model_hash(self.loaded.model_dir),
            "type": self.gguf_type,
            "tensors": sorted(precisions.items()),
            "code": code_digest(WRITER_CODE, "runtimes/llamacpp/gguf_mixed.py"),
        }
        name = key_digest(key)
        if name not in self.artifacts:
            self.artifacts[name] = artifact_folder(
                "gguf-mixed",
                key,
                lambda folder: write_mixed(files, self.gguf_type, precisions, folder / MIXED_NAME),
                say=None,
            )
        return self.artifacts[name].path / MIXED_NAME

    def close(self) -> None:
        for art in self.artifacts.values():
            art.close()
        self.artifacts = {}

    def tensor_bytes(self, cfg: dict) -> int:
        """Bytes of every tensor of the configuration's file (what llama.cpp loads)."""
        precisions = self.tensor_precisions(cfg)
        base = read_tensors(self.file(self.gguf_type))
        others = {p: read_tensors(self.file(p)) for p in set(precisions.values())}
        return sum(int((others[precisions[n]][n] if n in precisions else t).n_bytes) for n, t in base.items())

    def weight_errors(self, cfg: dict) -> dict:
        """{module unit: rel-L2 of its dequantized weights against float} under cfg (None where float)."""
        gguf = GW.gguf_module()
        f32 = read_tensors(self.file("float"))
        out = {}
        for unit, (_, names) in self.units.items():
            p = cfg.get(unit, self.gguf_type)
            if p == "float":
                out[unit] = None
                continue
            q = read_tensors(self.file(p))
            num = den = 0.0
            for n in names:
                ref = np.asarray(f32[n].data, dtype=np.float64).reshape(-1)
                got = gguf.quants.dequantize(np.asarray(q[n].data), q[n].tensor_type).astype(np.float64).reshape(-1)
                num += float(np.sum((got - ref) ** 2))
                den += float(np.sum(ref**2))
            out[unit] = (num / den) ** 0.5 if den > 0 else 0.0
        return out

    def quantize_options(self, cfg: dict) -> list[str]:
        """llama-quantize options giving each tensor not at TYPE its type in the mixed file."""
        lines = []
        for name, p in self.tensor_precisions(cfg).items():
            ggml = "f32" if p == "float" else read_tensors(self.file(p))[name].tensor_type.name.lower()
            lines.append(f"--tensor-type {re.escape(name)}={ggml}")
        return lines


def recipe_runtime(loaded, max_seq: int, gguf_type: str, units: dict):
    """`trace replay --runtime llama.cpp:TYPE --recipe R`: llama.cpp on the recipe's mixed file
    (units: the recipe's {unit: precision})."""
    mixed = MixedFiles(loaded, gguf_type)
    try:
        rt = LlamaCppRuntime(
            loaded, max_seq, gguf_type=gguf_type, user_file=mixed.path(resolve(mixed, units, gguf_type))
        )
    except BaseException:
        mixed.close()
        raise
    rt.artifact = mixed  # closed with the runtime
    rt.name = rt.name.replace(f"llama.cpp:{MIXED_NAME} ({gguf_type})", f"llama.cpp:{gguf_type}+recipe", 1)
    return rt


def resolve(mixed: MixedFiles, units: dict, default: str) -> dict:
    """A recipe's {unit: precision} as {module unit: precision} over the file's units."""
    known = {u for mu, (lu, _) in mixed.units.items() for u in (mu, lu)}
    for unit in units:
        if unit not in known:
            raise TraceToolError(
                f"recipe unit {unit!r} is not a unit of this model's GGUF (e.g. layer.0, layer.0.qkv, layer.0.o, "
                "layer.0.mlp, layer.0.ple, ple_model_proj)"
            )
    return {mu: units.get(mu, units.get(lu, default)) for mu, (lu, _) in mixed.units.items()}


def from_recipe(loaded, max_seq: int, choice, units: dict):
    """A precision recipe's runtime (the registry's `recipe` facet): llama.cpp:TYPE on the mixed file."""
    return recipe_runtime(loaded, max_seq, choice.type, units)
