"""`--runtime onnx`: the static runtime's prefill and decode steps exported to ONNX, run by
onnxruntime on CPU (extra `gemma4-trace[onnx]`).

Each step is one ONNX graph with static shapes (max_seq): the step graphs of
replayer/functional.py (K/V caches in and out, every canonical kind an extra output named
`<kind>` or `L07.<kind>`), so a replay sees what the exported graph computed, with
onnxruntime's kernels. A replay that keeps some kinds (`--kinds`: RuntimeChoice.capture) runs
graphs exported with only those kinds as outputs (their own cache entry). An image prompt runs
a third graph, vision.onnx: the static runtime's port of the vision tower (replayer/static_vision.py)
for the prompt's (images, patches), every vision site an output, exported when that shape is first
seen; its soft tokens are fed to the prefill graph. An audio prompt runs audio.onnx the same way: the
port of the audio tower (replayer/static_audio.py) for the prompt's (clips, mel frames), every audio
site an output with its padding frames (the host keeps the valid ones).

    trace export-onnx [--model DIR] --max-seq 32 -o DIR    # writes prefill.onnx, decode.onnx
    trace replay REF.h5 --runtime onnx -o RUN.h5

The exported graphs are kept in the artifact cache (replayer/artifacts.py), keyed by the model's
content hash, max_seq, the exporter's versions and the exported code; a later replay of the same
model runs the cached graphs after checking their hashes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line

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
from .onnx_engine import ENGINE as ORT_ENGINE
from .onnx_engine import SESSION as ORT_SESSION

OPSET = 18
FORMAT = 1  # bump when the graphs' inputs or outputs change meaning (the cache key holds it)
GRAPHS = F.STEPS


def export_onnx(loaded, max_seq: int, out_dir, kinds=None) -> tuple[Path, Path]:
    """Write prefill.onnx and decode.onnx for `loaded` at `max_seq`, with `kinds` as extra outputs
    (None: every kind); return their paths."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401  (torch's ONNX exporter needs it)
    except ImportError as e:
        raise TraceToolError(f"exporting ONNX needs onnx and onnxscript: {install_hint('onnx')} ({e})") from None
    out = Path(out_dir)
    if not out.is_dir():
        raise TraceToolError(f"output folder {out} does not exist")
    rt = F.FunctionalKV(loaded, max_seq)
    caches = F.zero_caches(rt)
    # protobuf caps a file at 2 GiB: a real checkpoint's weights go to <graph>.onnx.data beside it
    external = sum(b.numel() * b.element_size() for b in rt.buffers()) > 1 << 30
    inputs = {"prefill": F.PREFILL_INPUTS, "decode": F.DECODE_INPUTS}
    paths = []
    for name in GRAPHS:
        g, example = F.graph(rt, name, kinds=kinds), F.step_inputs(rt, name)
        with torch.no_grad(), F.quiet():
            g(*example, *caches)  # learn the reported kinds' names (the order is fixed by the code)
            path = out / f"{name}.onnx"
            try:
                torch.onnx.export(
                    g,
                    (*example, *caches),
                    str(path),
                    input_names=[*inputs[name], *F.cache_names(rt)],
                    output_names=["logits", *(f"{c}_out" for c in F.cache_names(rt)), *g.names],
                    opset_version=OPSET,
                    dynamo=True,
                    external_data=external,
                    verbose=False,
                    optimize=False,
                )  # onnxruntime optimizes at load; 2x faster export
            except Exception as e:  # noqa: BLE001 - the exporter fails in many ways; one line for the user
                raise TraceToolError(
                    f"ONNX export of the {name} step failed: {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else ''}"
                ) from None
        paths.append(path)
    return paths[0], paths[1]


