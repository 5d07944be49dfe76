"""`--runtime openvino`, `openvino-int8`, `openvino-int4` and their `-dq` baselines: the static
runtime's prefill and decode steps converted to OpenVINO IR, compiled for OpenVINO's CPU plugin in
float32 and run in the child process (extra `gemma4-trace[openvino]`).

The graphs are the step graphs of replayer/functional.py (the ones the ONNX and ExecuTorch
runtimes run: K/V caches in and out, every canonical kind an extra output named `<kind>` or
`L07.<kind>`), taken by torch.export and converted by OpenVINO's PyTorch frontend
(`openvino.convert_model`), so a replay sees what OpenVINO's kernels computed for each kind. As
for ONNX, an image prompt runs the vision tower's graph too (vision.xml, converted, compressed and
folded as the step graphs are) and feeds its soft tokens to the prefill graph; an audio prompt the
audio tower's (audio.xml, per (clips, mel frames), converted, compressed and folded the same way).

    openvino           float32 IR, INFERENCE_PRECISION_HINT f32 (no bf16/f16 down-casting)
    openvino-int8      NNCF `compress_weights` INT8_ASYM: int8 weights, per output channel
    openvino-int4      NNCF `compress_weights` INT4_SYM in groups of 32 (NNCF keeps embeddings and
                       the LM head in INT8_ASYM, as it does by default; a matrix whose input width
                       is no multiple of 32, the 8-wide per-layer projection, stays float)
    openvino-intN-dq   that compressed IR with its weight-decompression subgraphs folded into
                       float32 constants: the same weights in float kernels (the `--baseline` of
                       openvino-intN, as `trace diff REF INT4 --baseline INT4_DQ`)

NNCF compresses weights only, but the CPU plugin's kernels for compressed weights also quantize
their activations to int8 on the fly, in groups of 32 (its DYNAMIC_QUANTIZATION_GROUP_SIZE
default, kept here: it is what a deployment runs), so openvino-intN against its -dq baseline shows
what those kernels add beyond the weights' rounding (docs/runtime-openvino.md: 4.8e-3 at the first
matmul on the embedded model; 1.3e-7 with the dynamic quantization off).
Every IR is an artifact-cache entry (replayer/artifacts.py) keyed by the model's content hash,
max_seq, the mode, the converter's versions and the converted code; a replay that keeps some kinds
(`--kinds`: RuntimeChoice.capture) runs IR converted with only those kinds as outputs (keyed by
them too; a quantized or -dq IR is built from the float IR of the same kinds).

    trace export-openvino [--model DIR] [--runtime openvino-int4] --max-seq 32 -o DIR
    trace replay REF.h5 --runtime openvino -o RUN.h5
"""

from __future__ import annotations

import sys
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, install_hint

from .. import functional as F
from ..artifacts import (
    MANIFEST,
    artifact_folder,
    check_output_folder,
    code_digest,
    copy_all_or_none,
    model_folder_files,
    model_hash,
)
from ..functional import StepGraphRuntime
from ..runtime import SOURCES as STATIC_SOURCES
from .openvino_engine import ENGINE as OPENVINO_ENGINE

FORMAT = 1  # bump when the IR's inputs or outputs change meaning (the cache key holds it)
CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}  # the CPU plugin's float32 kernels (its default may be bf16)
INT4_GROUP = 32
# mode -> (NNCF CompressWeightsMode, group size); the float IR is None
MODES = {"openvino": None, "openvino-int8": ("INT8_ASYM", None), "openvino-int4": ("INT4_SYM", INT4_GROUP)}
SCHEME = {
    "openvino": "float32",
    "openvino-int8": "NNCF INT8_ASYM weights, per channel",
    "openvino-int4": f"NNCF INT4_SYM weights, groups of {INT4_GROUP}",
}


def _modules():
    no_telemetry()
    try:
        import openvino

        return openvino
    except ImportError as e:
        raise TraceToolError(f"--runtime openvino needs openvino: {install_hint('openvino')} ({e})") from None


