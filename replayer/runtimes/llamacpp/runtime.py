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
step. An image prompt runs as llama.cpp's own multimodal path does (mtmd.py): each image,
rebuilt from the trace's pixels as 8-bit RGB at the processor's size, goes through mtmd with the
project's mmproj conversion of the vision tower (gguf_mmproj.py) and HF's token budget (at most
the trace's patch budget / pooling^2 soft tokens, at least 1: mtmd's own default is 70 to 1120,
GEMMA4_TRACE_LLAMACPP_IMAGE_TOKENS=mtmd keeps it), every named vision node captured; the soft
tokens are decoded as an embeddings batch between the prompt's text tokens. An audio prompt runs
the same way through mtmd's gemma4a audio tower (audio.py, mtmd_audio.py): fed HF's features from
REF (--audio-features hf) or its own from the clip's waveform (native, --audio FILE).

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
from gemma4_trace.traces.errors import TraceToolError, one_line

from ...api import report
from ...artifacts import artifact_folder, code_digest, model_folder_files, model_hash
from ...child import ChildRuntime
from . import audio as AU
from . import gguf_mmproj as GM
from . import gguf_writer as GW
from .gguf_mmproj_audio import audio_config
from .gguf_reader import read_header

RUNTIME = "llama.cpp"
ENGINE = "gemma4_trace.replayer.runtimes.llamacpp.engine:LlamaCppEngine"
GGUF_NAME = "model.gguf"
WRITER_CODE = "runtimes/llamacpp/gguf_writer.py"  # a change to the writer converts again
MMPROJ_CODE = "runtimes/llamacpp/gguf_mmproj.py"
IMAGE_TOKENS_ENV = "GEMMA4_TRACE_LLAMACPP_IMAGE_TOKENS"  # "mtmd" (its own budget) or "MIN,MAX"


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

    def quantize(folder: Path, f32) -> None:
        own = quantizer is None
        worker = start_child(f"{RUNTIME} ({gguf_type})") if own else quantizer
        try:
            # the child writes only in its own folder (replayer/confine.py); the file is moved from there
            src, dst = str(f32.path / GGUF_NAME), os.path.join(worker.child.folder, GGUF_NAME)
            worker.child.call("quantize", src, dst, GW.GGUF_TYPES[gguf_type], phase=f"quantizing to {gguf_type}")
            shutil.move(dst, folder / GGUF_NAME)
        finally:
            if own:
                worker.close()

    return artifact_folder(
        "gguf",
        key,
        quantize,
        what=f"quantizing {loaded.name} to {gguf_type} with llama.cpp",
        needs=lambda: (gguf_artifact(loaded, "F32"),),
    )


def mmproj_artifact(loaded):
    """The artifact-cache entry holding `loaded`'s vision tower as an F32 mmproj GGUF (gguf_mmproj.py)."""
    GM.check_supported(loaded)
    key = {"model": model_hash(loaded.model_dir), "code": code_digest(MMPROJ_CODE), "file": GM.MMPROJ_NAME}

    def build(folder: Path) -> None:
        GM.write(GW.with_weights(loaded), folder / GM.MMPROJ_NAME)

    return artifact_folder("gguf", key, build, what=f"writing {loaded.name}'s vision tower as an mmproj GGUF (F32)")


def image_budget(hf_budget: int) -> tuple[int, int]:
    """mtmd's (image_min_tokens, image_max_tokens): HF's (1, the trace's budget), or IMAGE_TOKENS_ENV's
    ("mtmd": 0, 0, mtmd's own default; "MIN,MAX")."""
    text = os.environ.get(IMAGE_TOKENS_ENV, "").strip()
    if not text:
        return 1, hf_budget
    if text == "mtmd":
        return 0, 0
    lo, _, hi = text.partition(",")
    if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi) <= 1 << 16):
        raise TraceToolError(f"{IMAGE_TOKENS_ENV}={text[:40]!r}: expected mtmd, or MIN,MAX (1 <= MIN <= MAX <= 65536)")
    return int(lo), int(hi)


