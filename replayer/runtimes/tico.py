"""`--runtime tico` / `tico-quant`: TICO's StaticGemma4Runtime driven through our runtime API.

TICO (the `tico` package, extra `gemma4-trace[tico]`, pinned release below) ships a
static-shape Gemma 4 runtime built from its PTQ wrappers: per-layer prefill/decode export
modules, additive masks, (1, kv, max_seq - 1, hd) caches with the decode step's own row
appended as the last key slot. This adapter runs TICO's own `prefill` / `decode_one` and
reports what it computes, read from the outside (replayer/runtimes/tico_capture.py, `TicoCapture`):

- forward hooks on its modules: embeddings (`mm_fusion` at prefill, `token_embedding` at
  decode), `per_layer_inputs` (`ple_projection`), `attn_out` (`o_proj`), `layer_out`, `k`, `v`
  (each layer's export module returns its new K/V);
- q after q_norm + RoPE has no module boundary: it is the value TICO hands to its `q_rot`
  fake-quant observer, so the attention wrapper's `_fq` is wrapped to see it; the mask is the
  value handed to `attn_mask` (the additive mask actually applied);
- RoPE rows from its mask/RoPE builders (its sine is pre-negated for the NPU: undone here);
- `final_hidden`: its LM head runs on the last prompt row only, so its own final norm is
  applied to the last layer's output rows.

Only the taps of the kinds the replay keeps are installed (`--kinds`, RuntimeChoice.capture);
with none asked, none is, and TICO's modules run as they are (logits only).

It needs nothing of TICO's E2B-only settings: a vision profile is derived from the inputs
and registered (image-token span, patch grid from `image_position_ids`, soft-token capacity
from `pixel_values`); a text-only prompt bypasses TICO's vision step and fusion.
`tico-quant` runs the same modules in TICO's fake-quant mode (its Gemma 4 PTQ config:
int16 activations and weights): its observers are calibrated on one prefill of the replayed
prompt, then frozen, and the replay runs quantized.
"""

from __future__ import annotations

import torch

from gemma4_trace.traces.errors import TraceToolError, install_hint

from ..api import Runtime
from .tico_capture import TicoCapture

TICO_VERSION = "0.3.0"  # the release tested; the extra [tico] pins it


def _import_tico():
    try:
        import tico  # noqa: F401  (its absence is the message below)
        from tico.quantization.recipes.debug import static_gemma4_runtime as rtmod
        from tico.quantization.wrapq.wrappers.gemma4 import static_vision_profile as vp
        from tico.quantization.wrapq.wrappers.gemma4.utils import StaticGemma4Layout
    except ImportError as e:
        raise TraceToolError(f"--runtime tico needs TICO {TICO_VERSION}: {install_hint('tico')} ({e})") from None
    from importlib.metadata import version as dist_version

    version = dist_version("tico")
    return rtmod, vp, StaticGemma4Layout, version


class _TextOnlyFusion(torch.nn.Module):
    """Stands in for TICO's image fusion on a prompt without an image: the text rows as they are."""

    def forward(self, text_embeds, image_embeds):
        return text_embeds


