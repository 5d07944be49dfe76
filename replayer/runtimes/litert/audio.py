"""An audio prompt through `--runtime litert`'s audio graphs (replayer/runtimes/litert/runtime.py runs
the text tower): litert-torch 0.10.0's export of Gemma 4's audio encoder and of embed_audio, at REF's
clip length, one clip a call, kept in the artifact cache:

    audio     python -m gemma4_trace.replayer.runtimes.litert.audio export MODEL OUT FRAMES
              -> audio_encoder.tflite  audio_ROWS: src_inputs (1, FRAMES, mel bins), mask (1, 1, FRAMES)
                                       -> features (1, ROWS, output_proj_dims), mask (1, ROWS)
                 audio_adapter.tflite  audio_adapter_ROWS: features, mask -> features (1, ROWS, text hidden)

what `export_hf --task multimodal_lm --export_audio_encoder=True` runs (export_lib's
export_audio_encoder_models_for_llm: litert-torch's load_model, hence its Gemma 4 patch context, its
exportable modules, its converter), with two samples of the right size where litert-torch 0.10.0's are
fixed: the encoder's is REF's FRAMES mel frames (litert-torch's is 816 frames, `audio_204`, whatever
`input_sec` says), the adapter's output_proj_dims wide (litert-torch's is 1536 wide, and its export fails
where the tower's is not: docs/upstream/litert-torch-gemma4-audio-adapter.md; the replay says so on
stderr and in the runtime's name). ROWS = FRAMES subsampled twice by 2.

The encoder takes HF's log-mel features (`input_features`, `input_features_mask`), REF's own: no
waveform is needed. Every audio site is read from the encoder's preserved tensors (audio_taps; the
capture map's audio rows); rows are a clip's real subsampled frames (the encoder's mask), clip after
clip; the soft tokens (the adapter's rows at that mask) replace the audio tokens' embeddings.
"""

from __future__ import annotations

import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError

from ...api import report as report_site
from ...artifacts import artifact_folder, code_digest, model_hash, staged_checkpoint
from . import export as E
from . import graph as G
from .spec import LITERT

AUDIO_FILES = ("audio_encoder.tflite", "audio_adapter.tflite")
AUDIO_FORMAT = 1  # bump when the audio files' layout or the way they are exported changes
UPSTREAM_FRAMES, UPSTREAM_WIDTH = 816, 1536  # litert-torch 0.10.0's samples: audio_204, adapter 1536 wide
SUBSAMPLED = LITERT.row("audio.subsampled")
LAYER_ROWS = {k: LITERT.row(f"audio.{k}") for k in ("ff1_out", "attn_out", "lconv_out", "ff2_out", "layer_out")}