def image_rgb(pixels: np.ndarray, positions: np.ndarray, patch: int) -> tuple[np.ndarray, bool]:
    """One image's processor patches (patches, 3 p^2: rows, columns, channels) at their (x, y)
    positions (-1: padding) -> (height, width, 3) 8-bit RGB at the processor's size, and whether
    8 bits hold the pixels exactly (the processor resized: they are rounded)."""
    real = (positions >= 0).all(axis=-1)
    xs, ys = positions[real, 0].astype(np.int64), positions[real, 1].astype(np.int64)
    if not real.any():
        raise TraceToolError("an image of the trace has no real patch")
    nx, ny = int(xs.max()) + 1, int(ys.max()) + 1
    if nx * ny != int(real.sum()):
        raise TraceToolError(f"an image's {int(real.sum())} patches do not fill its {nx}x{ny} grid")
    grid = np.zeros((ny, nx, patch, patch, 3), dtype=np.float32)
    grid[ys, xs] = pixels[real].reshape(-1, patch, patch, 3)
    image = grid.transpose(0, 2, 1, 3, 4).reshape(ny * patch, nx * patch, 3) * 255.0
    rgb = np.clip(np.rint(image), 0, 255)
    return rgb.astype(np.uint8), bool(np.abs(image - rgb).max() < 1e-3)


def image_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of the image token in the prompt: an image's soft-token slots."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