def no_telemetry() -> None:
    """OpenVINO's converter and NNCF send usage telemetry over the network unless a consent file in
    ~/intel says no, from a process they fork per event (left behind, hung, when the network is
    unreachable). A replay sends nothing: openvino_telemetry is made unimportable, which both take
    as "no telemetry" (their stubs)."""
    sys.modules.setdefault("openvino_telemetry", None)


def convert(loaded, max_seq: int, out: Path, kinds=None) -> None:
    """Write prefill.xml/.bin and decode.xml/.bin: each step graph (with `kinds` as extra outputs;
    None: every kind) torch.export-ed and converted by OpenVINO's PyTorch frontend, its inputs and
    outputs named as the ONNX graphs' are."""
    ov = _modules()
    rt = F.FunctionalKV(loaded, max_seq)
    inputs = {"prefill": F.PREFILL_INPUTS, "decode": F.DECODE_INPUTS}
    for step in F.STEPS:
        outs = ["logits", *(f"{c}_out" for c in F.cache_names(rt)), *F.output_names(rt, step, kinds=kinds)]
        ins = [*inputs[step], *F.cache_names(rt)]
        try:
            program = F.export_step(rt, step, kinds=kinds)
            with F.quiet():
                model = ov.convert_model(program)
        except Exception as e:  # noqa: BLE001 - the exporter and the frontend fail in many ways; one line
            raise TraceToolError(f"OpenVINO conversion of the {step} step failed: {_first_line(e)}") from None
        if len(model.inputs) != len(ins) or len(model.outputs) != len(outs):
            raise TraceToolError(
                f"OpenVINO's {step} graph has {len(model.inputs)} inputs and {len(model.outputs)} outputs; "
                f"expected {len(ins)} and {len(outs)}"
            )
        for port, name in (*zip(model.inputs, ins), *zip(model.outputs, outs)):
            port.get_tensor().set_names({name})
        # the frontend leaves every input dimension dynamic: fix each at its example's (static shapes)
        examples = (*F.step_inputs(rt, step), *F.zero_caches(rt))
        model.reshape({port: ov.PartialShape(list(t.shape)) for port, t in zip(model.inputs, examples)})
        ov.save_model(model, str(out / f"{step}.xml"), compress_to_fp16=False)


def convert_tower(loaded, tower: str, shape: tuple, out: Path) -> None:
    """Write <tower>.xml/.bin: the port of the encoder `tower` (replayer/functional.py's VisionGraph for
    images of `shape` (images, patches), AudioGraph for clips of `shape` (clips, mel frames, bins)),
    torch.export-ed and converted as the step graphs are."""
    ov = _modules()
    rt = F.FunctionalKV(loaded, 1)  # the tower's port; the text tower's caches are not needed here
    g = F.tower_graph(rt, tower)
    example = F.tower_inputs(rt, tower, shape)
    import torch

    try:
        with torch.no_grad(), F.quiet():
            g(*example)
            program = torch.export.export(g, example, strict=False)
            model = ov.convert_model(program)
    except Exception as e:  # noqa: BLE001 - the exporter and the frontend fail in many ways; one line
        raise TraceToolError(f"OpenVINO conversion of the {tower} tower failed: {_first_line(e)}") from None
    if len(model.outputs) != len(g.names):
        raise TraceToolError(f"OpenVINO's {tower} graph has {len(model.outputs)} outputs; expected {len(g.names)}")
    for port, name in (*zip(model.inputs, F.TOWER_GRAPHS[tower]), *zip(model.outputs, g.names)):
        port.get_tensor().set_names({name})
    model.reshape({port: ov.PartialShape(list(t.shape)) for port, t in zip(model.inputs, example)})
    ov.save_model(model, str(out / f"{tower}.xml"), compress_to_fp16=False)


