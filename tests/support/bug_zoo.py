"""The bug zoo: the static runtime with ONE known Gemma 4 porting bug each.

Every factory `make_<bug>(loaded, max_seq)` is a plug-in for the public runtime API
(docs/runtime-api.md), so

    trace replay traces/golden/short.h5 --runtime tests.support.bug_zoo:make_zero_prefill_mask -o run.h5
    trace diff traces/golden/short.h5 run.h5

shows what the tool reports for that bug. Each runtime subclasses
`replayer.runtime.StaticGemma4Runtime` and overrides one piece (a table built in
`__init__`, or one of the hooks `_prefill_masks`, `_decode_masks` (replayer/static_masks.py),
`_write_kv`, `_read_kv` (replayer/static_kv.py), `prepare_prefill`). The bug classes are
those of "Bug classes seen in a real static Gemma 4 runtime" (docs/design.md);
tests/test_bug_zoo.py checks that `trace diff` puts the first divergence exactly where each
bug starts, docs/bug-zoo.md lists the reports.

`BUGS` maps each bug name to (factory name, reference, one line of what is wrong); the
references are the golden traces or `prompt5`, a 5-token prompt with 8 new tokens
recorded on demand (`reference_path`), whose decode crosses the sliding window (8).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gemma4_trace.recorder.golden import GOLDEN_DIR
from gemma4_trace.replayer.runtime import StaticGemma4Runtime
from gemma4_trace.replayer.static_audio import StaticAudio
from gemma4_trace.replayer.static_vision import StaticVision

# a prompt shorter than the sliding window, decoding past it (positions 0..12)
RECORDED = {"prompt5": dict(input_ids=[2, 100, 101, 102, 103], max_new_tokens=8)}


def reference_path(name: str, workdir: Path) -> Path:
    """A golden trace by name, or a reference in RECORDED recorded (once) into workdir."""
    if name not in RECORDED:
        return GOLDEN_DIR / f"{name}.h5"
    out = Path(workdir) / f"{name}.h5"
    if not out.exists():
        from gemma4_trace.recorder.record import record_trace

        record_trace(output=out, force=True, **RECORDED[name])
    return out


class _Bug(StaticGemma4Runtime):
    """Base: tracks whether the current call is a decode step (for decode-only bugs)."""

    decoding = False

    def decode_step(self, token, input_pos, probe=None):
        self.decoding = True
        try:
            return super().decode_step(token, input_pos, probe)
        finally:
            self.decoding = False


# --------------------------------------------------------------------- 1. masks / RoPE from layer 0
class ZeroPrefillMask(_Bug):
    """Prefill mask all zeros (additive): every query sees every slot, future and padding."""

    name = "bug-zero-prefill-mask"

    def _prefill_masks(self, input_pos, valid, block_ids):
        S = self.max_seq
        return {t: torch.ones(1, S, S, dtype=torch.bool, device=valid.device) for t in self.types}


class IdentityRope(_Bug):
    """RoPE tables cos = 1, sin = 0 (no rotation) for both layer types."""

    name = "bug-identity-rope"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        for t in self.types:
            setattr(self, f"cos_{t}", torch.ones_like(getattr(self, f"cos_{t}")))
            setattr(self, f"sin_{t}", torch.zeros_like(getattr(self, f"sin_{t}")))


# --------------------------------------------------------------------- 2. one decode mask for both types
class SharedDecodeMask(_Bug):
    """Decode uses the full-attention (causal) mask on sliding layers too; prefill is right."""

    name = "bug-shared-decode-mask"

    def _decode_masks(self, input_pos):
        m = self._mask_rows("full_attention", input_pos)[None]
        return {t: m for t in self.types}


# --------------------------------------------------------------------- 3. cache with the sliding head_dim (crashes)
class SlidingHeadDimCache(_Bug):
    """K/V caches allocated with the sliding layers' head_dim for every layer."""

    name = "bug-sliding-head-dim-cache"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        d = self.head_dim["sliding_attention"]
        for L, info in zip(self.layers, self.infos):
            if L.owns_kv:
                shape = (1, info.num_kv_heads, self.max_seq, d)
                L.k_cache = torch.zeros(shape, dtype=self.dtype)
                L.v_cache = torch.zeros(shape, dtype=self.dtype)