def export_tower_onnx(loaded, tower: str, shape: tuple, out_dir) -> Path:
    """Write <tower>.onnx: the port of the encoder `tower` (replayer/functional.py's VisionGraph for
    images of `shape` (images, patches: the processor's patch budget), AudioGraph for clips of `shape`
    (clips, mel frames, bins)), every site of the tower an output."""
    out = Path(out_dir) / f"{tower}.onnx"
    rt = F.FunctionalKV(loaded, 1)  # the tower's port; the text tower's caches are not needed here
    g = F.tower_graph(rt, tower)
    example = F.tower_inputs(rt, tower, shape)
    with torch.no_grad(), F.quiet():
        g(*example)
        try:
            torch.onnx.export(
                g, example, str(out), input_names=list(F.TOWER_GRAPHS[tower]), output_names=g.names,
                opset_version=OPSET, dynamo=True, verbose=False, optimize=False,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the exporter fails in many ways; one line for the user
            raise TraceToolError(
                f"ONNX export of the {tower} tower failed: {type(e).__name__}: {one_line(e, 200)}"
            ) from None
    return out


def tower_exported(loaded, tower: str, shape: tuple):
    """The artifact holding <tower>.onnx for inputs of `shape` (cached like the step graphs; keyed by
    the model, the graph and the shape)."""
    key = {**cache_key(loaded, 1), "graph": tower, F.SHAPE_KEY[tower]: list(shape)}
    del key["max_seq"]
    return artifact_folder(
        "onnx", key, lambda folder: export_tower_onnx(loaded, tower, shape, folder),
        what=f"exporting ONNX (the {tower} tower, {F.shape_words(tower, shape)}) for {loaded.name}",
    )  # fmt: skip


def cache_key(loaded, max_seq: int, kinds=None) -> dict:
    """What the exported graphs depend on: the checkpoint's bytes, the shapes, the exporter's
    versions, the code that is exported (a change to it exports again) and, for a narrowed
    capture, its kinds."""
    from importlib.metadata import version

    return {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "dtype": str(loaded.dtype),
        "max_seq": int(max_seq),
        "opset": OPSET,
        "torch": torch.__version__,
        "onnx": version("onnx"),
        "onnxscript": version("onnxscript"),
        "code": code_digest(*STATIC_SOURCES, "functional.py"),
        **F.capture_key(kinds),
    }


def exported(loaded, max_seq: int, kinds=None):
    """The artifact (replayer/artifacts.py) holding prefill.onnx and decode.onnx for `loaded` at
    `max_seq` (with `kinds` as extra outputs; None: every kind): the cached graphs after their hash
    check, else exported now (one line on stderr)."""

    def build(folder):
        return export_onnx(loaded, max_seq, folder) if kinds is None else export_onnx(loaded, max_seq, folder, kinds)

    return artifact_folder(
        "onnx",
        cache_key(loaded, max_seq, kinds),
        build,
        what=f"exporting ONNX (prefill and decode, max_seq {max_seq}{F.capture_note(kinds)}) for {loaded.name}",
    )


class OnnxRuntime(StepGraphRuntime):
    """The exported graphs run by onnxruntime on CPU (in the child process)."""

    def __init__(self, loaded, max_seq: int, kinds=None):
        import onnxruntime as ort

        self.name = f"onnx (onnxruntime {ort.__version__}, CPU)"
        label, artifact = f"onnx (onnxruntime {ort.__version__})", lambda: exported(loaded, max_seq, kinds)
        self.vision_artifact = lambda shape: tower_exported(loaded, "vision", shape)
        self.audio_artifact = lambda shape: tower_exported(loaded, "audio", shape)
        self.load_graphs(label, ORT_ENGINE, loaded, max_seq, artifact, ".onnx", ORT_SESSION)


def create(loaded, max_seq: int, choice=None):
    if choice is not None and choice.file("onnx_map") is not None:  # onnx_user.py runs a map, with --onnx
        raise TraceToolError("--onnx-map names the tensors of your own graph: it goes with --onnx PATH")
    return OnnxRuntime(loaded, max_seq, None if choice is None else choice.capture)


def export_command(request) -> str:
    """`trace export --runtime onnx` (`export-onnx`; `request` an ExportRequest, spec.py): write
    prefill.onnx and decode.onnx into its folder, both or neither (the artifact cache's graphs,
    exported into it first when absent); return a summary line. Output paths are checked before
    the model loads."""
    from gemma4_trace.hf.model import load_model

    model_dir, max_seq, out_dir, force = request.model_dir, request.max_seq, request.out, request.force
    out = Path(out_dir)
    targets = [out / f"{g}.onnx" for g in GRAPHS]
    names = [t.name for t in targets] + [t.name + ".data" for t in targets]
    check_output_folder(out, names, force, ".onnx", inputs=model_folder_files(model_dir))
    loaded = load_model(model_dir)
    art = exported(loaded, max_seq)
    try:  # the graphs (and external weights, if any), all placed or none
        copy_all_or_none([f for f in sorted(art.path.iterdir()) if f.name != MANIFEST], out, ".onnx")
    finally:
        art.close()
    sizes = ", ".join(f"{t} ({t.stat().st_size / 2**20:.1f} MiB)" for t in targets)
    return (
        f"wrote {sizes}: {loaded.name}, max_seq {max_seq}, opset {OPSET}, canonical kinds as extra outputs "
        f"({'from the artifact cache' if art.note == 'cached' else art.note})"
    )
