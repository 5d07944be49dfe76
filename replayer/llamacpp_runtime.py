"""`--runtime llama.cpp[:TYPE]`: REF's checkpoint converted to GGUF by the project's writer
(replayer/gguf_writer.py), quantized to TYPE by llama.cpp's `llama_model_quantize`, and run
by llama.cpp (llama-cpp-python, extra `gemma4-trace[llamacpp]`) in a child process.

    trace replay REF.h5 --runtime llama.cpp -o run.h5           # F32
    trace replay REF.h5 --runtime llama.cpp:Q8_0 -o q8.h5
    trace export-gguf --type Q4_K_M -o tiny-q4km.gguf

Capture: the scheduler's eval callback hands each graph node to the child, which sends the
canonical kinds' nodes back (replayer/_llamacpp_child.py names the mapping): embeddings,
per_layer_inputs, q and k (after their norm and RoPE), v (after its norm), attn_out (o_proj's
output), layer_out, final_hidden, and each layer's attention mask (a graph input, read as the
mask operand of the layer's attention node). The RoPE tables are not graph nodes llama.cpp
exposes: they are absent from the trace (never zeros), and `trace diff` says so.

Teacher-forced and free-running: the prompt is one prefill (one llama_decode call; a prompt
longer than a ubatch runs as several graphs, their rows stitched in order), then one token per
step. Image prompts are refused: llama.cpp's Gemma 4 vision path runs through its own mmproj
tower, which this runtime does not drive.

A crash inside llama.cpp ends the child only: the replay stops with one line naming the
runtime, TYPE, the phase and the last kind reported, and no trace is left behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError, install_hint

from . import gguf_writer as GW
from . import native_child
from .artifacts import caching

RUNTIME = "llama.cpp"
# the llama.cpp float tolerance profile (docs/runtime-llamacpp.md): `trace diff --tolerances` it
PROFILE_F32 = Path(str(files("gemma4_trace.diff") / "profiles" / "llamacpp-f32.toml"))


def parse_spec(spec: str) -> str | None:
    """'llama.cpp' or 'llama.cpp:TYPE' -> TYPE (default F32); anything else -> None."""
    if spec == RUNTIME:
        return "F32"
    name, sep, gguf_type = spec.partition(":")
    if name != RUNTIME or not sep:
        return None
    return GW.check_type(gguf_type)


def check_installed() -> None:
    for module, what in (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")):
        if importlib.util.find_spec(module) is None:
            raise TraceToolError(f"--runtime llama.cpp needs {what}: {install_hint('llamacpp')}")


class Child(native_child.Child):
    """The llama.cpp child process (replayer/_llamacpp_child.py) and its reply stream; a crash
    names the last kind reported."""

    def __init__(self, label: str):
        # ggml's abort message, not a debugger's backtrace
        super().__init__(label, "gemma4_trace.replayer._llamacpp_child", env={"GGML_NO_BACKTRACE": "1"})
        self.last: tuple[str, int | None] | None = None

    def seen(self, msg) -> None:
        if msg[0] == "tensor":
            self.last = (msg[1], msg[2])

    def progress(self) -> str:
        if self.last is None:
            return "before reporting anything"
        kind, layer = self.last
        return f"after {kind}" if layer is None else f"after layer {layer} {kind}"


def gguf_file(loaded, gguf_type: str, cache=None, child: Child | None = None) -> tuple[Path, str]:
    """The cached GGUF of `loaded` at `gguf_type` (converted and quantized now if absent) and a
    note of what was done ("cached" / "converted in 0.1 s" / ...)."""
    t0 = time.perf_counter()
    f32, wrote = GW.converted_f32(loaded, cache)
    if gguf_type == "F32":
        return f32, (f"converted in {time.perf_counter() - t0:.1f} s" if wrote else "cached")
    path = GW.cache_path(loaded.model_dir, gguf_type, cache)
    if path.is_file():
        return path, "cached"
    own = child is None
    child = child or Child(f"{RUNTIME} ({gguf_type})")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        child.send("quantize", str(f32), str(tmp), GW.GGUF_TYPES[gguf_type])
        child.receive(f"quantizing to {gguf_type}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        if own:
            child.close()
    return path, f"{'converted and ' if wrote else ''}quantized in {time.perf_counter() - t0:.1f} s"


class LlamaCppRuntime:
    """The runtime API (replayer/api.py) over a llama.cpp child process."""

    def __init__(self, loaded, max_seq: int, gguf_type: str = "F32", cache=None, user_file=None, notes=()):
        """`user_file`: a user's GGUF (its header checked, replayer/gguf_reader.py), run as it is;
        `notes`: what the runtime's name adds (the config differences a replay allowed)."""
        check_installed()
        self.gguf_type = gguf_type
        self.scratch = None  # --no-cache: the conversion goes to a folder removed with the runtime
        if user_file is None and cache is None and not caching():
            self.scratch = cache = tempfile.mkdtemp(prefix="gemma4-trace-gguf-")
        label = f"{RUNTIME} ({gguf_type if user_file is None else Path(user_file).name})"
        self.child = Child(label)
        try:
            if user_file is None:
                self.path, self.note = gguf_file(loaded, gguf_type, cache, self.child)
            else:
                self.path, self.note = Path(user_file), "a user's file"
            self.child.send("load", str(self.path), int(max_seq))
            _, desc, n_vocab = self.child.receive(f"loading {self.path}")
        except BaseException:
            self.child.close()
            self._remove_scratch()
            raise
        from importlib.metadata import version

        what = gguf_type if user_file is None else f"{Path(user_file).name} ({gguf_type})"
        more = "".join(f"; {n}" for n in notes)
        self.name = f"llama.cpp:{what} (llama-cpp-python {version('llama-cpp-python')}, CPU{more})"
        self.vocab = n_vocab
        self.mm_token_ids = {
            int(getattr(loaded.config, k))
            for k in ("image_token_id", "video_token_id", "audio_token_id")
            if getattr(loaded.config, k, None) is not None
        }

    def _step(self, ids: list[int], first: int, phase: str, probe):
        self.child.last = None
        self.child.send("decode", ids, first)
        got: dict[tuple[str, int | None], list[np.ndarray]] = {}
        while True:
            msg = self.child.receive(phase)
            if msg[0] == "logits":
                break
            _, kind, layer, arr = msg
            got.setdefault((kind, layer), []).append(arr.reshape(-1, *arr.shape[-S.KIND_BY_NAME[kind].row_ndim :]))
        if probe is not None:
            order = {k: n for n, k in enumerate(S.KIND_NAMES)}
            for kind, layer in sorted(got, key=lambda kl: (-1 if kl[1] is None else kl[1], order[kl[0]])):
                rows = np.concatenate(got[(kind, layer)])  # ubatches in order
                if kind == "mask" and len(rows) != len(ids):
                    continue  # some ubatch's cells no longer were positions (the child left it out): none of it
                probe.tensor(kind, torch.from_numpy(rows), layer=layer)
        return torch.from_numpy(msg[1])

    def prefill(self, input_ids, extra_inputs, probe):
        ids = [int(t) for t in input_ids]
        if extra_inputs or self.mm_token_ids.intersection(ids):
            raise TraceToolError(
                f"{RUNTIME} replays text-only traces; this one has an image "
                "(llama.cpp runs Gemma 4's vision through its own mmproj tower, not driven here)"
            )
        return self._step(ids, 0, "prefill", probe)

    def decode(self, token_id, position, probe):
        return self._step([int(token_id)], int(position), f"decode at position {position}", probe)

    def _remove_scratch(self) -> None:
        if getattr(self, "scratch", None):
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def __del__(self):
        child = getattr(self, "child", None)
        if child is not None:
            child.close()
        self._remove_scratch()


