"""REF's checkpoint as LiteRT files: litert-torch's Gemma 4 export, litert-quantizer's recipes, and
the dequantized baselines, each kept in the artifact cache (replayer/artifacts.py).

    export      python -m litert_torch.generative.export_hf MODEL OUT --prefill_lengths=P
                --cache_length=S --externalize_embedder=True --k_ts_idx=2 --v_ts_idx=3 ...
                -> embedder.tflite, per_layer_embedder.tflite, model.tflite, model.litertlm
    quantize    litert-quantizer's recipe on model.tflite (the embedders stay float32)
    dequantize  the float model.tflite with each quantized weight written back into it as
                float32 (scale * (q - zero_point), per channel): the same graph and float
                kernels, the quantized weights; the `--baseline` of a quantized replay
    vision      python -m gemma4_trace.replayer.runtimes.litert.export vision MODEL OUT SOFT
                -> vision_encoder.tflite (signature vision_SOFT: images (1, SOFT k^2, 3 p^2) and
                positions_xy -> features (1, SOFT, hidden), mask (1, SOFT)) and vision_adapter.tflite
                (vision_adapter_SOFT: features -> mm_embedding (1, SOFT, text hidden)): what
                `export_hf --export_vision_encoder` runs (litert-torch's load_model, in its Gemma 4
                patch context, its exportable modules and converter), the encoder alone and the
                adapter given the tower's hidden size as its sample width (adapter_note)

Both tools run in a child process (their imports pull TensorFlow; a failure is one line). The
export refuses Gemma 4 without --externalize_embedder and imports TensorFlow Lite's schema module
(`tensorflow.lite.python.schema_py_generated`), which the [litert] extra installs with
tensorflow-cpu; litert-torch does not depend on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from gemma4_trace.traces.errors import TraceToolError, install_hint

from ...artifacts import artifact_folder, code_digest, model_hash, staged_checkpoint
from ...child import signal_words

FORMAT = 1  # bump when the files' layout or the export flags change meaning (the cache key holds it)
FILES = ("embedder.tflite", "per_layer_embedder.tflite", "model.tflite")
BUNDLE = "model.litertlm"
K_AXIS, V_AXIS = 2, 3  # the cache axis that holds positions: K (1, KV, S, D), V transposed (1, KV, D, S)
# --runtime name -> litert-quantizer's recipe (litert_quantizer.recipe.NAME())
RECIPES = {
    "litert-int8": "dynamic_wi8_afp32",
    "litert-wi8": "weight_only_wi8_afp32",
    "litert-int4": "dynamic_wi4_afp32",
}
VISION_FILES = ("vision_encoder.tflite", "vision_adapter.tflite")
VISION_FORMAT = 1  # bump when the vision files' layout or the way they are exported changes
PACKAGES = ("litert-torch", "ai-edge-litert", "litert-quantizer", "tensorflow-cpu")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "GLOG_minloglevel": "3", "TQDM_DISABLE": "1"}


def versions() -> dict:
    """The releases the files depend on; one line when the [litert] extra is not installed."""
    out = {}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            raise TraceToolError(f"--runtime litert needs {p}: {install_hint('litert')}") from None
    return out


def cache_length(max_seq: int, prefill: int) -> int:
    """The export's cache length: max_seq rounded up to whole prefill chunks, so that every chunk's
    rows (a prefill writes all P of them, padding included) fit in the cache."""
    return -(-int(max_seq) // int(prefill)) * int(prefill)


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b")


def run_tool(args: list[str], what: str, cwd=None) -> None:
    """A tool in a child process; its failure is one line: the exception it ended with (else its
    last line on stderr)."""
    with tempfile.TemporaryFile() as log:
        rc = subprocess.run(
            args, stdout=subprocess.DEVNULL, stderr=log, cwd=cwd, env={**os.environ, **QUIET}
        ).returncode
        if rc == 0:
            return
        log.seek(0)
        lines = [ln.strip() for ln in log.read()[-65536:].decode(errors="replace").splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if EXCEPTION_LINE.match(ln)), lines[-1] if lines else "")
    raise TraceToolError(f"{what} failed ({signal_words(rc)}): {why[:240]}")


def check_checkpoint(model_dir) -> None:
    """Refuse, before the export starts, a checkpoint litert-torch's Gemma 4 path cannot take:
    it bundles the tokenizer into model.litertlm, and it exports Gemma4ForConditionalGeneration
    checkpoints (a text-only Gemma4ForCausalLM one fails inside it: "LiteRTGemma4TextModel does
    not support setting experts implementation")."""
    d = Path(model_dir)
    if not any((d / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise TraceToolError(
            f"litert-torch's export bundles the tokenizer into model.litertlm: {d} has no tokenizer.json "
            "or tokenizer.model"
        )
    try:
        arch = json.loads((d / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        arch = []
    if "Gemma4ForCausalLM" in arch:
        raise TraceToolError(
            f"{d} is a Gemma4ForCausalLM checkpoint; litert-torch {version('litert-torch')}'s Gemma 4 export takes "
            "Gemma4ForConditionalGeneration ones (as Google ships E2B/E4B)"
        )


def export_key(loaded, max_seq: int, prefill: int) -> dict:
    return {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "prefill": int(prefill),
        "cache_length": cache_length(max_seq, prefill),
        "axes": [K_AXIS, V_AXIS],
        **versions(),
    }


def exported(loaded, max_seq: int, prefill: int):
    """The artifact holding the float export (FILES and BUNDLE) of `loaded` for max_seq and P."""
    S = cache_length(max_seq, prefill)

    check_checkpoint(loaded.model_dir)

    def build(folder: Path) -> None:
        work = folder / "work"
        work.mkdir()
        run_tool(
            [
                sys.executable,
                "-m",
                "litert_torch.generative.export_hf",
                str(staged_checkpoint(loaded.model_dir, folder / "checkpoint")),  # safetensors, never a .bin
                str(work),
                f"--prefill_lengths={int(prefill)}",
                f"--cache_length={S}",
                "--quantization_recipe=none",
                "--externalize_embedder=True",
                f"--k_ts_idx={K_AXIS}",
                f"--v_ts_idx={V_AXIS}",
                "--keep_temporary_files=True",
            ],
            "litert-torch's Gemma 4 export (litert_torch.generative.export_hf)",
            cwd=work,
        )
        for name in (*FILES, BUNDLE):
            if not (work / name).is_file():
                raise TraceToolError(
                    f"litert-torch's export wrote no {name} (another release lays its files out otherwise)"
                )
            (work / name).rename(folder / name)
        shutil.rmtree(work)
        shutil.rmtree(folder / "checkpoint")

    return artifact_folder(
        "litert",
        export_key(loaded, max_seq, prefill),
        build,
        what=f"exporting {loaded.name} with litert-torch (prefill {prefill}, cache {S}, float32)",
    )


def quantized(loaded, max_seq: int, prefill: int, mode: str):
    """The artifact holding model.tflite quantized with mode's recipe (RECIPES), or, for a
    "-dq" mode, the float model.tflite with that recipe's weights dequantized into it."""
    base = mode.removesuffix("-dq")
    recipe = RECIPES[base]
    dq = mode.endswith("-dq")
    key = {
        **export_key(loaded, max_seq, prefill),
        "recipe": recipe,
        "dequantized": dq,
        "code": code_digest("runtimes/litert/export.py"),
    }

    def build(folder: Path) -> None:
        src = exported(loaded, max_seq, prefill)
        try:
            if dq:
                q = quantized(loaded, max_seq, prefill, base)
                try:
                    n = dequantize_into(src.path / "model.tflite", q.path / "model.tflite", folder / "model.tflite")
                finally:
                    q.close()
                if n == 0:
                    raise TraceToolError(f"the {recipe} model holds no quantized weight to dequantize")
            else:
                run_tool(
                    [sys.executable, "-m", __name__, "quantize", str(src.path / "model.tflite"), str(folder), recipe],
                    f"litert-quantizer ({recipe})",
                )
        finally:
            src.close()

    what = (
        f"writing {recipe}'s dequantized weights into the float model.tflite"
        if dq
        else f"quantizing model.tflite with litert-quantizer's {recipe}"
    )
    return artifact_folder("litert", key, build, what=what)


# ------------------------------------------------------------------ dequantized weights
def _buffer_bytes(model, buf: bytearray, index: int) -> memoryview:
    """Buffer `index`'s bytes in the file: inline, or at (offset, size) past the flatbuffer."""
    b = model.Buffers(index)
    if b.Offset() > 1:
        lo, hi = int(b.Offset()), int(b.Offset()) + int(b.Size())
        if hi > len(buf):
            raise ValueError(f"buffer {index} lies past the end of the file")
        return memoryview(buf)[lo:hi]
    if b.DataLength() == 0:
        return memoryview(b"")
    start = b._tab.Vector(b._tab.Offset(4))
    return memoryview(buf)[start : start + b.DataLength()]


INT8, INT4, FLOAT32 = 9, 17, 0  # TensorType values of the schema


def _dequantized(t, raw: memoryview) -> np.ndarray:
    """A quantized weight tensor's values as float32: scale * (q - zero_point) along its channel axis."""
    shape = tuple(int(d) for d in t.ShapeAsNumpy())
    n = int(np.prod(shape))
    if t.Type() == INT8:
        q = np.frombuffer(raw, np.int8, count=n).astype(np.float32)
    elif t.Type() == INT4:  # two per byte, the first in the low nibble
        packed = np.frombuffer(raw, np.uint8, count=(n + 1) // 2)
        nib = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)[:n].astype(np.int8)
        q = np.where(nib > 7, nib - 16, nib).astype(np.float32)
    else:
        raise ValueError(f"weight type {t.Type()} is not int8 or int4")
    qp = t.Quantization()
    scale, zero = qp.ScaleAsNumpy().astype(np.float32), qp.ZeroPointAsNumpy().astype(np.float32)
    axis = int(qp.QuantizedDimension())
    q = q.reshape(shape)
    view = [1] * len(shape)
    if scale.size > 1:
        view[axis] = scale.size
    return ((q - zero.reshape(view)) * scale.reshape(view)).astype(np.float32)


def dequantize_into(float_path, quant_path, out_path) -> int:
    """Write float_path with every weight that quant_path holds quantized replaced by its
    dequantized values (tensors matched by subgraph and index: the quantizer keeps both and
    appends what it adds); return how many buffers were written."""
    from ai_edge_litert import schema_py_generated as fb

    fbuf, qbuf = bytearray(Path(float_path).read_bytes()), bytearray(Path(quant_path).read_bytes())
    fm, qm = fb.Model.GetRootAsModel(fbuf, 0), fb.Model.GetRootAsModel(qbuf, 0)
    done: dict[int, int] = {}
    for s in range(min(fm.SubgraphsLength(), qm.SubgraphsLength())):
        fg, qg = fm.Subgraphs(s), qm.Subgraphs(s)
        for i in range(min(fg.TensorsLength(), qg.TensorsLength())):
            ft, qt = fg.Tensors(i), qg.Tensors(i)
            if qt.Type() not in (INT8, INT4) or ft.Type() != FLOAT32 or qt.Buffer() == 0:
                continue
            if ft.Name() != qt.Name() or list(ft.ShapeAsNumpy()) != list(qt.ShapeAsNumpy()):
                raise TraceToolError(f"{quant_path}: tensor {i} of subgraph {s} is not the float model's tensor {i}")
            values = _dequantized(qt, _buffer_bytes(qm, qbuf, qt.Buffer()))
            target = _buffer_bytes(fm, fbuf, ft.Buffer())
            if len(target) != values.nbytes:
                raise TraceToolError(
                    f"{float_path}: buffer {ft.Buffer()} does not hold a float32 tensor of {values.shape}"
                )
            if done.setdefault(ft.Buffer(), qt.Buffer()) != qt.Buffer():
                raise TraceToolError(f"{quant_path}: float buffer {ft.Buffer()} maps to two quantized weights")
            target[:] = values.astype("<f4").tobytes()
    Path(out_path).write_bytes(bytes(fbuf))
    return len(done)


def _quantize(src: str, out_dir: str, recipe: str) -> None:
    """The child's work: litert-quantizer's recipe on src, written to out_dir/model.tflite."""
    from litert_quantizer import quantizer as Q
    from litert_quantizer import recipe as R

    q = Q.Quantizer(src)
    q.load_quantization_recipe(getattr(R, recipe)())
    q.quantize().export_model(str(Path(out_dir) / "model.tflite"), overwrite=True)


# ------------------------------------------------------------------ the vision tower
def adapter_note(vision_cfg) -> str | None:
    """What the replay says on stderr when litert-torch's own adapter export would fail on this
    model (its sample width is the patch width 3 p^2, not the tower's hidden size); None where the
    two are equal (E2B, E4B: 768), where its export is this one."""
    hidden, patch = int(vision_cfg.hidden_size), 3 * int(vision_cfg.patch_size) ** 2
    if hidden == patch:
        return None
    return (
        f"litert: vision_adapter.tflite (embed_vision) exported with the tower's hidden size {hidden} as its "
        f"input width; litert-torch {version('litert-torch')}'s export_hf sizes it by the patch width 3 p^2 = "
        f"{patch} and fails on this model (docs/upstream/litert-torch-gemma4-vision-adapter.md)"
    )


def vision_key(loaded, soft: int) -> dict:
    """What the vision export reads: the checkpoint (configs, processor, weights), the patch budget
    (SOFT pooled tokens), the tools' releases and this module (the child's export code)."""
    return {
        "format": VISION_FORMAT,
        "graph": "vision",
        "model": model_hash(loaded.model_dir),
        "soft_tokens": int(soft),
        "code": code_digest("runtimes/litert/export.py"),
        **versions(),
    }


def vision_exported(loaded, soft: int):
    """The artifact holding VISION_FILES for images of SOFT pooled tokens (SOFT k^2 patches)."""
    check_checkpoint(loaded.model_dir)

    def build(folder: Path) -> None:
        staged = staged_checkpoint(loaded.model_dir, folder / "checkpoint")
        run_tool(
            [sys.executable, "-m", __name__, "vision", str(staged), str(folder), str(int(soft))],
            "litert-torch's Gemma 4 vision encoder export",
            cwd=folder,
        )
        for name in VISION_FILES:
            if not (folder / name).is_file():
                raise TraceToolError(f"litert-torch's vision export wrote no {name}")
        shutil.rmtree(folder / "checkpoint")

    return artifact_folder(
        "litert",
        vision_key(loaded, soft),
        build,
        what=f"exporting {loaded.name}'s vision tower with litert-torch ({soft} soft tokens an image, float32)",
    )


def _export_vision(model: str, out: str, soft: str) -> None:
    """The child's work: litert-torch's vision encoder export (export_lib.export_vision_encoder_models'
    steps: the model loaded by its load_model, hence in its Gemma 4 patch context, its exportable
    modules, its converter), the encoder as it writes it; the adapter converted with a sample of the
    tower's hidden size (litert-torch 0.10.0's sample is the patch width: adapter_note)."""
    import torch
    from litert_torch._convert import interface as converter_utils
    from litert_torch.generative.export_hf.core import export_lib
    from litert_torch.generative.export_hf.core import exportable_module as M
    from litert_torch.generative.export_hf.model_ext import exportables

    soft_n = int(soft)
    cfg = M.ExportableModuleConfig(
        model=model,
        output_dir=out,
        work_dir=out,
        task="image_text_to_text",
        quantization_recipe=None,
        export_vision_encoder=True,
        export_audio_encoder=False,
        extra_kwargs={"gemma4_vision_max_soft_tokens": soft_n},
    )
    src = export_lib.load_model(model, cfg, task=cfg.task)
    cfg = export_lib.update_export_config(cfg, src)
    src.model.set_attn_implementation("eager")  # as export_vision_encoder_models
    encoder_cls, adapter_cls, _ = exportables.get_vision_exportables(src.model_config)
    encoder = encoder_cls(src.model, cfg).eval()
    conv = converter_utils.Converter()
    samples = encoder.get_sample_inputs(src.model_config, image_processor=src.image_processor, **cfg.extra_kwargs)
    for name, (inputs, _) in samples.items():
        conv.add_signature(name, encoder, sample_kwargs=inputs)
    conv.convert(strict_export=False).export(str(Path(out) / "vision_encoder.tflite"))
    adapter = adapter_cls(src.model, cfg, src.tokenizer).eval()
    width = int(src.model_config.vision_config.hidden_size)
    conv = converter_utils.Converter()
    sample = {"soft_tokens": torch.zeros(1, soft_n, width)}
    conv.add_signature(f"vision_adapter_{soft_n}", adapter, sample_kwargs=sample)
    conv.convert(strict_export=False).export(str(Path(out) / "vision_adapter.tflite"))


# ------------------------------------------------------------------ LiteRT-LM's vision bundle
# the .tflite files of litert-torch's vision bundle, each section's type (litert_lm_builder.TfLiteModelType)
LM_SECTIONS = {
    **{"model": "PREFILL_DECODE", "embedder": "EMBEDDER", "per_layer_embedder": "PER_LAYER_EMBEDDER"},
    **{"vision_encoder": "VISION_ENCODER", "vision_adapter": "VISION_ADAPTER", "eoi": "END_OF_VISION"},
}


def metadata_note(vision_cfg, soft: int) -> str | None:
    """What the replay says when the bundle's Gemma 4 vision metadata is rebuilt: litert-torch
    writes it for 3 x 3 pooling (docs/upstream/litert-torch-litertlm-vision-metadata.md); None where
    the model pools 3 x 3 (every released Gemma 4), where the bundle is litert-torch's as written."""
    k = int(vision_cfg.pooling_kernel_size)
    if k == 3:
        return None
    return (
        f"litert-lm: model.litertlm's Gemma 4 vision metadata rebuilt with the model's pooling_kernel_size {k} and "
        f"max_num_patches {k * k * int(soft)}; litert-torch {version('litert-torch')} writes 3 x 3 pooling "
        f"(max_num_patches {9 * int(soft)}), on which LiteRT-LM fails "
        "(docs/upstream/litert-torch-litertlm-vision-metadata.md)"
    )


def lm_vision_exported(loaded, S: int, soft: int):
    """The artifact holding BUNDLE with litert-torch's vision sections (`export_hf --task
    image_text_to_text --export_vision_encoder=True`, prefill and cache S), the adapter sized by the
    tower's hidden size where adapter_note says so, the vision metadata rebuilt where metadata_note does."""
    check_checkpoint(loaded.model_dir)
    v = loaded.config.vision_config
    k, width = int(v.pooling_kernel_size), int(v.hidden_size)
    fixes = {
        "adapter_width": width if adapter_note(v) else None,
        "vision_metadata": [k, k * k * int(soft)] if metadata_note(v, soft) else None,
    }
    key = {
        **export_key(loaded, S, S),
        "graph": "litert-lm vision",
        "soft_tokens": int(soft),
        **fixes,
        "code": code_digest("runtimes/litert/export.py"),
        "litert-lm-builder": version("litert-lm-builder"),
    }

    def build(folder: Path) -> None:
        work = folder / "work"
        work.mkdir()
        staged = staged_checkpoint(loaded.model_dir, folder / "checkpoint")
        args = [str(staged), str(work), str(int(S)), str(int(soft)), json.dumps(fixes)]
        run_tool(
            [sys.executable, "-m", __name__, "lm-vision", *args],
            "litert-torch's Gemma 4 export with its vision encoder (export_hf --export_vision_encoder)",
            cwd=work,
        )
        if not (work / BUNDLE).is_file():
            raise TraceToolError(f"litert-torch's vision export wrote no {BUNDLE}")
        (work / BUNDLE).rename(folder / BUNDLE)
        shutil.rmtree(work)
        shutil.rmtree(folder / "checkpoint")

    return artifact_folder(
        "litert",
        key,
        build,
        what=f"exporting {loaded.name} with litert-torch for LiteRT-LM (cache {S}, {soft} soft tokens an image)",
    )


def _export_lm_vision(model: str, out: str, S: str, soft: str, fixes: str) -> None:
    """The child's work: export_hf with the vision encoder; the adapter's sample width and the
    bundle's Gemma 4 vision metadata as `fixes` says (lm_vision_exported), the bundle then rebuilt
    from the files litert-torch kept, with the same sections."""
    import torch
    from litert_torch.generative.export_hf import export as X
    from litert_torch.generative.export_hf.model_ext.gemma4 import vision_exportable as V

    fix, n = json.loads(fixes), int(soft)
    if fix["adapter_width"]:
        sample = {f"vision_adapter_{n}": ({"soft_tokens": torch.zeros(1, n, int(fix["adapter_width"]))}, {})}
        V.LiteRTExportableModuleForGemma4VisionAdapter.get_sample_inputs = lambda self, cfg, **kw: sample
    X.export(
        model, out, task="image_text_to_text", prefill_lengths=[int(S)], cache_length=int(S),
        quantization_recipe="none", externalize_embedder=True, k_ts_idx=K_AXIS, v_ts_idx=V_AXIS,
        keep_temporary_files=True, export_vision_encoder=True, gemma4_vision_max_soft_tokens=n,
    )  # fmt: skip
    if not fix["vision_metadata"]:
        return
    import litert_lm_builder as B
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    d = Path(out)
    md = llm_metadata_pb2.LlmMetadata.FromString((d / "llm_metadata.pb").read_bytes())
    md.llm_model_type.gemma4.pooling_kernel_size, md.llm_model_type.gemma4.max_num_patches = fix["vision_metadata"]
    (d / "llm_metadata_fixed.pb").write_bytes(md.SerializeToString())
    b = B.LitertLmFileBuilder()
    b.add_system_metadata(B.Metadata(key="Authors", value="ODML", dtype=B.DType.STRING))
    b.add_llm_metadata(str(d / "llm_metadata_fixed.pb"))
    b.add_executor_metadata(str(d / "executor_metadata.pb"))
    b.add_hf_tokenizer(str(d / "tokenizer.json"))
    for name, t in LM_SECTIONS.items():
        b.add_tflite_model(str(d / f"{name}.tflite"), getattr(B.TfLiteModelType, t))
    with open(d / BUNDLE, "wb") as f:
        b.build(f)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "quantize":
        _quantize(*args)
    elif command == "vision":
        _export_vision(*args)
    elif command == "lm-vision":
        _export_lm_vision(*args)


def export_command(request) -> str:
    """`trace export --runtime litert*` (`export-litert`; `request` an ExportRequest, spec.py): the
    files that runtime runs, copied from the artifact cache into its folder, all or none; return
    a summary line."""
    model_dir, mode, max_seq, out_dir, force = request.basics()
    prefill_chunk = request.prefill_chunk
    from gemma4_trace.hf.model import load_model

    from ...artifacts import check_output_folder, copy_all_or_none, model_folder_files
    from ...ops import resolve_prefill_chunk

    if mode != "litert" and mode not in RECIPES and mode.removesuffix("-dq") not in RECIPES:
        raise TraceToolError(
            f"--runtime {mode!r}: export-litert writes litert, {', '.join(RECIPES)} or their -dq files"
        )
    out = Path(out_dir)
    names = [*FILES, BUNDLE] if mode == "litert" else list(FILES)
    check_output_folder(out, names, force, ".tflite", inputs=model_folder_files(model_dir))
    P = resolve_prefill_chunk(prefill_chunk, max_seq) or int(max_seq)
    loaded = load_model(model_dir, weights=False)
    base = exported(loaded, max_seq, P)
    arts = [base] + ([] if mode == "litert" else [quantized(loaded, max_seq, P, mode)])
    try:
        sources = [(arts[-1] if n == "model.tflite" else base).path / n for n in names]
        copy_all_or_none(sources, out, ".tflite")
    finally:
        for a in arts:
            a.close()
    sizes = ", ".join(f"{n} ({(out / n).stat().st_size / 2**20:.1f} MiB)" for n in names)
    # a quantized mode is two builds, the float export first: each says its own time
    how = base.note if len(arts) == 1 else f"the float export {base.note}, the {mode} model {arts[-1].note}"
    return f"wrote {sizes} into {out}: {loaded.name}, {mode}, prefill {P}, cache {cache_length(max_seq, P)} ({how})"