# --------------------------------------------------------------------- 4. per-layer inputs
class NoPerLayerInputs(_Bug):
    """Per-layer embeddings (PLE) left out entirely."""

    name = "bug-no-ple"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        self.ple_dim = 0
        for L in self.layers:
            L.ple = False


class PleRawImageIds(_Bug):
    """PLE token lookup uses the raw ids: image tokens are not replaced by pad."""

    name = "bug-ple-raw-image-ids"

    def prepare_prefill(self, input_ids, extra_inputs, probe=None):
        ids, ple_ids, *rest = super().prepare_prefill(input_ids, extra_inputs, probe)
        raw = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        ple_ids = ple_ids.clone()
        ple_ids[0, : raw.shape[0]] = raw.to(ple_ids.device)
        return (ids, ple_ids, *rest)


# --------------------------------------------------------------------- 5. KV sharing
class ReuseOwnEmptyCache(_Bug):
    """KV-reusing layers read their own never-written (zero) cache, in prefill and decode."""

    name = "bug-reuse-own-empty-cache"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        self.own = {}
        for i, info in enumerate(self.infos):
            if info.kv_role == "reuses":
                shape = (1, info.num_kv_heads, self.max_seq, info.head_dim)
                self.own[i] = (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))

    def _read_kv(self, i, input_pos):
        return self.own[i] if i in self.own else super()._read_kv(i, input_pos)


class ReuseOwnCacheInDecode(ReuseOwnEmptyCache):
    """Prefill passes the stored K/V to reusing layers; decode gives them their own empty cache."""

    name = "bug-reuse-own-cache-in-decode"

    def _read_kv(self, i, input_pos):
        if self.decoding:
            return super()._read_kv(i, input_pos)
        return StaticGemma4Runtime._read_kv(self, i, input_pos)


class ReuseStaleCurrentRow(_Bug):
    """In decode, reusing layers read the stored K/V as it was before this step's write:
    the current token's row is still the zero padding row (the mask still allows it)."""

    name = "bug-reuse-stale-current-row"

    def _read_kv(self, i, input_pos):
        k, v = super()._read_kv(i, input_pos)
        if self.decoding and self.infos[i].kv_role == "reuses":
            k, v = k.index_fill(2, input_pos, 0.0), v.index_fill(2, input_pos, 0.0)
        return k, v


# --------------------------------------------------------------------- 6. final soft-cap
class NoSoftcap(_Bug):
    """Final logit soft-cap tanh(x / 30) * 30 left out."""

    name = "bug-no-softcap"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        self.softcap = None


# --------------------------------------------------------------------- 7. padding K/V read by slot
class PaddingKvReadBySlot(_Bug):
    """Prefill writes K/V rows for the padding positions too, and decode masks by "slot holds
    data" instead of by position: after prefill every slot holds data, so a decode query sees
    the later (padding) slots. Prefill itself is right (its mask hides the padding keys)."""

    name = "bug-padding-kv-read-by-slot"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        self.filled = torch.zeros(self.max_seq, dtype=torch.bool)

    def _write_kv(self, i, k_t, v_t, input_pos, valid):
        if valid is not None:
            valid = torch.ones_like(valid)  # the bug: padding rows are written as well
        super()._write_kv(i, k_t, v_t, input_pos, valid)

    def prefill_step(self, *args, **kwargs):
        out = super().prefill_step(*args, **kwargs)
        self.filled[:] = True  # every slot was written
        return out

    def _decode_masks(self, input_pos):
        self.filled[input_pos] = True
        k = torch.arange(self.max_seq)[None, :]
        q = input_pos[:, None]
        slots = self.filled[None, :]
        masks = {"full_attention": slots, "sliding_attention": slots & (k > q - self.window)}
        return {t: masks[t][None] for t in self.types}


# --------------------------------------------------------------------- 8. cache slice of the wrong length
class DecodeSliceShort(_Bug):
    """Decode attends over past_len keys instead of past_len + 1: the current key is left out."""

    name = "bug-decode-slice-short"

    def _decode_masks(self, input_pos):
        k = torch.arange(self.max_seq)[None, None, :]
        return {t: m & (k != input_pos[None, :, None]) for t, m in super()._decode_masks(input_pos).items()}


