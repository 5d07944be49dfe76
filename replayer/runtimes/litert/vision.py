"""An image prompt through `--runtime litert`'s vision graphs (replayer/runtimes/litert/runtime.py
runs the text tower): litert-torch's export of Gemma 4's vision encoder at the processor's patch
budget, one image a call, and of embed_vision (export.py: vision_encoder.tflite,
vision_adapter.tflite), loaded at the first image prompt. The encoder keeps every op's output when a
vision kind is asked (graph.py's vision_taps name them); each site's rows are those of the image's
real patches, image after image; pooled and soft rows those the encoder's mask keeps. The soft tokens
replace the image tokens' embeddings; with the config's bidirectional vision attention, `blocks`
says which image each position belongs to (the full-attention layers' mask lets an image's tokens
see each other). Nothing of the tower is corrected: litert-torch 0.10.0's encoder attends to the
padding patches (docs/upstream/litert-torch-gemma4-vision-padding.md)."""

from __future__ import annotations

import sys

import numpy as np
import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError

from ...api import report as report_site
from ...ops import image_blocks
from . import export as E
from . import graph as G


class LiteRTImages:
    """The vision side of one LiteRTRuntime `rt` (its child, phases, kinds kept and name)."""

    def __init__(self, rt):
        self.rt = rt
        top, cfg = rt.loaded.config, rt.loaded.text_config
        self.vcfg = getattr(top, "vision_config", None)  # None: a text-only model
        self.pad_id = int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        self.image_id = getattr(top, "image_token_id", None)
        mm = (getattr(top, f"{m}_token_id", None) for m in ("image", "video", "audio"))
        self.mm_ids = {int(t) for t in mm if t is not None}  # their per-layer embeddings are the pad token's
        self.bidir_vision = getattr(cfg, "use_bidirectional_attention", None) == "vision"
        self.vision_soft = None  # the loaded vision graphs' budget (pooled tokens an image)
        self.soft, self.blocks = {}, None  # this prompt's: {position: soft token}, each position's image

    def prompt(self, ids: list[int], extra: dict, probe) -> list[int]:
        """The prompt's images through the vision graphs: self.soft ({position: soft token}) and
        self.blocks (each position's image, -1 for text), every vision site reported to `probe`; the
        ids the text embedders take (an image, audio or video token's per-layer embedding is the pad
        token's, as HF's)."""
        self.soft, self.blocks = {}, None
        embedded = [self.pad_id if t in self.mm_ids else t for t in ids] if self.vcfg is not None else ids
        if "pixel_values" not in extra:
            return embedded
        if self.vcfg is None:
            raise TraceToolError("pixel_values given to a text-only model")
        if "image_position_ids" not in extra:
            raise TraceToolError("pixel_values given without image_position_ids")
        known = ("pixel_values", "image_position_ids", "mm_token_type_ids", "input_features", "input_features_mask")
        bad = sorted(k for k in extra if k not in known)  # the audio's: audio.py
        if bad:
            raise TraceToolError(
                f"--runtime {self.rt.mode} takes images, audio and text only; REF has {', '.join(bad)}"
            )
        soft = self._encode(
            np.asarray(extra["pixel_values"], np.float32), np.asarray(extra["image_position_ids"]), probe
        )
        slots = [p for p, t in enumerate(ids) if t == self.image_id]
        if soft.shape[0] != len(slots):
            raise TraceToolError(
                f"the images give {soft.shape[0]} soft tokens for {len(slots)} image-token slots in the prompt "
                "(the vision tower pools or resizes otherwise than the processor did)"
            )
        self.soft = dict(zip(slots, soft))
        tt = np.asarray(extra.get("mm_token_type_ids", np.zeros((1, 0)))).reshape(-1)[: len(ids)]
        if self.bidir_vision and tt.size:
            self.blocks = image_blocks(tt)
        return embedded

    def _load(self, soft: int, phase: str) -> None:
        """Export (or take from the artifact cache) and load the vision graphs for images of `soft`
        pooled tokens, once per budget."""
        if self.vision_soft == soft:
            return
        art = E.vision_exported(self.rt.loaded, soft)
        try:
            paths = {n: str(art.path / f"{n}.tflite") for n in ("vision_encoder", "vision_adapter")}
            graph = G.read(paths["vision_encoder"])
            self.vsig, self.asig = f"vision_{soft}", f"vision_adapter_{soft}"
            if self.vsig not in graph:
                raise TraceToolError(
                    f"the LiteRT vision encoder has no {self.vsig!r} signature (it has {', '.join(graph)})"
                )
            v = self.vcfg
            heads, kv = int(v.num_attention_heads), int(v.num_key_value_heads)
            dims = (heads, kv, int(getattr(v, "head_dim", None) or v.hidden_size // heads))
            taps = G.vision_taps(graph[self.vsig], int(v.num_hidden_layers), int(v.hidden_size), dims)
            self.vtaps = [t for t in taps if self.rt.captures(t.kind)]
            keep = ["vision_encoder"] if self.vtaps else []
            meta = self.rt.child.call("load", paths, keep, phase=phase)[1]
        finally:
            art.close()
        outs = meta["vision_encoder"].get(self.vsig, ({}, []))[1]
        if not {"features", "mask"} <= set(outs) or self.asig not in meta["vision_adapter"]:
            raise TraceToolError("the LiteRT vision graphs do not return features, mask and mm_embedding")
        self.vision_soft = soft
        note = E.adapter_note(self.vcfg)
        if note:
            print(f"note: {note}", file=sys.stderr)
        fixed = "; vision_adapter.tflite sized by the tower's hidden size (export.py)" if note else ""
        rt = self.rt
        if rt._name and "; vision tower:" not in rt._name:
            rt._name = rt._name[:-1] + f"; vision tower: vision_encoder.tflite, {soft} soft tokens an image{fixed})"

    def _encode(self, pixels: np.ndarray, positions: np.ndarray, probe) -> np.ndarray:
        """(images, patches, 3 p^2) pixels -> the soft tokens of their real patches, image after image;
        each image one call of the encoder (its patch budget) and the adapter."""
        phase = self.rt.phase(True)
        k2 = int(self.vcfg.pooling_kernel_size) ** 2
        images, patches = pixels.shape[:2]
        if patches % k2:
            raise TraceToolError(f"the images have {patches} patches, not a multiple of the pooling cell's {k2}")
        self._load(patches // k2, phase)
        parts, soft = {}, []
        for i in range(images):
            got = {}
            feeds = {"images": pixels[i : i + 1], "positions_xy": positions[i : i + 1].astype(np.int32)}
            kept = [(t.index, t.kind, t.layer) for t in self.vtaps]
            outs = self.rt.child.call(
                "run",
                "vision_encoder",
                self.vsig,
                feeds,
                kept,
                phase=phase,
                tensor=lambda k, l, a, got=got: got.__setitem__((k, l), a),
            )[1]
            real, mask = (positions[i] != -1).all(axis=-1), outs["mask"][0].astype(bool)
            for t in self.vtaps:
                parts.setdefault((t.kind, t.layer), []).append(got[(t.kind, t.layer)][0][real])
            emb = self.rt.child.call(
                "run", "vision_adapter", self.asig, {"soft_tokens": outs["features"]}, [], phase=phase
            )
            soft.append(emb[1]["mm_embedding"][0][mask])
            parts.setdefault(("vision.pooled", None), []).append(outs["features"][0][mask])
        parts[("vision.soft_tokens", None)] = soft
        for (key, layer), rows in parts.items():
            if self.rt.captures(key):
                kind = S.KIND_BY_NAME[key]
                report_site(probe, kind.name, torch.from_numpy(np.concatenate(rows)), layer=layer, tower=kind.tower)
        return np.concatenate(soft)