def tower_ir(loaded, tower: str, shape: tuple, mode: str = "openvino"):
    """The artifact holding <tower>.xml of `mode` for the encoder `tower`'s inputs of `shape`, built as
    the step graphs' IR is: the float IR converted, a compressed one from it by the same NNCF scheme
    (the tower's Linear, patch and conv weights), a -dq one folded from that."""
    key = {**cache_key(loaded, 1, mode), "graph": tower, F.SHAPE_KEY[tower]: list(shape)}
    del key["max_seq"]
    base, graphs, needs = mode.removesuffix("-dq"), (tower,), None
    if mode.endswith("-dq"):
        what, needs = "dequantizing", lambda: (tower_ir(loaded, tower, shape, base),)
        build = lambda out, src: dequantize(src.path, out, graphs)  # noqa: E731
    elif mode != "openvino":
        what, needs = "compressing", lambda: (tower_ir(loaded, tower, shape, "openvino"),)
        build = lambda out, src: compress(src.path, out, mode, graphs)  # noqa: E731
    else:
        what, build = "converting to OpenVINO IR", lambda out: convert_tower(loaded, tower, shape, out)
    return artifact_folder(
        "openvino", key, build, needs=needs,
        what=f"{what} ({mode}: the {tower} tower, {F.shape_words(tower, shape)}) for {loaded.name}",
    )  # fmt: skip


def vision_ir(loaded, shape: tuple[int, int], mode: str = "openvino"):
    """The artifact holding vision.xml of `mode` for images of `shape` (tower_ir)."""
    return tower_ir(loaded, "vision", shape, mode)


def compress(src: Path, out: Path, mode: str, graphs=F.STEPS) -> None:
    """NNCF weight compression of the float IR in `src` (MODES[mode]) into `out`: each of `graphs`
    (the step graphs, or an encoder tower's)."""
    ov = _modules()
    try:
        import nncf
    except ImportError as e:
        raise TraceToolError(f"--runtime {mode} needs nncf: {install_hint('openvino')} ({e})") from None
    scheme, group = MODES[mode]
    kw = {}
    if group is not None:
        kw = dict(
            group_size=group,
            ratio=1.0,
            advanced_parameters=nncf.AdvancedCompressionParameters(
                group_size_fallback_mode=nncf.GroupSizeFallbackMode.IGNORE
            ),
        )
    core = ov.Core()
    for step in graphs:
        with F.quiet():  # NNCF prints a table and progress bars for a successful compression
            model = nncf.compress_weights(
                core.read_model(str(src / f"{step}.xml")), mode=getattr(nncf.CompressWeightsMode, scheme), **kw
            )
        ov.save_model(model, str(out / f"{step}.xml"), compress_to_fp16=False)


def dequantize(src: Path, out: Path, graphs=F.STEPS) -> None:
    """The compressed IR in `src` with its weight-decompression subgraphs (int weights -> Convert ->
    Subtract -> Multiply) constant-folded into float32 weights. NNCF marks those subgraphs to be
    kept for the plugin's compressed kernels; the marks are dropped so that folding reaches them."""
    ov = _modules()
    from openvino import passes

    core = ov.Core()
    for step in graphs:
        model = core.read_model(str(src / f"{step}.xml"))
        for op in model.get_ops():
            info = op.get_rt_info()
            for key in list(info.keys()):
                if "decompression" in key.lower() or "constant_folding" in key.lower():
                    del info[key]
        manager = passes.Manager()
        manager.register_pass(passes.ConstantFolding())
        manager.run_passes(model)
        constants = (o for o in model.get_ops() if o.get_type_name() == "Constant")
        left = sorted({o.get_element_type().get_type_name() for o in constants})
        if not {"u8", "i8", "u4", "i4"}.isdisjoint(left):
            raise TraceToolError(f"the dequantized {step} graph still holds integer weights ({', '.join(left)})")
        ov.save_model(model, str(out / f"{step}.xml"), compress_to_fp16=False)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def cache_key(loaded, max_seq: int, mode: str, kinds=None) -> dict:
    """What an IR depends on: the checkpoint's bytes, the shapes, the mode, the converter's and
    the compressor's versions, the converted code and, for a narrowed capture, its kinds."""
    from importlib.metadata import version

    import torch

    key = {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "dtype": str(loaded.dtype),
        "max_seq": int(max_seq),
        "mode": mode,
        "torch": torch.__version__,
        "openvino": version("openvino"),
        "code": code_digest(*STATIC_SOURCES, "functional.py", "runtimes/openvino.py"),
        **F.capture_key(kinds),
    }
    if mode != "openvino":
        key["nncf"] = version("nncf")
    return key


