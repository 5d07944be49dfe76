"""StaticGemma4Runtime: a static-shape Gemma 4 text decoder over the HF weights.

gpt-fast style: the weights are read from the HF model once (no copies), the per-layer
KV caches are preallocated buffers (1, kv_heads, max_seq, head_dim), and the RoPE
tables are built once for max_seq and indexed by position; the masks are computed per
step from positions. Prefill runs the whole padded prompt (right padding to max_seq) and
writes only the valid K/V rows; the decode step writes one row at its position and
attends over all max_seq slots through the mask. Nothing here calls HF's forward code: not
its decoder layers, attention, rotary embedding or text model, nor its vision or audio tower (pixels
-> soft tokens and log-mel features -> soft tokens are ported too: static_vision.py, static_audio.py).

The class is the runtime contract (prepare_prefill, prefill, decode: replayer/api.py) over
four pieces it inherits, each a module of its own:

    static_weights.py  StaticWeights: the config's facts, the HF weights (views), RoPE tables
    static_kv.py       StaticKV: the per-layer K/V caches, _write_kv / _read_kv
    static_masks.py    StaticMasks: _prefill_masks / _decode_masks, per step from positions
    static_graph.py    StaticGraph: prefill_step, prefill_chunk_step, decode_step (exportable)

and holds the vision tower's port, static_vision.py's StaticVision (`self.vision_tower`), and the
audio tower's, static_audio.py's StaticAudio (`self.audio_tower`), which prepare_prefill runs on the
prompt's images and audio clips (reporting their sites to prefill's probe); their soft tokens are
merged, unscaled, at the image- and audio-token slots.

A derived runtime overrides any of their methods (tests/support/bug_zoo.py, replayer/functional.py).
The canonical tensors go to an optional probe: `probe.tensor(kind, value, layer=None)`.
With probe=None no reporting code runs at all.
"""

from __future__ import annotations

import torch
from torch import nn

from gemma4_trace.traces.errors import TraceToolError

from .api import Runtime
from .ops import (
    ChunkProbe,
    check_fits,
    chunk_plan,
    rms_norm,  # noqa: F401  (plug-ins import it from here: tests/support/crashy_runtime.py)
)
from .static_audio import StaticAudio
from .static_graph import StaticGraph
from .static_kv import StaticKV
from .static_masks import StaticMasks
from .static_vision import StaticVision
from .static_weights import StaticWeights

UNSUPPORTED_INPUTS = ("pixel_values_videos",)
# the files the static runtime's code is in (relative to replayer/): what an artifact built from its
# step graphs depends on (artifacts.code_digest)
SOURCES = (
    "runtime.py",
    "static_weights.py",
    "static_kv.py",
    "static_masks.py",
    "static_graph.py",
    "static_vision.py",
    "static_audio.py",
    "ops.py",
)


