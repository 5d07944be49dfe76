"""keras-hub's Gemma 4 in the child process (replayer/child.py's protocol), for --runtime keras-hub
(replayer/runtimes/keras_hub.py): the conversion of a transformers folder by keras-hub's own
converter (`Gemma4Backbone.from_preset`, saved as a keras-hub preset), and the replay of a preset
through `Gemma4CausalLM.call_with_cache`, step by step, on JAX's CPU backend in float32, eager.

The kinds are read where keras-hub computes them (its capture map, keras_hub_spec.py): each layer's
or method's `call` is replaced on the instance by one that records its inputs or output and calls
the original, so the computation is keras-hub's own, unchanged."""

from __future__ import annotations

import os

from ..child import EngineError, quiet_fd2

ENGINE = f"{__name__}:KerasHubEngine"
ENV = {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}


class KerasHubEngine:
    """("convert", hf folder, out folder) -> ("ready", info): the folder converted by keras-hub's
    converter and saved as a preset in out; ("load", preset, max_seq, kinds) -> ("ready", info): the
    preset loaded into a Gemma4CausalLM with an empty cache of max_seq positions, the modules of
    `kinds` tapped (None: every kind; empty: none); ("step", [token ids], position) -> the step's
    kinds streamed, then ("logits", the last row, float32)."""

    def __init__(self, emit):
        os.environ["KERAS_HOME"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "keras")  # the child's folder
        with quiet_fd2():  # TensorFlow's start-up lines (keras-hub imports it), kept out of a crash's line
            import keras
            from keras_hub.src.models.gemma4.gemma4_backbone import Gemma4Backbone
            from keras_hub.src.models.gemma4.gemma4_causal_lm import Gemma4CausalLM

        keras.config.set_floatx("float32")
        self.Backbone, self.CausalLM, self.emit = Gemma4Backbone, Gemma4CausalLM, emit
        self.seen: list = []

    def handle(self, command: str, *args):
        if command == "convert":
            return self._convert(*args)
        if command == "load":
            return self._load(*args)
        return self._step(*args)

    def _convert(self, folder: str, out: str):
        backbone = self.Backbone.from_preset(folder, dtype="float32")
        backbone.save_to_preset(out)
        return ("ready", {"layers": int(backbone.num_layers)})

    def _load(self, preset: str, max_seq: int, kinds):
        import numpy as np
        from keras import ops

        bb = self.Backbone.from_preset(preset, dtype="float32")
        self.lm = self.CausalLM(backbone=bb, preprocessor=None)
        head_dim = max(bb.head_dim, bb.global_head_dim or 0)  # keras-hub's _build_cache: one width for all
        self.cache = ops.zeros([1, bb.num_layers, 2, int(max_seq), bb.num_key_value_heads, head_dim], "float32")
        self.offset, self.np = 0, np
        self._tap(bb, None if kinds is None else frozenset(kinds))
        return ("ready", {"layers": int(bb.num_layers)})

    def _step(self, ids: list[int], position: int, media=None):
        np = self.np
        if position != self.offset:
            raise EngineError(f"asked for position {position} with {self.offset} positions in keras-hub's cache")
        if self.offset + len(ids) > self.cache.shape[3]:
            raise EngineError(f"position {self.offset + len(ids)} is past keras-hub's cache of {self.cache.shape[3]}")
        self.seen, self.rope_calls, self.ple, self.real = [], {}, [], None
        more = {} if media is None else self._images(ids, media)
        logits, _, self.cache = self.lm.call_with_cache(np.array([ids], dtype="int32"), self.cache, self.offset, **more)
        self.offset += len(ids)
        if self.ple:
            self.seen.insert(
                1 if self.seen and self.seen[0][0] == "embeddings" else 0, ("per_layer_inputs", None, None)
            )
        for kind, layer, value in self.seen:
            if kind == "per_layer_inputs":  # (rows, layers, ple_dim), every layer's slice
                value = np.stack([np.array(v, dtype=np.float32) for v in self.ple], axis=1)
            elif kind.startswith("vision.") and kind != "vision.soft_tokens":  # the real patches' rows, image by image
                value = np.array(value, dtype=np.float32)[self.real]
            elif kind == "mask":
                value = np.array(value, dtype=bool)
            else:
                value = np.array(value, dtype=np.float32)
            self.emit(kind, layer, value)
        return ("logits", np.array(logits[0, -1], dtype=np.float32))

    def _images(self, ids: list[int], media: dict) -> dict:
        """An image prompt's prefill: keras-hub's vision encoder on every image at once (REF's
        pixel_values and image_position_ids, the processor's patches), the soft tokens of each
        image's real patches kept (its first real patches / pool_size**2, image after image), and
        call_with_cache's image arguments: those soft tokens at the image-token slots (vision_indices)
        and the slots as its vision_mask (pad ids for the per-layer inputs, and its masks)."""
        np = self.np
        bb = self.lm.backbone
        pixels, positions = media["pixel_values"], media["image_position_ids"]
        self.real = (positions != -1).all(axis=-1)  # (images, patches)
        soft = bb.vision_encoder({"pixel_values": pixels[None], "pixel_position_ids": positions[None]})[0]
        counts = self.real.sum(axis=-1) // bb.vision_encoder.pool_size**2
        soft = np.concatenate([np.array(soft[i, :n], dtype=np.float32) for i, n in enumerate(counts)])
        slots = np.asarray(ids) == media["image_token_id"]
        if soft.shape[0] != int(slots.sum()):
            raise EngineError(f"the images give {soft.shape[0]} soft tokens for {int(slots.sum())} slots in the prompt")
        if self.want("vision.soft_tokens"):
            self.seen.append(("vision.soft_tokens", None, soft))
        return {
            "img_embeddings": soft[None, None],
            "vision_mask": slots[None].astype("int32"),
            "vision_indices": np.flatnonzero(slots)[None].astype("int32"),
        }

    # ------------------------------------------------------------------ the taps
    def _tap(self, bb, kinds) -> None:
        """Replace, on the instance, the `call` of each layer (or the method) that the capture map
        names for the kinds asked: each records what it reads (self.seen) and calls the original."""

        def want(kind):
            return kinds is None or kind in kinds

        self.want = want
        if bb.vision_encoder is not None:
            self._tap_vision(bb.vision_encoder.get_layer("image_encoder"), want)
        for i, layer in enumerate(bb.transformer_layers):
            att = layer.attention
            owns = not (layer.is_kv_shared_layer and layer.kv_shared_layer_index is not None)
            if want("q") or (owns and want("k")):
                self._patch(att, "_apply_rope", self._rope(i, want("q"), owns and want("k")))
            if owns and want("v"):
                self._patch(att.value_norm, "call", self._record("v", i, lambda a, k, out: out[0]))
            if want("attn_out"):
                self._patch(att.output_dense, "call", self._record("attn_out", i, lambda a, k, out: out[0]))
            if want("mask"):
                self._patch(layer, "_compute_attention_mask", self._record("mask", i, lambda a, k, out: out[0]))
            if want("layer_out") or (i == 0 and want("embeddings")) or want("per_layer_inputs"):
                self._patch(layer, "call", self._layer(i, want))
        if want("final_hidden"):
            self._patch(bb.layer_norm, "call", self._record("final_hidden", None, lambda a, k, out: out[0]))

    def _tap_vision(self, encoder, want) -> None:
        """The vision encoder's taps: every row of every image (kept at the real patches' rows)."""

        def first(a, k, out):
            return out[0] if isinstance(out, tuple) else out

        if want("vision.patch_embeddings"):
            self._patch(encoder.patch_embedder, "call", self._record("vision.patch_embeddings", None, first))
        for i, block in enumerate(encoder.encoder_blocks):
            att = block.attention
            if want("vision.q") or want("vision.k"):
                self._patch(att, "_apply_rope", self._rope(i, want("vision.q"), want("vision.k"), "vision."))
            for kind, layer in (("v", att.value_norm), ("attn_out", att.output_dense), ("mlp_out", block.ffw_linear)):
                if want(f"vision.{kind}"):
                    self._patch(layer, "call", self._record(f"vision.{kind}", i, first))
            if want("vision.layer_out"):
                self._patch(block, "call", self._record("vision.layer_out", i, first))

    @staticmethod
    def _patch(obj, name: str, make) -> None:
        object.__setattr__(obj, name, make(getattr(obj, name)))  # past keras' attribute tracking

    def _record(self, kind: str, layer, read):
        def make(inner):
            def call(*a, **k):
                out = inner(*a, **k)
                self.seen.append((kind, layer, read(a, k, out)))
                return out

            return call

        return make

    def _rope(self, layer: int, q: bool, k: bool, tower: str = ""):
        """The attention's RoPE: its first call rotates the query, its second (a layer that owns
        K/V) the key rows written at the step's positions."""

        def make(inner):
            def call(*a, **kw):
                out = inner(*a, **kw)
                n = self.rope_calls[tower, layer] = self.rope_calls.get((tower, layer), 0) + 1
                if (n == 1 and q) or (n == 2 and k):
                    self.seen.append((tower + ("q" if n == 1 else "k"), layer, out if tower else out[0]))
                return out

            return call

        return make

    def _layer(self, layer: int, want):
        def make(inner):
            def call(x, *a, **k):
                if layer == 0 and want("embeddings"):
                    self.seen.append(("embeddings", None, x[0]))
                if want("per_layer_inputs") and k.get("per_layer_input") is not None:
                    self.ple.append(k["per_layer_input"][0])
                out = inner(x, *a, **k)
                if want("layer_out"):
                    self.seen.append(("layer_out", layer, out[0][0]))
                return out

            return call

        return make