def make_llamacpp(gguf_type: str):
    def factory(loaded, max_seq: int):
        if loaded.dtype != "float32":
            raise TraceToolError(
                f"--runtime llama.cpp converts float32 checkpoints; REF was recorded in {loaded.dtype}"
            )
        return LlamaCppRuntime(loaded, max_seq, gguf_type)

    return factory


def make_gguf_runtime(runtime: str, loaded, max_seq: int, header, allow_config_mismatch: bool, weights_from: bool):
    """`trace replay --gguf FILE` (llama.cpp on the user's file) or `--runtime static
    --weights-from FILE` (the static runtime on its dequantized weights), after the file's
    metadata is checked against REF's model config (replayer/gguf_reader.py)."""
    from . import gguf_reader as GR
    from .api import make_runtime

    if loaded.dtype != "float32":
        raise TraceToolError(
            f"{header.path}: a GGUF replays against float32 references; REF was recorded in {loaded.dtype}"
        )
    diffs = GR.check_config(header, loaded, allow_config_mismatch)
    notes = [f"config differs from REF: {', '.join(diffs)}"] if diffs else []
    if weights_from:
        GR.load_weights(header, loaded)
        rt = make_runtime(runtime, loaded, max_seq)
        more = "".join(f"; {n}" for n in notes)
        rt.name = f"{rt.name} (weights from {header.path.name}, {header.type_name()}, dequantized{more})"
        return rt
    return LlamaCppRuntime(loaded, max_seq, header.type_name(), user_file=header.path, notes=notes)


def export_command(model_dir, gguf_type: str, output, force: bool = False) -> str:
    """`trace export-gguf`: the converted (and quantized) file, written to `output`."""
    import shutil

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.traces.atomic import check_output_path

    GW.check_type(gguf_type)
    check_output_path(output, force)
    if gguf_type != "F32":
        check_installed()
    loaded = load_model(model_dir, weights=False)  # the weights are loaded only if it must convert
    src, note = gguf_file(loaded, gguf_type)
    out = Path(output)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {loaded.name}, {gguf_type}, {note}"