def rows_of(frames: int) -> int:
    """Subsampled frames of `frames` mel frames: two stride-2 convolutions (padding 1, kernel 3)."""
    return ((int(frames) + 1) // 2 + 1) // 2


def adapter_note(audio_cfg) -> str | None:
    """What the replay says on stderr when litert-torch's own adapter export fails on this model (its
    sample is 1536 wide, not output_proj_dims); None where the two agree (E2B, E4B: 1536)."""
    width = int(audio_cfg.output_proj_dims)
    if width == UPSTREAM_WIDTH:
        return None
    return (
        f"litert: audio_adapter.tflite (embed_audio) exported with the tower's output_proj_dims {width} as its "
        f"input width; litert-torch {version('litert-torch')}'s export_hf gives it a sample {UPSTREAM_WIDTH} wide "
        "and fails on this model (docs/upstream/litert-torch-gemma4-audio-adapter.md)"
    )


def audio_key(loaded, frames: int) -> dict:
    return {
        "format": AUDIO_FORMAT,
        "graph": "audio",
        "model": model_hash(loaded.model_dir),
        "frames": int(frames),
        "code": code_digest("runtimes/litert/audio.py"),
        **E.versions(),
    }


def audio_exported(loaded, frames: int):
    """The artifact holding AUDIO_FILES for clips of `frames` mel frames."""
    E.check_checkpoint(loaded.model_dir)

    def build(folder: Path) -> None:
        staged = staged_checkpoint(loaded.model_dir, folder / "checkpoint")
        E.run_tool(
            [sys.executable, "-m", __name__, "export", str(staged), str(folder), str(int(frames))],
            "litert-torch's Gemma 4 audio encoder export",
            cwd=folder,
        )
        for name in AUDIO_FILES:
            if not (folder / name).is_file():
                raise TraceToolError(f"litert-torch's audio export wrote no {name}")
        shutil.rmtree(folder / "checkpoint")

    return artifact_folder(
        "litert",
        audio_key(loaded, frames),
        build,
        what=f"exporting {loaded.name}'s audio tower with litert-torch ({frames} mel frames a clip, float32)",
    )


def _export_audio(model: str, out: str, frames: str) -> None:
    """The child's work: export_audio_encoder_models_for_llm's steps, the encoder's sample REF's clip
    length and the adapter's output_proj_dims wide (module docstring)."""
    from litert_torch._convert import interface as converter_utils
    from litert_torch.generative.export_hf.core import export_lib
    from litert_torch.generative.export_hf.core import exportable_module as M
    from litert_torch.generative.export_hf.model_ext import exportables

    n = int(frames)
    cfg = M.ExportableModuleConfig(
        model=model, output_dir=out, work_dir=out, task="multimodal_lm", quantization_recipe=None,
        export_vision_encoder=False, export_audio_encoder=True,
    )  # fmt: skip
    src = export_lib.load_model(model, cfg, task=cfg.task)
    cfg = export_lib.update_export_config(cfg, src)
    src.model.set_attn_implementation("eager")  # as export_audio_encoder_models_for_llm
    encoder_cls, adapter_cls, _ = exportables.get_audio_exportables(src.model_config)
    bins = int(src.feature_extractor.feature_size)
    rows, width = rows_of(n), int(src.model_config.audio_config.output_proj_dims)
    samples = {
        "audio_encoder": (encoder_cls(src.model, cfg), f"audio_{rows}", {
            "src_inputs": torch.zeros(1, n, bins), "mask": torch.ones(1, 1, n, dtype=torch.bool)}),
        "audio_adapter": (adapter_cls(src.model, cfg, src.tokenizer), f"audio_adapter_{rows}", {
            "features": torch.zeros(1, rows, width), "mask": torch.ones(1, rows, dtype=torch.bool)}),
    }  # fmt: skip
    for name, (module, sig, sample) in samples.items():
        conv = converter_utils.Converter()
        conv.add_signature(sig, module.eval(), sample_kwargs=sample)
        conv.convert(strict_export=False).export(str(Path(out) / f"{name}.tflite"))


def audio_taps(sig, layers: int, hidden: int) -> list:
    """The audio tower's sites in the encoder's signature: each scope's last (1, n, hidden) tensor
    (the subsampling block's projection; per layer feed_forward1, the attention (post's output),
    lconv1d, feed_forward2 and the layer itself: its norm_out). A graph that does not give every
    layer's output is refused in one line."""
    found: dict = {}  # (kind key, layer) -> tensor index; a later tensor replaces an earlier one
    for t in sorted(sig.producer, key=lambda t: sig.producer[t]):
        x = sig.tensors[t]
        first, shape = x.parts()[0], x.shape
        if not (len(shape) == 3 and shape[0] == 1 and shape[-1] == hidden):
            continue
        if SUBSAMPLED.matches(first):
            found[("audio.subsampled", None)] = t
            continue
        for kind, row in LAYER_ROWS.items():  # the layer's own row last: the sub-scopes first
            layer = row.layer_of(first)
            if layer is not None and 0 <= layer < layers and row.matches(first):
                found[(f"audio.{kind}", layer)] = t
                break
    have = {layer for (k, layer) in found if k == "audio.layer_out"}
    if have != set(range(layers)):
        raise TraceToolError(
            f"the LiteRT audio encoder names layer outputs {sorted(have)}; REF's audio tower has {layers} layers "
            "(another litert-torch release names its tensors otherwise)"
        )
    order = ["audio.subsampled"] + [f"audio.{k}" for k in LAYER_ROWS]
    keys = sorted(found, key=lambda ki: (ki[1] is not None, ki[1] or 0, order.index(ki[0])))
    return [G.Tap(found[k], k[0], k[1]) for k in keys]


class LiteRTAudio:
    """The audio side of one LiteRTRuntime `rt` (its child, phases, kinds kept and name)."""

    def __init__(self, rt):
        self.rt = rt
        top = rt.loaded.config
        self.acfg = getattr(top, "audio_config", None)  # None: a model without an audio tower
        self.audio_id = getattr(top, "audio_token_id", None)
        self.frames = None  # the loaded graphs' clip length
        self.soft: dict = {}  # this prompt's {position: soft token}

    def prepare(self, extra: dict) -> None:
        """Export (or take from the artifact cache) and load the graphs for REF's clip length, where
        REF has audio (LiteRTRuntime.prepare)."""
        feats = extra.get("input_features")
        if feats is not None and self.acfg is not None and len(getattr(feats, "shape", ())) == 3:
            self._load(int(feats.shape[1]), "loading")

    def prompt(self, ids: list[int], extra: dict, probe) -> dict:
        """The prompt's clips through the audio graphs: {position: soft token} at the audio tokens,
        every audio site reported to `probe`."""
        self.soft = {}
        if "input_features" not in extra:
            return self.soft
        if self.acfg is None:
            raise TraceToolError("input_features given to a model without an audio tower (no audio_config)")
        if "input_features_mask" not in extra:
            raise TraceToolError("input_features given without input_features_mask")
        feats = np.asarray(extra["input_features"], np.float32)
        mask = np.asarray(extra["input_features_mask"]).astype(bool)
        if feats.ndim != 3 or mask.shape != feats.shape[:2]:
            raise TraceToolError(
                f"input_features {feats.shape} and input_features_mask {mask.shape} are not (clips, frames, bins) "
                "and (clips, frames)"
            )
        soft = self._encode(feats, mask, probe)
        slots = [p for p, t in enumerate(ids) if t == self.audio_id]
        if soft.shape[0] != len(slots):
            raise TraceToolError(
                f"the clips give {soft.shape[0]} soft tokens for {len(slots)} audio-token slots in the prompt "
                "(the audio tower subsamples otherwise than the processor did)"
            )
        self.soft = dict(zip(slots, soft))
        return self.soft

    def _load(self, frames: int, phase: str) -> None:
        """Export (or take from the artifact cache) and load the audio graphs for clips of `frames`
        mel frames, once per length."""
        if self.frames == frames:
            return
        art = audio_exported(self.rt.loaded, frames)
        rows = rows_of(frames)
        try:
            paths = {n.removesuffix(".tflite"): str(art.path / n) for n in AUDIO_FILES}
            graph = G.read(paths["audio_encoder"])
            self.esig, self.asig = f"audio_{rows}", f"audio_adapter_{rows}"
            if self.esig not in graph:
                raise TraceToolError(
                    f"the LiteRT audio encoder has no {self.esig!r} signature (it has {', '.join(graph)})"
                )
            a = self.acfg
            taps = audio_taps(graph[self.esig], int(a.num_hidden_layers), int(a.hidden_size))
            self.taps = [t for t in taps if self.rt.captures(t.kind)]
            keep = ["audio_encoder"] if self.taps else []
            meta = self.rt.child.call("load", paths, keep, phase=phase)[1]
        finally:
            art.close()
        outs = meta["audio_encoder"].get(self.esig, ({}, []))[1]
        if not {"features", "mask"} <= set(outs) or self.asig not in meta["audio_adapter"]:
            raise TraceToolError("the LiteRT audio graphs do not return features and mask, and soft tokens")
        self.frames = frames
        note = adapter_note(self.acfg)
        if note:
            print(f"note: {note}", file=sys.stderr)
        fixed = "; audio_adapter.tflite sized by output_proj_dims (audio.py)" if note else ""
        rt = self.rt
        if rt._name and "; audio tower:" not in rt._name:
            rt._name = rt._name[:-1] + f"; audio tower: audio_encoder.tflite at {frames} mel frames a clip{fixed})"

    def _encode(self, feats: np.ndarray, mask: np.ndarray, probe) -> np.ndarray:
        """(clips, frames, bins) features -> the soft tokens of their real subsampled frames, clip after
        clip; each clip one call of the encoder and the adapter."""
        phase = self.rt.phase(True)
        self._load(int(feats.shape[1]), phase)
        parts, soft = {}, []
        for i in range(feats.shape[0]):
            got = {}
            feeds = {"src_inputs": feats[i : i + 1], "mask": mask[i : i + 1, None, :]}
            kept = [(t.index, t.kind, t.layer) for t in self.taps]
            outs = self.rt.child.call(
                "run", "audio_encoder", self.esig, feeds, kept, phase=phase,
                tensor=lambda k, l, a, got=got: got.__setitem__((k, l), a),
            )[1]  # fmt: skip
            real = outs["mask"][0].astype(bool)
            for t in self.taps:
                parts.setdefault((t.kind, t.layer), []).append(got[(t.kind, t.layer)][0][real])
            feeds = {"features": outs["features"], "mask": outs["mask"]}
            emb = self.rt.child.call("run", "audio_adapter", self.asig, feeds, [], phase=phase)[1]
            soft.append(emb["features"][0][real])
            parts.setdefault(("audio.output_proj", None), []).append(outs["features"][0][real])
        parts[("audio.soft_tokens", None)] = soft
        for (key, layer), rows in parts.items():
            if self.rt.captures(key):
                kind = S.KIND_BY_NAME[key]
                report_site(probe, kind.name, torch.from_numpy(np.concatenate(rows)), layer=layer, tower=kind.tower)
        return np.concatenate(soft)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "export":
        _export_audio(*args)
