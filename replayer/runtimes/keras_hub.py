"""`--runtime keras-hub`: REF's checkpoint converted by keras-hub's own converter and run through
keras-hub's own Gemma 4 layers on JAX's CPU backend, in the child process (extra `gemma4-trace[keras]`).

keras-hub 0.32.0 ships a second Gemma 4 implementation, independent of PyTorch and of transformers'
modeling code (`keras_hub/src/models/gemma4/`: PLE, KV sharing, proportional RoPE, the double-wide
MLP, v_norm, layer_scalar, the soft-cap), and a converter from transformers checkpoints
(`keras_hub/src/utils/transformers/convert_gemma4.py`, behind `Gemma4Backbone.from_preset(FOLDER)`).
The conversion runs in the child and is kept in the artifact cache (replayer/artifacts.py) as a
keras-hub preset (`save_to_preset`), keyed by the checkpoint's content hash, the versions of
keras-hub, keras and jax and this code: a cached preset loads in about a second where the
conversion takes tens.

The replay drives `Gemma4CausalLM.call_with_cache` itself, one call for the prompt and one for each
later token (teacher-forced: REF's; `--free-running`: its own), over one keras-hub cache of
`--max-seq` positions, in JAX eager mode (no jit: each op compiled once on first use). The kinds are
read where keras-hub computes them, by replacing the `call` of its layers (or the method) on the
instance (keras_hub_engine.py; the module paths are its capture map's, keras_hub_spec.py):

    embeddings        layer 0's input (the scaled token embeddings)
    per_layer_inputs  each layer's per_layer_input argument, stacked (rows, layers, ple_dim)
    mask              each layer's _compute_attention_mask output: allowed[query, key] over the cache's
                      max_seq key slots (slot = absolute position)
    q, k              the outputs of the attention's _apply_rope (q: its first call; k: its second, in
                      a layer that owns K/V)
    v                 value_norm's output (a layer that owns K/V)
    attn_out          output_dense's output;  layer_out: each decoder block's output
    final_hidden      the backbone's final layer_norm
    logits            call_with_cache's logits, last row

An image prompt: keras-hub's own vision encoder on REF's patches (HF's processor's), every image at
once; each image's real soft tokens enter call_with_cache at the image-token slots, with the slots
as its vision_mask; the vision encoder's kinds are tapped the same way (kept at the real patches'
rows). keras-hub's own masks are kept (its cached prefill attends within an image causally, where
HF attends both ways: docs/runtime-keras-hub.md, "Upstream findings"). An audio prompt is refused.

Only the taps of the kinds the replay keeps are installed (`--kinds`, RuntimeChoice.capture); with
none asked, keras-hub's model runs as converted and only logits return. Not compared: the RoPE tables
(computed inside keras-hub's RotaryEmbedding layer).

One config fix: transformers 5.24 folds the full-attention layers' `global_head_dim` into
`per_layer_config` and drops it; keras-hub's converter then reads the full layers' q_proj with the
sliding head_dim and refuses it ("cannot reshape array of size 8192 into shape (4,16,64)"). The field is
written back (head_fixes.py) into a temporary copy of the folder (its other files linked), said once
on stderr and kept in the provenance (the runtime's name).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.hf.model import config_dict
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError

from ..api import report
from ..artifacts import artifact_folder, code_digest, model_hash
from ..child import ChildRuntime
from . import head_fixes
from .keras_hub_engine import ENGINE, ENV

FORMAT = 1  # bump when what is saved changes (the cache key holds it)
PACKAGES = ("keras-hub", "keras", "jax")
_SAID: set = set()  # the model folders whose config fixes this process has said


def cache_key(loaded) -> dict:
    from importlib.metadata import version

    return {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        **{p: version(p) for p in PACKAGES},
        "code": code_digest("runtimes/keras_hub.py", "runtimes/keras_hub_engine.py", "runtimes/head_fixes.py"),
    }


class KerasHubRuntime(ChildRuntime):
    """keras-hub's Gemma4CausalLM in the child; the host feeds token ids and hands the tapped kinds to the probe."""

    def __init__(self, loaded, max_seq: int, capture: frozenset[str] | None = None):
        from importlib.metadata import version

        config = config_dict(loaded.config)
        self.loaded, self.max_seq, self.capture = loaded, int(max_seq), capture
        self.fixes = head_fixes.config_fixes(config, "keras-hub")
        words = "; ".join(head_fixes.fixes_words(self.fixes))
        v = {p: version(p) for p in PACKAGES}
        self.label = f"keras-hub (keras-hub {v['keras-hub']}, keras {v['keras']}, jax {v['jax']})"
        fixed = f"; config fixed in a copy: {words}" if words else ""
        self.name = f"{self.label[:-1]}, CPU, float32; converted by keras-hub's converter{fixed})"
        key = str(Path(loaded.model_dir).resolve())
        if words and key not in _SAID:
            print(
                f"keras-hub: the config keras-hub's converter reads, fixed in a temporary copy: {words}",
                file=sys.stderr,
            )
            _SAID.add(key)
        self.offset = 0

    def prepare(self, input_ids=None, extra_inputs=None) -> None:
        """The preset (from the artifact cache, or converted now in the child) loaded by keras-hub."""
        if self.child is not None:
            return
        try:
            child = self.start(self.label, ENGINE, env=ENV, streams=True)
            art = artifact_folder(
                "keras-hub",
                cache_key(self.loaded),
                self._convert,
                what=f"converting {self.loaded.name} with keras-hub's converter (Gemma4Backbone.from_preset)",
            )
            try:
                kinds = None if self.capture is None else sorted(self.capture)  # the child taps only these
                child.call("load", str(art.path / "preset"), self.max_seq, kinds, phase="loading")
            finally:
                art.close()
        except BaseException:
            self.close()
            raise

    def _convert(self, folder: Path) -> None:
        """keras-hub's converter on a fixed copy of REF's folder, in the child (which writes only to
        its own folder); its preset then moved into the cache's folder."""
        copy = head_fixes.fixed_copy(self.loaded.model_dir, self.fixes, "keras-hub")
        out = Path(self.child.folder) / "preset"
        try:
            self.child.call("convert", str(copy), str(out), phase="converting")
            shutil.copytree(out, folder / "preset")
        finally:
            shutil.rmtree(copy, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)

    def _step(self, ids: list[int], position: int, probe, prefill: bool, media=None) -> torch.Tensor:
        def tensor(kind, layer, array):
            spec = S.KIND_BY_NAME[kind]
            if spec.tower == S.TEXT:
                self.report(probe, [((kind, layer), array)])
            elif probe is not None:
                report(probe, spec.name, torch.from_numpy(array), layer, tower=spec.tower)

        args = (ids, position) if media is None else (ids, position, media)
        reply = self.child.call("step", *args, phase=self.phase(prefill), tensor=tensor)
        self.offset = position + len(ids)
        return torch.from_numpy(reply[1])

    def prefill(self, input_ids, extra_inputs, probe):
        extra = extra_inputs or {}
        if "input_features" in extra:  # refused before the model loads (the row runs no audio tower)
            raise TraceToolError("--runtime keras-hub runs no audio tower")
        self.prepare()
        ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        if "pixel_values" not in extra:
            return self._step(ids, 0, probe, True)
        media = {  # REF's patches (HF's processor's), every image at once
            "pixel_values": np.asarray(extra["pixel_values"], dtype=np.float32),
            "image_position_ids": np.asarray(extra["image_position_ids"]),
            "image_token_id": int(self.loaded.model.config.image_token_id),
        }
        return self._step(ids, 0, probe, True, media)

    def decode(self, token_id, position, probe):
        if int(position) != self.offset:
            raise TraceToolError(f"keras-hub: asked for position {position} after {self.offset} tokens")
        return self._step([int(token_id)], int(position), probe, False)


def create(loaded, max_seq: int, choice=None):
    return KerasHubRuntime(loaded, max_seq, getattr(choice, "capture", None))