# --------------------------------------------------------------------- 9. vision soft tokens
class VisionScaled(_Bug):
    """Vision soft tokens multiplied by the text embedding scale sqrt(hidden)."""

    name = "bug-vision-scaled"

    def prepare_prefill(self, input_ids, extra_inputs, probe=None):
        ids, ple_ids, mm_embeds, *rest = super().prepare_prefill(input_ids, extra_inputs, probe)
        return (ids, ple_ids, mm_embeds * self.embed_scale, *rest)


class VisionWrongSlots(_Bug):
    """Vision soft tokens merged one slot late (the first image slot keeps the pad embedding)."""

    name = "bug-vision-wrong-slots"

    def prepare_prefill(self, input_ids, extra_inputs, probe=None):
        ids, ple_ids, mm_embeds, mm_slots, *rest = super().prepare_prefill(input_ids, extra_inputs, probe)
        return (ids, ple_ids, mm_embeds.roll(1, dims=1), mm_slots.roll(1, dims=1), *rest)


# --------------------------------------------------------------------- 9b. image blocks in the sliding mask
# keras-hub 0.32.0's Gemma 4 (docs/runtime-keras-hub.md, "Upstream findings"), for a checkpoint with
# use_bidirectional_attention "vision": its cached prefill never ORs the image block in, and its
# uncached mask ORs it in after the window
class ImageBlockCausal(_Bug):
    """Sliding layers attend within an image block causally (no bidirectional image block)."""

    name = "bug-image-block-causal"

    def _prefill_masks(self, input_pos, valid, block_ids):
        return {t: (self._mask_rows(t, input_pos) & valid[None, :])[None] for t in self.types}


class ImageBlockPastWindow(_Bug):
    """Sliding layers compose (causal AND window) OR same image block: an image query sees its
    block's keys past the window, where Gemma 4 has window AND (causal OR same image block)."""

    name = "bug-image-block-past-window"

    def _prefill_masks(self, input_pos, valid, block_ids):
        masks = super()._prefill_masks(input_pos, valid, block_ids)
        q_block = block_ids[input_pos]
        same = (q_block[:, None] == block_ids[None, :]) & (q_block[:, None] >= 0)
        masks["sliding_attention"] = masks["sliding_attention"] | (same & valid[None, :])[None]
        return masks


# --------------------------------------------------------------------- 10. the vision tower (its port's seams)
class _VisionBug(_Bug):
    """The static runtime with its vision tower's port replaced by `port`, a StaticVision subclass."""

    port = StaticVision

    def vision_port(self, model):
        return self.port(model)


class _RopeAxesSwapped(StaticVision):
    def rope_tables(self, positions):
        return super().rope_tables(positions.flip(-1))  # the first half rotated by y, the second by x


class _PaddingUnmasked(StaticVision):
    def attention_mask(self, valid):
        return torch.ones_like(valid)[:, None, :].expand(-1, valid.shape[1], -1)  # padding keys attended


class _PoolTransposed(StaticVision):
    def pool(self, x, positions, valid):
        return super().pool(x, positions.flip(-1), valid)  # cells indexed column-major (x and y swapped)


class _PoolUnscaled(StaticVision):
    def pool(self, x, positions, valid):
        pooled, kept = super().pool(x, positions, valid)
        return pooled / self.hidden**0.5, kept  # the pooler's sqrt(hidden) scale left out


class _PoolKernel3(StaticVision):
    def pool(self, x, positions, valid):
        self.pooling = 3  # 3 x 3 cells where the model (and its processor) pool 2 x 2
        return super().pool(x, positions, valid)


class _StdSkipped(StaticVision):
    def standardized(self, pooled):
        return pooled  # std_bias / std_scale left out


class _ClipSkipped(StaticVision):
    def __init__(self, model):
        super().__init__(model)
        for layer in self.layers:
            for lin in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
                lin.clipped = False  # the clipped linears' bounds left out


class VisionPoolKernel3(_VisionBug):
    """The vision pooler pools 3 x 3 patches where the model pools 2 x 2: fewer soft tokens."""

    name, port = "bug-vision-pool-kernel", _PoolKernel3


