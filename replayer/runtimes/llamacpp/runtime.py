"""`--runtime llama.cpp[:TYPE]`: REF's checkpoint converted to GGUF by the project's writer
(gguf_writer.py), quantized to TYPE by llama.cpp's `llama_model_quantize`, and run by llama.cpp
(llama-cpp-python, extra `gemma4-trace[llamacpp]`) in a child process (replayer/child.py, its
engine in engine.py).

    trace replay REF.h5 --runtime llama.cpp -o run.h5           # F32
    trace replay REF.h5 --runtime llama.cpp:Q8_0 -o q8.h5
    trace export-gguf --type Q4_K_M -o tiny-q4km.gguf

Capture: the scheduler's eval callback hands each graph node to the child, which streams the
canonical kinds' nodes back (engine.py names the mapping): embeddings, per_layer_inputs, q and k
(after their norm and RoPE), v (after its norm), attn_out (o_proj's output), layer_out,
final_hidden, and each layer's attention mask (a graph input, read as the mask operand of the
layer's attention node). The RoPE tables are not graph nodes llama.cpp exposes: they are absent
from the trace (never zeros), and `trace diff` says so.

Teacher-forced and free-running: the prompt is one prefill (one llama_decode call; a prompt
longer than a ubatch runs as several graphs, their rows stitched in order), then one token per
step. Image prompts are refused before the model loads (the registry's text_only): llama.cpp's
Gemma 4 vision path runs through its own mmproj tower, which this runtime does not drive.

The converted and quantized files are artifact-cache entries (replayer/artifacts.py: a manifest
with each file's hash, checked before every use), built when first needed.

A crash inside llama.cpp ends the child only: the replay stops with one line naming the runtime,
TYPE, the phase and the last kind reported, and no trace is left behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import one_line

from ...artifacts import artifact_folder, code_digest, model_folder_files, model_hash
from ...child import ChildRuntime
from . import gguf_writer as GW
from .gguf_reader import read_header

RUNTIME = "llama.cpp"
ENGINE = "gemma4_trace.replayer.runtimes.llamacpp.engine:LlamaCppEngine"
GGUF_NAME = "model.gguf"
WRITER_CODE = "runtimes/llamacpp/gguf_writer.py"  # a change to the writer converts again


ENV = {"GGML_NO_BACKTRACE": "1"}  # ggml's abort message, not a debugger's backtrace


def start_child(label: str) -> ChildRuntime:
    child = ChildRuntime()
    child.start(label, ENGINE, env=ENV, streams=True)
    return child


def _version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


def conversion_key(loaded, gguf_type: str) -> dict:
    """What a conversion depends on: the checkpoint's bytes, the type, the writer's code, and for a
    quantized type llama.cpp's version (its quantizer)."""
    key = {"model": model_hash(loaded.model_dir), "type": gguf_type, "code": code_digest(WRITER_CODE)}
    if gguf_type != "F32":
        key["llama-cpp-python"] = _version()
    return key


def gguf_artifact(loaded, gguf_type: str, quantizer: ChildRuntime | None = None):
    """The artifact-cache entry holding `loaded` as a GGUF file of `gguf_type` (GGUF_NAME in its
    folder): F32 written by the project's writer, any other type quantized from the F32 entry by
    llama.cpp (in `quantizer`'s child, or one of its own)."""
    key = conversion_key(loaded, gguf_type)
    if gguf_type == "F32":
        GW.check_supported(loaded)  # before a cached file is used as well as before one is written

        def build(folder: Path) -> None:
            GW.write_f32(GW.with_weights(loaded), folder / GGUF_NAME)

        return artifact_folder("gguf", key, build, what=f"converting {loaded.name} to GGUF (F32)")

    def quantize(folder: Path) -> None:
        f32 = gguf_artifact(loaded, "F32")
        own = quantizer is None
        worker = start_child(f"{RUNTIME} ({gguf_type})") if own else quantizer
        try:
            # the child writes only in its own folder (replayer/confine.py); the file is moved from there
            src, dst = str(f32.path / GGUF_NAME), os.path.join(worker.child.folder, GGUF_NAME)
            worker.child.call("quantize", src, dst, GW.GGUF_TYPES[gguf_type], phase=f"quantizing to {gguf_type}")
            shutil.move(dst, folder / GGUF_NAME)
        finally:
            f32.close()
            if own:
                worker.close()

    return artifact_folder("gguf", key, quantize, what=f"quantizing {loaded.name} to {gguf_type} with llama.cpp")