class TicoRuntime(Runtime):
    """One replay's TICO runtime (the driver makes one per replay); built at the first prefill,
    when the inputs say which vision profile it needs."""

    def __init__(self, loaded, max_seq: int, quantized: bool = False, capture: frozenset[str] | None = None):
        self.rtmod, self.vp, self.Layout, version = _import_tico()
        if not loaded.multimodal:
            raise TraceToolError(
                "TICO's static Gemma 4 runtime needs a multimodal (image-text) checkpoint; "
                "this one has no vision_config"
            )
        if getattr(loaded.text_config, "enable_moe_block", False):
            raise TraceToolError("TICO's static Gemma 4 runtime does not support MoE configs (enable_moe_block)")
        self.loaded, self.max_seq, self.quantized = loaded, max_seq, quantized
        self.capture = capture  # the kinds tapped (None: every kind; empty: none)
        self.name = f"tico-quant {version}" if quantized else f"tico {version}"
        self.rt = None
        self.taps: TicoCapture | None = None  # what is read from its modules (tico_capture.py)
        self.T = 0

    # ------------------------------------------------------------ building
    def _profile(self, input_ids: torch.Tensor, extra: dict):
        """A vision profile for these inputs, registered under a name derived from its geometry."""
        cfg = self.loaded.config
        vcfg = cfg.vision_config
        k = int(vcfg.pooling_kernel_size)
        image_id = int(cfg.image_token_id)
        slots = torch.nonzero(input_ids == image_id).reshape(-1)
        tok = getattr(self.loaded.tokenizer, "add_bos_token", False)
        if len(slots) == 0:  # text only: a minimal valid profile; the vision step is bypassed
            soft = int(extra["pixel_values"].shape[1]) // (k * k) if "pixel_values" in extra else None
            soft = soft or int(
                getattr(self.loaded.processor, "image_seq_length", 0) or getattr(vcfg, "default_output_length", 0) or 1
            )
            fields = dict(
                visual_start_idx=0, num_visual_tokens=1, max_soft_tokens=soft, patch_grid_height=k, patch_grid_width=k
            )
        else:
            start, n = int(slots[0]), len(slots)
            if not torch.equal(slots, torch.arange(start, start + n)):
                raise TraceToolError(
                    "TICO's runtime supports exactly one contiguous image span; "
                    f"this prompt's image tokens are at {slots.tolist()[:8]}..."
                )
            if "image_position_ids" not in extra or "pixel_values" not in extra:
                raise TraceToolError("REF has image tokens but no pixel_values / image_position_ids inputs")
            pos = extra["image_position_ids"].reshape(-1, 2)
            valid = pos[pos[:, 0] >= 0]
            fields = dict(
                visual_start_idx=start,
                num_visual_tokens=n,
                max_soft_tokens=int(extra["pixel_values"].shape[1]) // (k * k),
                patch_grid_height=int(valid[:, 1].max()) + 1,
                patch_grid_width=int(valid[:, 0].max()) + 1,
            )
        name = (
            "gemma4-trace-{visual_start_idx}-{num_visual_tokens}-{max_soft_tokens}-"
            "{patch_grid_height}x{patch_grid_width}".format(**fields)
        )
        profile = self.vp.Gemma4StaticVisionProfile(
            name=name,
            patch_size=int(vcfg.patch_size),
            pooling_kernel_size=k,
            tokenizer_add_bos_token=bool(tok),
            **fields,
        )
        # TICO looks profiles up by name when it builds its PTQ config: register ours
        self.vp._PROFILE_REGISTRY.setdefault(name, profile)
        return profile, bool(len(slots))

    def _build(self, input_ids, extra):
        profile, has_image = self._profile(input_ids, extra)
        layout = self.Layout(
            max_seq=self.max_seq, visual_start_idx=profile.visual_start_idx, num_visual_tokens=profile.num_visual_tokens
        )
        tc = self.loaded.text_config
        if hasattr(type(tc), "allow_global_per_layer_attribute_access"):
            # TICO reads config-wide num_key_value_heads / head_dim and derives the per-type values
            # itself; transformers 5.24 refuses such reads on per-layer (heterogeneous) configs
            tc.allow_global_per_layer_attribute_access = True
        try:
            rt = self.rtmod.StaticGemma4Runtime(
                self.loaded.model, self.loaded.processor, layout=layout, vision_profile=profile, device="cpu"
            )
        except (ValueError, RuntimeError, AssertionError) as e:
            raise TraceToolError(
                f"TICO's runtime refused this model or prompt: {str(e).splitlines()[0][:200]}"
            ) from None
        rt._allocate_empty_cache = self._allocate_cache
        if not has_image:  # TICO's prefill always runs its vision step: bypass it and the fusion
            rt._get_or_create_vision_prefill = lambda image_position_ids: lambda pixel_values: None
            rt.mm_fusion = _TextOnlyFusion()
        self.rt = rt
        self.taps = TicoCapture(rt, self.capture, set(self.loaded.text_config.layer_types), self.max_seq)
        return has_image

    def _allocate_cache(self, batch_size: int, dtype: torch.dtype) -> list:
        """TICO's cache allocation, sized per layer from the per-layer config.

        TICO 0.3.0 sizes caches from config-wide values; with attention_k_eq_v (full layers with
        their own KV head count) it allocates the sliding layers' head count for full layers too,
        and its prefill write then broadcasts one KV head into two (decode fails)."""
        from gemma4_trace.traces.layers import layer_infos_from_config

        return [
            self.rtmod.LayerCache(
                past_k=torch.zeros(batch_size, li.num_kv_heads, self.max_seq - 1, li.head_dim, dtype=dtype),
                past_v=torch.zeros(batch_size, li.num_kv_heads, self.max_seq - 1, li.head_dim, dtype=dtype),
            )
            for li in layer_infos_from_config(self.loaded.text_config)
        ]

    # ------------------------------------------------------------ the API
    def prefill(self, input_ids, extra_inputs, probe):
        extra = {k: torch.as_tensor(v) for k, v in extra_inputs.items()}
        has_image = self._build(input_ids, extra)
        T = self.T = len(input_ids)
        if T > self.max_seq - 1:
            raise TraceToolError(
                f"TICO's runtime keeps one slot for the decode row: prompt {T} needs max_seq >= {T + 1}"
            )
        batch = self._batch(input_ids, extra, has_image)
        if self.quantized:  # calibrate the fake-quant observers on this prompt, then freeze them
            if has_image:  # TICO builds its vision step only outside calibration mode: built first
                self.rt._get_or_create_vision_prefill(batch["image_position_ids"])
            self.rt.qmodel.enable_calibration()
            self.rt.prefill(batch)
            self.rt.qmodel.freeze_qparams()
            self.rt.reset_cache()
        logits = self.taps.call(lambda: self.rt.prefill(batch), probe, slice(0, T), None)
        return logits.reshape(-1)

    def _batch(self, input_ids, extra, has_image) -> dict:
        cfg = self.loaded.config
        pad = getattr(self.loaded.text_config, "pad_token_id", None)
        pad = 0 if pad is None else int(pad)
        T, S = len(input_ids), self.max_seq
        ids = torch.full((1, S), pad, dtype=torch.long)
        ids[0, :T] = input_ids
        ids[ids == int(cfg.image_token_id)] = pad  # TICO's convention: image slots hold pad ids
        valid = torch.zeros(1, S, dtype=torch.bool)
        valid[0, :T] = True
        dtype = next(self.loaded.model.parameters()).dtype
        pixels = extra["pixel_values"].to(dtype) if has_image else torch.zeros(1, dtype=dtype)
        batch = dict(llm_input_ids=ids, attention_mask=valid, valid_length=torch.tensor([T]), pixel_values=pixels)
        if has_image:
            batch["image_position_ids"] = extra["image_position_ids"].long()
        return batch

    def decode(self, token_id, position, probe):
        if position != self.rt.past_len:
            raise TraceToolError(f"TICO's runtime is at position {self.rt.past_len}, asked to decode at {position}")
        logits = self.taps.call(
            lambda: self.rt.decode_one(torch.tensor([[int(token_id)]])), probe, slice(0, 1), position
        )
        return logits.reshape(-1)


def create(loaded, max_seq: int, choice):
    return TicoRuntime(loaded, max_seq, quantized=choice.name == "tico-quant", capture=choice.capture)