def ir(loaded, max_seq: int, mode: str, kinds=None):
    """The artifact holding prefill.xml and decode.xml of `mode` (the cached IR after its hash
    check, else built now with one line on stderr: a quantized IR from the float one, a -dq IR
    from its quantized one); `kinds`: the extra outputs (None: every kind)."""
    base = mode.removesuffix("-dq")
    needs = None
    if mode.endswith("-dq"):
        what, needs = "dequantizing", lambda: (ir(loaded, max_seq, base, kinds),)
        build = lambda out, src: dequantize(src.path, out)  # noqa: E731
    elif mode != "openvino":
        what, needs = "compressing", lambda: (ir(loaded, max_seq, "openvino", kinds),)
        build = lambda out, src: compress(src.path, out, mode)  # noqa: E731
    else:
        what = "converting to OpenVINO IR"
        build = lambda out: convert(loaded, max_seq, out, kinds)  # noqa: E731
    return artifact_folder(
        "openvino",
        cache_key(loaded, max_seq, mode, kinds),
        build,
        what=f"{what} ({mode}: prefill and decode, max_seq {max_seq}{F.capture_note(kinds)}) for {loaded.name}",
        needs=needs,
    )


class OpenVINORuntime(StepGraphRuntime):
    """The IR compiled by OpenVINO's CPU plugin (in the child process)."""

    def __init__(self, loaded, max_seq: int, mode: str, kinds=None):
        from importlib.metadata import version

        v = version("openvino")
        what = "" if mode == "openvino" else f"; {SCHEME[mode.removesuffix('-dq')]}"
        what += "; decompressed into float32 weights" if mode.endswith("-dq") else ""
        self.name = f"{mode} (OpenVINO {v}, CPU, f32 inference precision{what})"
        label, artifact = f"{mode} (OpenVINO {v})", lambda: ir(loaded, max_seq, mode, kinds)
        self.vision_artifact = lambda shape: tower_ir(loaded, "vision", shape, mode)
        self.audio_artifact = lambda shape: tower_ir(loaded, "audio", shape, mode)
        self.load_graphs(label, OPENVINO_ENGINE, loaded, max_seq, artifact, ".xml", CONFIG)


def create(loaded, max_seq: int, choice):
    if choice.file("ir_map") is not None:  # openvino_user.py runs a map, with --ir
        raise TraceToolError("--ir-map names the tensors of your own IR: it goes with --ir PATH")
    return OpenVINORuntime(loaded, max_seq, choice.name, choice.capture)


def export_command(request) -> str:
    """`trace export --runtime openvino*` (`export-openvino`; `request` an ExportRequest, spec.py):
    write prefill.xml/.bin and decode.xml/.bin into its folder, all or none (from the artifact
    cache, built into it first when absent); return a summary line. Output paths are checked
    before the model loads."""
    from gemma4_trace.hf.model import load_model

    model_dir, mode, max_seq, out_dir, force = request.basics()

    out = Path(out_dir)
    names = [f"{g}.{ext}" for g in F.STEPS for ext in ("xml", "bin")]
    check_output_folder(out, names, force, ".xml/.bin", inputs=model_folder_files(model_dir))
    loaded = load_model(model_dir)
    art = ir(loaded, max_seq, mode)
    try:
        copy_all_or_none([f for f in sorted(art.path.iterdir()) if f.name != MANIFEST], out, ".xml/.bin")
    finally:
        art.close()
    size = sum((out / n).stat().st_size for n in names) / 2**20
    scheme = SCHEME[mode.removesuffix("-dq")] + (", dequantized" if mode.endswith("-dq") else "")
    return (
        f"wrote {', '.join(names)} ({size:.1f} MiB) into {out}: {loaded.name}, {mode} ({scheme}), "
        f"max_seq {max_seq}, canonical kinds as extra outputs "
        f"({'from the artifact cache' if art.note == 'cached' else art.note})"
    )