class LlamaCppRuntime(ChildRuntime):
    """The runtime API (replayer/api.py) over a llama.cpp child process."""

    def __init__(
        self,
        loaded,
        max_seq: int,
        gguf_type: str = "F32",
        user_file=None,
        notes=(),
        header=None,
        capture=None,
        mmproj=None,
        audio_features: str = "hf",
        audio=None,
    ):
        """`user_file`: a GGUF file run as it is (a sensitivity search's mixed file); `header`: a
        user's GGUF, its header checked (gguf_reader.py), which the child reads through the checked
        descriptor; `notes`: what the runtime's name adds (the config differences a replay allowed);
        `capture`: the kinds to read (RuntimeChoice.capture; None: every kind); empty: llama.cpp
        without the eval callback, tokens and logits only (benchmarks/bench_capture.py's "runtime
        alone"); `mmproj`: (header, notes) of a user's mmproj file (--mmproj), else the project's
        conversion of REF's vision tower runs an image prompt; `audio_features`: "hf" or "native"
        (audio.py), `audio`: (header, notes) of `--audio FILE`, the clip's waveform for native."""
        self.gguf_type, self.loaded, self.capture = gguf_type, loaded, capture
        self.audio_features, self.audio_file = audio_features, audio[0] if audio is not None else None
        self.frontend: list = []  # (REF's features, llama.cpp's) of each clip, native features only
        self.audio_mmproj, self.audio_ready = None, False
        self.mmproj = self.budget = None
        self.mmproj_file = mmproj[0] if mmproj is not None else None
        user_file = header.path if header is not None else user_file
        label = f"{RUNTIME} ({gguf_type if user_file is None else one_line(Path(user_file).name, 100)})"
        fds = (header.descriptor(),) if header is not None else ()
        fds += (self.mmproj_file.descriptor(),) if self.mmproj_file is not None else ()
        child = self.start(label, ENGINE, env=ENV, streams=True, pass_fds=fds)
        self.artifact = None
        try:
            if user_file is None:
                self.artifact = gguf_artifact(loaded, gguf_type, quantizer=self)
                self.path, self.note = self.artifact.path / GGUF_NAME, self.artifact.note
            else:
                self.path, self.note = Path(user_file), "a user's file"
            # a user's file: the child's copy of its checked descriptor
            path = f"/proc/self/fd/{fds[0]}" if header is not None else str(self.path)
            kinds = None if capture is None else sorted(capture)
            self.vocab = child.call("load", path, int(max_seq), kinds, phase="loading the GGUF file")[2]
        except BaseException:
            self.close()
            raise
        what = gguf_type if user_file is None else f"{one_line(Path(user_file).name, 100)} ({gguf_type})"
        held = (header or read_header(self.path)).types_note(gguf_type)
        mine = [f"mmproj {one_line(self.mmproj_file.path.name, 100)}", *mmproj[1]] if mmproj is not None else []
        if audio_config(loaded) is not None:  # a model with an audio tower: how an audio prompt runs
            mine += [AU.name_note(audio_features, self.audio_file), *(audio[1] if audio is not None else ())]
        more = "".join(f"; {n}" for n in (*notes, *([held] if held else []), *mine))
        self.name = f"llama.cpp:{what} (llama-cpp-python {_version()}, CPU{more})"

    def _step(self, ids: list[int], first: int, probe):
        got: dict[tuple[str, int | None], list[np.ndarray]] = {}
        reply = self.child.call("decode", ids, first, phase=self.phase(first == 0), tensor=self._keeper(got))
        self._report_text(probe, got, len(ids))
        return torch.from_numpy(reply[1])

    @staticmethod
    def _keeper(got: dict):
        def keep(kind, layer, arr):
            got.setdefault((kind, layer), []).append(arr.reshape(-1, *arr.shape[-S.KIND_BY_NAME[kind].row_ndim :]))

        return keep

    def _report_text(self, probe, got: dict, n_rows: int) -> None:
        order = {k: n for n, k in enumerate(S.KIND_NAMES)}
        sites = []
        for kind, layer in sorted(got, key=lambda kl: (-1 if kl[1] is None else kl[1], order[kl[0]])):
            rows = np.concatenate(got[(kind, layer)])  # ubatches (and the prompt's pieces) in order
            if kind == "mask" and len(rows) != n_rows:
                continue  # some ubatch's cells no longer were positions (the engine left it out): none of it
            sites.append(((kind, layer), rows))
        self.report(probe, sites)

    def prefill(self, input_ids, extra_inputs, probe):
        ids = [int(t) for t in input_ids]
        if "input_features" in (extra_inputs or {}):
            runs = image_runs(ids, int(self.loaded.model.config.audio_token_id))
            return AU.prefill_audio(self, ids, extra_inputs, probe, runs)
        if "pixel_values" in (extra_inputs or {}):
            return self._prefill_images(ids, extra_inputs, probe)
        return self._step(ids, 0, probe)

    def _load_vision(self, hf_budget: int) -> None:
        """mtmd on the mmproj, once (a replay's images share the budget: the trace's patch budget)."""
        budget = image_budget(hf_budget)
        if self.budget is not None:  # mtmd is loaded
            if budget != self.budget:
                raise TraceToolError(f"the prompt's images have another token budget ({budget}) than {self.budget}")
            return
        vc = GM.vision_config(self.loaded)
        kinds = None if self.capture is None else sorted(k for k in self.capture if S.KIND_BY_NAME[k].tower != S.TEXT)
        if self.mmproj_file is not None:  # the user's file: the child's copy of its checked descriptor
            path = f"/proc/self/fd/{self.mmproj_file.descriptor()}"
        else:
            self.mmproj = mmproj_artifact(self.loaded)
            path = str(self.mmproj.path / GM.MMPROJ_NAME)
        self.child.call("vision", path, int(vc.num_hidden_layers), kinds, *budget, phase="loading the mmproj file")
        self.budget = budget

    def _prefill_images(self, ids: list[int], extra: dict, probe):
        """The prompt with images: each image through mtmd (its vision sites reported image after
        image), then the text tokens and each image's soft tokens decoded in prompt order."""
        config = self.loaded.model.config
        pixels = np.asarray(extra["pixel_values"], dtype=np.float32)
        positions = np.asarray(extra["image_position_ids"])
        runs = image_runs(ids, int(config.image_token_id))
        if len(runs) != len(pixels):
            raise TraceToolError(f"the prompt has {len(runs)} runs of image tokens for {len(pixels)} images")
        vc = GM.vision_config(self.loaded)
        k, patch = int(vc.pooling_kernel_size), int(vc.patch_size)
        self._load_vision(pixels.shape[1] // (k * k))
        vision: dict[tuple[str, int | None], list[np.ndarray]] = {}
        soft = []
        for i, (start, slots) in enumerate(runs):
            rgb, _ = image_rgb(pixels[i], positions[i], patch)
            one: dict = {}  # (kind, layer) -> array: std_scaled, read after pooled, replaces it
            reply = self.child.call(
                "encode",
                rgb.tobytes(),
                rgb.shape[1],
                rgb.shape[0],
                phase=f"prefill (image {i + 1})",
                tensor=lambda kind, layer, arr, one=one: one.__setitem__((kind, layer), arr),
            )
            _, embd, non_causal = reply
            if len(embd) != slots:
                lo, hi = self.budget
                words = f"{lo} to {hi}" if lo else "mtmd's own, 70 to 1120"
                raise TraceToolError(
                    f"llama.cpp's mtmd made {len(embd)} soft tokens of image {i + 1} where the trace has "
                    f"{slots}: its image token budget ({words}) sized the image otherwise than the processor did"
                )
            for key, arr in one.items():
                vision.setdefault(key, []).append(arr.reshape(-1, *arr.shape[-S.KIND_BY_NAME[key[0]].row_ndim :]))
            soft.append((start, embd, non_causal))
        order = {key: n for n, key in enumerate(S.KIND_BY_NAME)}
        for kind, layer in sorted(vision, key=lambda kl: (-1 if kl[1] is None else kl[1], order[kl[0]])):
            spec = S.KIND_BY_NAME[kind]
            report(probe, spec.name, torch.from_numpy(np.concatenate(vision[(kind, layer)])), layer, tower=spec.tower)
        return self.decode_soft(ids, soft, probe)

    def load_audio(self) -> None:
        """mtmd on the audio mmproj (the user's --mmproj, or the project's conversion), once."""
        if self.audio_ready:
            return
        ac = audio_config(self.loaded)
        if ac is None:
            raise TraceToolError(f"{self.loaded.name} has no audio tower: REF's audio cannot be replayed")
        kinds = None if self.capture is None else sorted(k for k in self.capture if S.KIND_BY_NAME[k].tower == "audio")
        if self.mmproj_file is not None:
            path = f"/proc/self/fd/{self.mmproj_file.descriptor()}"
        else:
            self.audio_mmproj = AU.audio_artifact(self.loaded)
            path = str(self.audio_mmproj.path / AU.GA.MMPROJ_NAME)
        self.child.call("audio", path, int(ac.num_hidden_layers), kinds, phase="loading the audio mmproj file")
        self.audio_ready = True

    def decode_soft(self, ids: list[int], soft: list, probe):
        """The prompt's text tokens and each media's soft tokens ((start, embd, non_causal), in
        prompt order) decoded as they come; the text tower's sites reported as one prefill."""
        got: dict = {}
        keep, at, reply = self._keeper(got), 0, None
        self.phase(True)
        for start, embd, non_causal in soft:
            if start > at:
                self.child.call("decode", ids[at:start], at, phase="prefill", tensor=keep)
            reply = self.child.call("decode_embd", embd, start, non_causal, phase="prefill", tensor=keep)
            at = start + len(embd)
        if at < len(ids):
            reply = self.child.call("decode", ids[at:], at, phase="prefill", tensor=keep)
        self._report_text(probe, got, len(ids))
        return torch.from_numpy(reply[1])

    def decode(self, token_id, position, probe):
        return self._step([int(token_id)], int(position), probe)

    def close(self) -> None:
        super().close()
        for art in (self.mmproj, self.audio_mmproj):
            if art is not None:
                art.close()
        self.mmproj = self.audio_mmproj = None
        if self.artifact is not None:
            self.artifact.close()  # a temporary (cache off) conversion goes with the runtime
            self.artifact = None


def create(loaded, max_seq: int, choice):
    return LlamaCppRuntime(
        loaded,
        max_seq,
        choice.type,
        capture=choice.capture,
        mmproj=choice.file("mmproj"),
        audio_features=choice.audio_features,
        audio=choice.file("audio"),
    )


def check_mmproj(loaded, header, allow_config_mismatch: bool) -> list[str]:
    """`--mmproj FILE` (a companion file input, llamacpp/spec.py) against REF's checkpoint: the
    differences that change what the tower computes refused unless allowed; what the file leaves
    to mtmd's defaults noted (gguf_mmproj.py)."""
    diffs, notes = GM.config_differences(header, loaded)
    if diffs and not allow_config_mismatch:
        raise TraceToolError(
            f"{header.path} does not match REF's vision tower: {'; '.join(diffs)} "
            "(--allow-config-mismatch replays it anyway)"
        )
    return [*(f"mmproj differs from REF: {d}" for d in diffs), *notes]


def _config_notes(header, loaded, allow_config_mismatch: bool) -> list[str]:
    """The file's metadata checked against REF's model config (gguf_reader.py): refused, or noted."""
    from . import gguf_reader as GR

    diffs = GR.check_config(header, loaded, allow_config_mismatch)
    return [f"config differs from REF: {', '.join(diffs)}"] if diffs else []


def run_gguf(loaded, max_seq: int, header, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --gguf FILE [--mmproj FILE]`: llama.cpp on the user's file as it is (llamacpp/spec.py)."""
    notes = _config_notes(header, loaded, allow_config_mismatch)
    mmproj = choice.file("mmproj") if choice is not None else None
    audio = dict(audio_features=choice.audio_features, audio=choice.file("audio")) if choice is not None else {}
    return LlamaCppRuntime(loaded, max_seq, header.type_name(), notes=notes, header=header, mmproj=mmproj, **audio)


def static_on_weights(loaded, max_seq: int, header, allow_config_mismatch: bool, base, choice=None):
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