class VisionStdSkipped(_VisionBug):
    """The vision tower leaves out its standardization (std_bias / std_scale)."""

    name, port = "bug-vision-std-skipped", _StdSkipped


class VisionClipSkipped(_VisionBug):
    """The vision tower's clipped linears run unclipped."""

    name, port = "bug-vision-clip-skipped", _ClipSkipped


class VisionRopeAxesSwapped(_VisionBug):
    """The vision tower's 2D RoPE rotates the first half of each head by y and the second by x."""

    name, port = "bug-vision-rope-axes", _RopeAxesSwapped


class VisionPaddingUnmasked(_VisionBug):
    """The vision tower's attention lets every patch attend to the padding patches."""

    name, port = "bug-vision-padding", _PaddingUnmasked


class VisionPoolTransposed(_VisionBug):
    """The vision pooler numbers its k x k cells column by column (x and y swapped)."""

    name, port = "bug-vision-pool-order", _PoolTransposed


class VisionPoolUnscaled(_VisionBug):
    """The vision pooler leaves out its sqrt(hidden) scale."""

    name, port = "bug-vision-pool-scale", _PoolUnscaled


# --------------------------------------------------------------------- 10b. the audio tower (its port's seams)
class _AudioBug(_Bug):
    """The static runtime with its audio tower's port replaced by `port`, a StaticAudio subclass."""

    port = StaticAudio

    def audio_port(self, model):
        return self.port(model)


class _AudioChunkOffByOne(StaticAudio):
    def chunk_context(self, q, k):
        # the chunks start one frame late: each chunk's first frame is put in the chunk before, whose
        # context ends before it (it cannot attend to itself)
        return super().chunk_context(q - 1, k)


class _AudioNoLeftContext(StaticAudio):
    def attention_mask(self, valid):
        left, self.context_left = self.context_left, 1  # the left context dropped (attention_context_left 1)
        try:
            return super().attention_mask(valid)
        finally:
            self.context_left = left