class StaticGemma4Runtime(StaticWeights, StaticKV, StaticMasks, StaticGraph, nn.Module, Runtime):
    """Static-shape Gemma 4 over a LoadedModel's weights (batch 1, fixed max_seq).

    rt = StaticGemma4Runtime(loaded, max_seq=64)
    logits = rt.prefill(prompt_ids, extra_inputs, probe)    # (vocab,) at position T-1
    logits = rt.decode(token_id, position, probe)           # (vocab,) at `position`
    """

    name = "static"
    supports_isolation = True  # continues with the tensors the probe returns (--isolate)
    supports_prefill_chunk = True  # prefill_chunk: rows per prefill step (--prefill-chunk)

    def __init__(self, loaded, max_seq: int, prefill_chunk: int | None = None):
        super().__init__()
        model = loaded.model
        self.prefill_chunk = prefill_chunk  # rows per prefill step; None: the whole max_seq
        self.__dict__["loaded"] = loaded
        self._read_config(model, max_seq)
        self._bind_weights(model)
        self._allocate_kv()
        self._build_rope()
        # the vision tower's port (a module of its own: its buffers are not the text step graphs')
        self.__dict__["vision_tower"] = self.vision_port(model) if self.multimodal else None
        has_audio = getattr(model.config, "audio_config", None) is not None
        self.__dict__["audio_tower"] = self.audio_port(model) if has_audio else None
        audio_id = getattr(model.config, "audio_token_id", None)
        if has_audio and audio_id is not None and int(audio_id) not in self.mm_token_ids:
            self.mm_token_ids.append(int(audio_id))  # a model with an audio tower and no vision tower

    def vision_port(self, model) -> StaticVision:
        """The vision tower's port (a plug-in with a planted vision bug returns its own)."""
        return StaticVision(model)

    def audio_port(self, model) -> StaticAudio:
        """The audio tower's port (a plug-in with a planted audio bug returns its own)."""
        return StaticAudio(model)

    def encode_images(self, pixels, positions, probe=None) -> torch.Tensor:
        """The prompt's images -> their soft tokens (tokens, hidden), the vision sites to `probe`: the
        port here; a runtime that runs the tower elsewhere (an engine's graph) hands in its own."""
        return self.vision_tower.encode(pixels, positions, probe)

    def encode_audio(self, features, features_mask, probe=None) -> torch.Tensor:
        """The prompt's audio clips -> their soft tokens (valid frames, hidden), the audio sites to
        `probe`: the port here; a runtime that runs the tower elsewhere hands in its own."""
        return self.audio_tower.encode(features, features_mask, probe)

    # ------------------------------------------------------------------ public API
    def prepare_prefill(self, input_ids, extra_inputs: dict, probe=None) -> tuple:
        """Prompt ids (T,) + processor outputs -> the static tensors prefill_step takes (the images
        and audio clips through their towers' ports, their sites reported to `probe`)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        T = int(ids.shape[0])
        if T > self.max_seq:
            raise TraceToolError(f"the prompt has {T} tokens, more than max_seq {self.max_seq}")
        extra = {k: torch.as_tensor(v) for k, v in (extra_inputs or {}).items()}
        bad = [k for k in UNSUPPORTED_INPUTS if k in extra]
        if bad:
            raise TraceToolError(
                f"the static runtime does not support {', '.join(bad)} inputs (images, audio and text only)"
            )
        dev = self.embed.device
        S, Hd = self.max_seq, self.hidden
        padded = torch.full((S,), self.pad_id, dtype=torch.long)
        padded[:T] = ids
        mm = torch.zeros(S, dtype=torch.bool)
        for t in self.mm_token_ids:
            mm[:T] |= ids == t
        ple_ids = torch.where(mm, self.pad_id, padded)
        mm_embeds = torch.zeros(1, S, Hd, dtype=self.dtype, device=dev)
        mm_slots = self._merge_images(ids, extra, mm_embeds, probe) | self._merge_audio(ids, extra, mm_embeds, probe)
        block_ids = torch.full((S,), -1, dtype=torch.long)
        if self.bidir_vision and "mm_token_type_ids" in extra:
            tt = extra["mm_token_type_ids"].reshape(-1)[:T].long()
            is_vis = (tt == 1) | (tt == 2)
            starts = is_vis & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_vis[:-1]])
            block_ids[:T] = torch.where(is_vis, torch.cumsum(starts.long(), 0) - 1, -1)
        return (
            ple_ids[None].to(dev),
            ple_ids[None].to(dev),
            mm_embeds,
            mm_slots[None].to(dev),
            block_ids.to(dev),
            torch.tensor(T, device=dev),
        )

    def _merge_images(self, ids, extra: dict, mm_embeds, probe) -> torch.Tensor:
        """The images' soft tokens written into mm_embeds at the image-token slots; the slots (S,) bool."""
        slots = torch.zeros(self.max_seq, dtype=torch.bool)
        if "pixel_values" not in extra:
            return slots
        if self.vision_tower is None:
            raise TraceToolError("pixel_values given to a text-only model")
        if "image_position_ids" not in extra:
            raise TraceToolError("pixel_values given without image_position_ids")
        dev = mm_embeds.device
        slots[: len(ids)] = ids == self.loaded.model.config.image_token_id
        with torch.no_grad():
            # the pixels as the processor made them (float32): the port scales them before the cast
            feats = self.encode_images(extra["pixel_values"].to(dev), extra["image_position_ids"].to(dev), probe)
        self._write_soft(mm_embeds, slots, feats, "images", "image", "the vision tower pools or resizes")
        return slots

    def _merge_audio(self, ids, extra: dict, mm_embeds, probe) -> torch.Tensor:
        """The audio clips' soft tokens written into mm_embeds at the audio-token slots; the slots (S,) bool."""
        slots = torch.zeros(self.max_seq, dtype=torch.bool)
        if "input_features" not in extra:
            return slots
        if self.audio_tower is None:
            raise TraceToolError("input_features given to a model without an audio tower (no audio_config)")
        if "input_features_mask" not in extra:
            raise TraceToolError("input_features given without input_features_mask")
        dev = mm_embeds.device
        slots[: len(ids)] = ids == self.loaded.model.config.audio_token_id
        with torch.no_grad():
            # the features as the processor made them (float32): the port casts them as HF's convs do
            feats = self.encode_audio(extra["input_features"].to(dev), extra["input_features_mask"].to(dev), probe)
        self._write_soft(mm_embeds, slots, feats, "audio clips", "audio", "the audio tower subsamples")
        return slots

    def _write_soft(self, mm_embeds, slots, feats, what: str, token: str, why: str) -> None:
        """mm_embeds[0, slots] = feats (unscaled, in the model's dtype); one line if the counts differ."""
        n_slots = int(slots.sum())
        if feats.shape[0] != n_slots:
            raise TraceToolError(
                f"the {what} give {feats.shape[0]} soft tokens for {n_slots} {token}-token slots in the prompt "
                f"({why} otherwise than the processor did)"
            )
        mm_embeds[0, slots.to(mm_embeds.device)] = feats.to(self.dtype)

    @torch.no_grad()
    def prefill(self, input_ids, extra_inputs: dict | None = None, probe=None) -> torch.Tensor:
        """Run the prompt (T,) ids; return the logits (vocab,) at position T - 1.

        With `prefill_chunk` N < max_seq the prompt runs in chunks of N rows (shapes (N, max_seq),
        see chunk_plan), else over the whole padded max_seq in one step.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        args = self.prepare_prefill(ids, extra_inputs or {}, probe)
        N = self.prefill_chunk
        if N is None or N >= self.max_seq:
            return self.prefill_step(*args, probe=probe, report_rows=len(ids))
        ids_p, ple_ids, mm_embeds, mm_slots, block_ids, n_valid = args
        self._clear_kv()  # chunks write only the rows they cover; the rest must read as empty
        chunks = ChunkProbe(probe) if probe is not None else None
        for c0, rows in chunk_plan(len(ids), N, self.max_seq, block_ids.cpu() if self.bidir_vision else None):
            pos = torch.arange(c0, c0 + N, device=ids_p.device)
            sl = slice(c0, c0 + N)
            logits = self.prefill_chunk_step(
                ids_p[:, sl], ple_ids[:, sl], mm_embeds[:, sl], mm_slots[:, sl], block_ids, n_valid, pos, chunks, rows
            )
        if chunks is not None:
            chunks.flush()
        return logits  # the last chunk holds position T - 1

    @torch.no_grad()
    def decode(self, token_id: int, position: int, probe=None) -> torch.Tensor:
        """Feed one token at `position`; return the logits (vocab,) there."""
        if not 0 <= position < self.max_seq:
            raise TraceToolError(f"decode position {position} is outside max_seq {self.max_seq}")
        tok = self.pad_id if int(token_id) in self.mm_token_ids else int(token_id)
        dev = self.embed.device
        return self.decode_step(
            torch.tensor([[tok]], dtype=torch.long, device=dev),
            torch.tensor([position], dtype=torch.long, device=dev),
            probe,
        )


def create(loaded, max_seq: int, choice=None) -> StaticGemma4Runtime:
    """`--runtime static` (replayer/runtimes/registry.py): refused in one line when it cannot fit."""
    check_fits(loaded, max_seq)
    return StaticGemma4Runtime(loaded, max_seq)