class LlamaCppRuntime(ChildRuntime):
    """The runtime API (replayer/api.py) over a llama.cpp child process."""

    def __init__(
        self, loaded, max_seq: int, gguf_type: str = "F32", user_file=None, notes=(), header=None, capture=None
    ):
        """`user_file`: a GGUF file run as it is (a sensitivity search's mixed file); `header`: a
        user's GGUF, its header checked (gguf_reader.py), which the child reads through the checked
        descriptor; `notes`: what the runtime's name adds (the config differences a replay allowed);
        `capture`: the kinds to read (RuntimeChoice.capture; None: every kind); empty: llama.cpp
        without the eval callback, tokens and logits only (benchmarks/bench_capture.py's "runtime
        alone")."""
        self.gguf_type = gguf_type
        user_file = header.path if header is not None else user_file
        label = f"{RUNTIME} ({gguf_type if user_file is None else one_line(Path(user_file).name, 100)})"
        fds = (header.descriptor(),) if header is not None else ()
        child = self.start(label, ENGINE, env=ENV, streams=True, pass_fds=fds)
        self.artifact = None
        try:
            if user_file is None:
                self.artifact = gguf_artifact(loaded, gguf_type, quantizer=self)
                self.path, self.note = self.artifact.path / GGUF_NAME, self.artifact.note
            else:
                self.path, self.note = Path(user_file), "a user's file"
            path = f"/proc/self/fd/{fds[0]}" if fds else str(self.path)  # the child's copy of the descriptor
            kinds = None if capture is None else sorted(capture)
            self.vocab = child.call("load", path, int(max_seq), kinds, phase="loading the GGUF file")[2]
        except BaseException:
            self.close()
            raise
        what = gguf_type if user_file is None else f"{one_line(Path(user_file).name, 100)} ({gguf_type})"
        held = (header or read_header(self.path)).types_note(gguf_type)
        more = "".join(f"; {n}" for n in (*notes, *([held] if held else [])))
        self.name = f"llama.cpp:{what} (llama-cpp-python {_version()}, CPU{more})"

    def _step(self, ids: list[int], first: int, probe):
        got: dict[tuple[str, int | None], list[np.ndarray]] = {}

        def keep(kind, layer, arr):
            got.setdefault((kind, layer), []).append(arr.reshape(-1, *arr.shape[-S.KIND_BY_NAME[kind].row_ndim :]))

        reply = self.child.call("decode", ids, first, phase=self.phase(first == 0), tensor=keep)
        order = {k: n for n, k in enumerate(S.KIND_NAMES)}
        sites = []
        for kind, layer in sorted(got, key=lambda kl: (-1 if kl[1] is None else kl[1], order[kl[0]])):
            rows = np.concatenate(got[(kind, layer)])  # ubatches in order
            if kind == "mask" and len(rows) != len(ids):
                continue  # some ubatch's cells no longer were positions (the engine left it out): none of it
            sites.append(((kind, layer), rows))
        self.report(probe, sites)
        return torch.from_numpy(reply[1])

    def prefill(self, input_ids, extra_inputs, probe):
        return self._step([int(t) for t in input_ids], 0, probe)

    def decode(self, token_id, position, probe):
        return self._step([int(token_id)], int(position), probe)

    def close(self) -> None:
        super().close()
        if self.artifact is not None:
            self.artifact.close()  # a temporary (cache off) conversion goes with the runtime
            self.artifact = None


def create(loaded, max_seq: int, choice):
    return LlamaCppRuntime(loaded, max_seq, choice.type, capture=choice.capture)


def _config_notes(header, loaded, allow_config_mismatch: bool) -> list[str]:
    """The file's metadata checked against REF's model config (gguf_reader.py): refused, or noted."""
    from . import gguf_reader as GR

    diffs = GR.check_config(header, loaded, allow_config_mismatch)
    return [f"config differs from REF: {', '.join(diffs)}"] if diffs else []


def run_gguf(loaded, max_seq: int, header, allow_config_mismatch: bool = False, base=None):
    """`trace replay --gguf FILE`: llama.cpp on the user's file as it is (llamacpp/spec.py)."""
    notes = _config_notes(header, loaded, allow_config_mismatch)
    return LlamaCppRuntime(loaded, max_seq, header.type_name(), notes=notes, header=header)


def static_on_weights(loaded, max_seq: int, header, allow_config_mismatch: bool, base):
    """`trace replay --weights-from FILE`: the static runtime (`base()`) on the file's weights,
    dequantized into the model first (llamacpp/spec.py)."""
    from . import gguf_reader as GR

    notes = _config_notes(header, loaded, allow_config_mismatch)
    GR.load_weights(header, loaded)
    rt = base()
    more = "".join(f"; {n}" for n in notes)
    rt.name = f"{rt.name} (weights from {header.path.name}, {header.type_name()}, dequantized{more})"
    return rt


def export_command(request) -> str:
    """`trace export --runtime llama.cpp:TYPE` (`export-gguf`): the converted (and quantized) file,
    written to `request.out` (an ExportRequest, replayer/runtimes/spec.py)."""
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.traces.atomic import check_output_path

    model_dir, gguf_type, output, force = request.model_dir, request.type, request.out, request.force
    check_output_path(output, force, inputs=model_folder_files(model_dir))
    loaded = load_model(model_dir, weights=False)  # the weights are loaded only if it must convert
    art = gguf_artifact(loaded, gguf_type)
    out = Path(output)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(art.path / GGUF_NAME, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        art.close()
    held = read_header(out).types_note(gguf_type)
    return f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {loaded.name}, {gguf_type}, {art.note}" + (
        f"; {held}" if held else ""
    )