class _AudioConvCentred(StaticAudio):
    def depthwise_conv(self, h, weight):
        k = weight.shape[-1]  # centred padding: the conv reads (k - 1) // 2 future frames
        y = torch.nn.functional.conv1d(
            torch.nn.functional.pad(h.transpose(1, 2), ((k - 1) // 2, k - 1 - (k - 1) // 2)),
            weight,
            groups=weight.shape[0],
        )
        return y.transpose(1, 2)


class _AudioNoLogitCap(StaticAudio):
    def soft_cap(self, scores):
        return scores  # the tanh logit cap left out


class _AudioFullStepFF1(StaticAudio):
    def residual_scale(self, which):
        return 1.0 if which == 0 else super().residual_scale(which)  # feed_forward1's half step forgotten


class AudioChunkOffByOne(_AudioBug):
    """The audio attention's chunks start one frame late: each chunk's first frame cannot see itself."""

    name, port = "bug-audio-chunk-off-by-one", _AudioChunkOffByOne


class AudioNoLeftContext(_AudioBug):
    """The audio attention's left context is dropped (attention_context_left 1)."""

    name, port = "bug-audio-no-left-context", _AudioNoLeftContext


class AudioConvCentred(_AudioBug):
    """The audio light conv's depthwise conv is centred (reads future frames) where the model's is causal."""

    name, port = "bug-audio-conv-centred", _AudioConvCentred


class AudioNoLogitCap(_AudioBug):
    """The audio attention's tanh logit soft cap is missing."""

    name, port = "bug-audio-no-logit-cap", _AudioNoLogitCap


class AudioFullStepFF1(_AudioBug):
    """The audio layers' first feed-forward adds its output at scale 1.0 instead of residual_weight."""

    name, port = "bug-audio-ff1-full-step", _AudioFullStepFF1


# --------------------------------------------------------------------- 11. sliding window off by one
class WindowOffByOne(_Bug):
    """Sliding layers see window + 1 keys (q - window <= k instead of q - window < k)."""

    name = "bug-window-off-by-one"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        self.window += 1  # the masks are computed from it (_mask_rows)


# --------------------------------------------------------------------- 12. attention scale
class FullAttentionScaled(_Bug):
    """Full-attention layers scale their scores by 1/sqrt(head_dim), the usual transformer scaling,
    where Gemma 4's are unscaled (q and k are RMS-normed instead): the keys they read come scaled."""

    name = "bug-full-attention-scaled"

    def _read_kv(self, i, input_pos):
        k, v = super()._read_kv(i, input_pos)
        info = self.infos[i]
        return (k * info.head_dim**-0.5, v) if info.layer_type == "full_attention" else (k, v)


# --------------------------------------------------------------------- 13. under the tolerance
# One layer computes something slightly wrong: every tensor stays within its tolerance, so the diff
# matches, but that layer's own error stands out against float round-off (the diff's outlier note).
SUBTLE_LAYER = 5


class DecodeNormEps(_Bug):
    """In decode, one layer's RMSNorms use epsilon 2e-6 instead of the config's 1e-6."""

    name = "bug-decode-norm-eps"

    def _layer(self, i, x, ple, step):
        if not (self.decoding and i == SUBTLE_LAYER):
            return super()._layer(i, x, ple, step)
        eps, self.eps = self.eps, 2e-6
        try:
            return super()._layer(i, x, ple, step)
        finally:
            self.eps = eps


class OneLayerGeluConstant(_Bug):
    """One layer's MLP runs a hand-written tanh GELU with sqrt(2 / pi) rounded to 0.798."""

    name = "bug-one-layer-gelu-constant"

    @staticmethod
    def _gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(0.798 * (x + 0.044715 * x**3)))

    def _layer(self, i, x, ple, step):
        if i != SUBTLE_LAYER:
            return super()._layer(i, x, ple, step)
        act, self.act = self.act, self._gelu
        try:
            return super()._layer(i, x, ple, step)
        finally:
            self.act = act


# ----------------------------------------------------------------------------- factories
def make_zero_prefill_mask(loaded, max_seq):
    return ZeroPrefillMask(loaded, max_seq)


def make_identity_rope(loaded, max_seq):
    return IdentityRope(loaded, max_seq)


def make_shared_decode_mask(loaded, max_seq):
    return SharedDecodeMask(loaded, max_seq)


def make_sliding_head_dim_cache(loaded, max_seq):
    return SlidingHeadDimCache(loaded, max_seq)


def make_no_ple(loaded, max_seq):
    return NoPerLayerInputs(loaded, max_seq)


def make_ple_raw_image_ids(loaded, max_seq):
    return PleRawImageIds(loaded, max_seq)


def make_reuse_own_empty_cache(loaded, max_seq):
    return ReuseOwnEmptyCache(loaded, max_seq)


def make_reuse_own_cache_in_decode(loaded, max_seq):
    return ReuseOwnCacheInDecode(loaded, max_seq)


def make_reuse_stale_current_row(loaded, max_seq):
    return ReuseStaleCurrentRow(loaded, max_seq)


def make_no_softcap(loaded, max_seq):
    return NoSoftcap(loaded, max_seq)


def make_padding_kv_read_by_slot(loaded, max_seq):
    return PaddingKvReadBySlot(loaded, max_seq)


def make_decode_slice_short(loaded, max_seq):
    return DecodeSliceShort(loaded, max_seq)


def make_image_block_causal(loaded, max_seq):
    return ImageBlockCausal(loaded, max_seq)


def make_image_block_past_window(loaded, max_seq):
    return ImageBlockPastWindow(loaded, max_seq)


def make_vision_scaled(loaded, max_seq):
    return VisionScaled(loaded, max_seq)


def make_vision_wrong_slots(loaded, max_seq):
    return VisionWrongSlots(loaded, max_seq)


def make_vision_rope_axes(loaded, max_seq):
    return VisionRopeAxesSwapped(loaded, max_seq)


def make_vision_padding(loaded, max_seq):
    return VisionPaddingUnmasked(loaded, max_seq)


def make_vision_pool_order(loaded, max_seq):
    return VisionPoolTransposed(loaded, max_seq)


def make_vision_pool_scale(loaded, max_seq):
    return VisionPoolUnscaled(loaded, max_seq)


def make_vision_pool_kernel(loaded, max_seq):
    return VisionPoolKernel3(loaded, max_seq)


def make_vision_std_skipped(loaded, max_seq):
    return VisionStdSkipped(loaded, max_seq)


def make_vision_clip_skipped(loaded, max_seq):
    return VisionClipSkipped(loaded, max_seq)


def make_audio_chunk_off_by_one(loaded, max_seq):
    return AudioChunkOffByOne(loaded, max_seq)


def make_audio_no_left_context(loaded, max_seq):
    return AudioNoLeftContext(loaded, max_seq)


def make_audio_conv_centred(loaded, max_seq):
    return AudioConvCentred(loaded, max_seq)


def make_audio_no_logit_cap(loaded, max_seq):
    return AudioNoLogitCap(loaded, max_seq)


def make_audio_ff1_full_step(loaded, max_seq):
    return AudioFullStepFF1(loaded, max_seq)


def make_decode_norm_eps(loaded, max_seq):
    return DecodeNormEps(loaded, max_seq)


def make_one_layer_gelu_constant(loaded, max_seq):
    return OneLayerGeluConstant(loaded, max_seq)


def make_full_attention_scaled(loaded, max_seq):
    return FullAttentionScaled(loaded, max_seq)


def make_window_off_by_one(loaded, max_seq):
    return WindowOffByOne(loaded, max_seq)


# bug: (factory in this module, reference, what is wrong). Bugs that give wrong numbers:
BUGS = {
    "zero_prefill_mask": (
        "make_zero_prefill_mask",
        "short",
        "the prefill mask is all zeros (additive): future and padding keys leak",
    ),
    "identity_rope": ("make_identity_rope", "short", "RoPE tables are cos = 1, sin = 0: nothing is rotated"),
    "shared_decode_mask": (
        "make_shared_decode_mask",
        "prompt5",
        "decode uses the full-attention (causal) mask on sliding layers too",
    ),
    "window_off_by_one": (
        "make_window_off_by_one",
        "window",
        "sliding layers see window + 1 keys (prompt longer than the window)",
    ),
    "window_off_by_one_decode": (
        "make_window_off_by_one",
        "prompt5",
        "sliding layers see window + 1 keys (prompt shorter than the window)",
    ),
    "reuse_own_empty_cache": (
        "make_reuse_own_empty_cache",
        "short",
        "KV-reusing layers read their own never-written (zero) cache instead of the stored K/V",
    ),
    "reuse_own_cache_in_decode": (
        "make_reuse_own_cache_in_decode",
        "short",
        "KV-reusing layers get the stored K/V in prefill, their own empty cache in decode",
    ),
    "reuse_stale_current_row": (
        "make_reuse_stale_current_row",
        "short",
        "KV-reusing layers read the stored K/V without the current token's row (decode)",
    ),
    "decode_slice_short": (
        "make_decode_slice_short",
        "short",
        "decode attends over past_len keys instead of past_len + 1 (the current key is left out)",
    ),
    "padding_kv_read_by_slot": (
        "make_padding_kv_read_by_slot",
        "short",
        "prefill writes padding K/V into the cache; decode masks by filled slot, not position",
    ),
    "full_attention_scaled": (
        "make_full_attention_scaled",
        "short",
        "full-attention layers scale their scores by 1/sqrt(head_dim), where Gemma 4's are unscaled",
    ),
    "no_softcap": ("make_no_softcap", "short", "the final logit soft-cap is missing"),
    "no_ple": ("make_no_ple", "short", "per-layer embeddings (PLE) are missing"),
    "ple_raw_image_ids": (
        "make_ple_raw_image_ids",
        "image",
        "the PLE token lookup uses ids whose image tokens are not replaced by pad",
    ),
    "image_block_causal": (
        "make_image_block_causal",
        "image",
        "sliding layers attend within an image causally (keras-hub 0.32.0's cached prefill)",
    ),
    "image_block_past_window": (
        "make_image_block_past_window",
        "image",
        "sliding layers let an image's keys past the window in (keras-hub 0.32.0's uncached mask)",
    ),
    "vision_scaled": (
        "make_vision_scaled",
        "image",
        "vision soft tokens are multiplied by sqrt(hidden) like text embeddings",
    ),
    "vision_wrong_slots": ("make_vision_wrong_slots", "image", "vision soft tokens are merged one slot late"),
    "vision_rope_axes": (
        "make_vision_rope_axes",
        "image",
        "the vision tower's 2D RoPE has its x and y axes swapped",
    ),
    "vision_padding": (
        "make_vision_padding",
        "two_images",
        "the vision tower's attention does not mask the padding patches",
    ),
    "vision_pool_order": ("make_vision_pool_order", "image", "the vision pooler's cells are numbered column by column"),
    "vision_pool_scale": ("make_vision_pool_scale", "image", "the vision pooler leaves out its sqrt(hidden) scale"),
}
# bugs of what the embedded model's vision tower does not use: run on tests/support/tiny_models.py's
# vision_variant (standardize, clipped linears), by tests/test_static_vision.py
VARIANT_BUGS = {
    "vision_std_skipped": ("make_vision_std_skipped", "the vision tower leaves out std_bias / std_scale"),
    "vision_clip_skipped": ("make_vision_clip_skipped", "the vision tower's clipped linears run unclipped"),
}
# bugs of the audio tower's port: run on an audio trace of the embedded audio model
# (hf/tiny_audio_model) by tests/test_static_audio.py; bug: (factory, what is wrong, (kind, layer) where
# `trace diff` must put the first divergence, tower audio)
AUDIO_BUGS = {
    "audio_chunk_off_by_one": (
        "make_audio_chunk_off_by_one",
        "the audio attention's chunks start one frame late (a chunk's first frame cannot see itself)",
        ("audio.attn_out", 0),
    ),
    "audio_no_left_context": (
        "make_audio_no_left_context",
        "the audio attention's left context is dropped (attention_context_left 1)",
        ("audio.attn_out", 0),
    ),
    "audio_conv_centred": (
        "make_audio_conv_centred",
        "the audio light conv's depthwise conv is centred where the model's is causal",
        ("audio.lconv_out", 0),
    ),
    "audio_no_logit_cap": (
        "make_audio_no_logit_cap",
        "the audio attention's tanh logit cap is missing",
        ("audio.attn_out", 0),
    ),
    "audio_ff1_full_step": (
        "make_audio_ff1_full_step",
        "feed_forward1 adds its output at scale 1.0 instead of residual_weight (its half step)",
        ("audio.ff1_out", 0),
    ),
}
# bugs that cannot run: replay must stop with one line naming the layer
CRASHING = {
    "sliding_head_dim_cache": (
        "make_sliding_head_dim_cache",
        "short",
        "K/V caches allocated with the sliding head_dim for every layer",
    ),
    "vision_pool_kernel": (
        "make_vision_pool_kernel",
        "image",
        "the vision pooler pools 3 x 3 patches where the model pools 2 x 2",
    ),
}


# bugs under the tolerance: the diff matches, and its note names the layer whose own error stands out
SUBTLE = {
    "decode_norm_eps": (
        "make_decode_norm_eps",
        "short",
        f"in decode, layer {SUBTLE_LAYER}'s RMSNorms use epsilon 2e-6 instead of the config's 1e-6",
    ),
    "one_layer_gelu_constant": (
        "make_one_layer_gelu_constant",
        "window",
        f"layer {SUBTLE_LAYER}'s hand-written GELU rounds sqrt(2 / pi) to 0.798",
    ),
}


def runtime_spec(bug: str) -> str:
    """The --runtime value of a bug of BUGS, SUBTLE or CRASHING: 'tests.support.bug_zoo:make_xxx'."""
    return f"tests.support.bug_zoo:{(BUGS | SUBTLE | CRASHING)[bug][0]}"


def replayed_zoo(workdir: Path):
    """A lookup bug -> (REF path, RUN path, DiffResult): each bug replayed once (teacher-forced) on first use."""
    from gemma4_trace.diff import diff_traces
    from gemma4_trace.replayer.replay import replay_trace

    cache = {}

    def get(bug):
        if bug not in cache:
            ref = reference_path((BUGS | SUBTLE)[bug][1], workdir)
            run = workdir / f"{bug}.h5"
            replay_trace(ref, run, runtime=runtime_spec(bug), force=True)
            cache[bug] = (ref, run, diff_traces(ref, run))
        return cache[bug]

    return get
