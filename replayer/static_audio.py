"""The static runtime's audio tower (replayer/runtime.py): log-mel features -> soft tokens over the HF weights.

A port of Gemma 4's audio encoder (a conformer) in plain torch ops, nothing of HF's forward called:
the subsampling (two 3 x 3 stride-2 convs, each after zeroing the padding frames, with a bias-less
LayerNorm over channels and a ReLU, then a linear projection), conformer layers (a half-step
feed-forward, chunked local self-attention with a relative position bias, per-dim query scaling and
a tanh logit cap, a light conv block with a GLU and a causal depthwise conv, a second half-step
feed-forward, an output RMSNorm; clipped linears and the gradient_clipping clamps where the config
has them), output_proj, and embed_audio (an unscaled RMSNorm and a projection into the text width).

Static shapes: every tensor is (clips, frames, ...) with the processor's mel frames per clip (so
frames // 4 subsampled frames); padding frames are masked as attention keys and zeroed before each
subsampling conv as HF does, never sliced off. HF's blocked attention (chunks of
attention_chunk_size queries over a context of the chunk plus attention_context_left - 1 past
frames, the rel-shift of the position logits) is computed here as a (frames x frames) attention:
the chunk's context and HF's sliding window are a mask, the rel-shift a gather by distance. Only the
soft tokens keep the valid frames alone, clip after clip (what HF strips). Each audio site goes to
the probe as the valid frames' rows, clip after clip (`report(..., tower="audio")`). The small
methods are the seams a planted bug overrides (tests/support/bug_zoo.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gemma4_trace.traces.errors import TraceToolError

from .api import report
from .ops import ACTIVATIONS, ClippedLinear, rms_norm

AUDIO = "audio"


class _Norms(nn.Module):
    """RMSNorm weights by name (views) and each norm's own epsilon (some take the config's, some 1e-6)."""

    def __init__(self, norms: dict):
        super().__init__()
        self.eps = {name: float(n.eps) for name, n in norms.items()}
        for name, n in norms.items():
            self.register_buffer(name, n.weight.detach(), persistent=False)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, getattr(self, name), self.eps[name])


class _FeedForward(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.up, self.down = ClippedLinear(hf.ffw_layer_1), ClippedLinear(hf.ffw_layer_2)
        self.norms = _Norms({"pre": hf.pre_layer_norm, "post": hf.post_layer_norm})


class _Layer(nn.Module):
    def __init__(self, hf):
        super().__init__()
        a, c = hf.self_attn, hf.lconv1d
        self.q, self.k, self.v, self.post = (ClippedLinear(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.post))
        self.register_buffer("relative_k", a.relative_k_proj.weight.detach(), persistent=False)
        self.register_buffer("per_dim_scale", a.per_dim_scale.detach(), persistent=False)
        self.ff1, self.ff2 = _FeedForward(hf.feed_forward1), _FeedForward(hf.feed_forward2)
        self.start, self.end = ClippedLinear(c.linear_start), ClippedLinear(c.linear_end)
        self.register_buffer("depthwise", c.depthwise_conv1d.weight.detach(), persistent=False)  # (C, 1, K)
        self.norms = _Norms(
            {
                "pre_attn": hf.norm_pre_attn,
                "post_attn": hf.norm_post_attn,
                "out": hf.norm_out,
                "lconv_pre": c.pre_layer_norm,
                "conv": c.conv_norm,
            }
        )


class StaticAudio(nn.Module):
    """The audio tower and embed_audio of a Gemma4ForConditionalGeneration, ported.

    soft = StaticAudio(model).encode(input_features, input_features_mask, probe)   # (valid frames, text hidden)
    """

    def __init__(self, model):
        super().__init__()
        tower, embed = model.model.audio_tower, model.model.embed_audio
        cfg = model.config.audio_config
        self.hidden, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = self.hidden // self.heads
        self.act = ACTIVATIONS.get(cfg.hidden_act)
        if self.act is None:
            raise TraceToolError(f"audio hidden_act {cfg.hidden_act!r} is not supported")
        self.chunk, self.context_left = int(cfg.attention_chunk_size), int(cfg.attention_context_left)
        self.context_right = int(cfg.attention_context_right)
        self.invalid_logit = float(cfg.attention_invalid_logits_value)
        self.logit_cap = float(cfg.attention_logit_cap)
        self.residual_weight, self.gradient_clipping = float(cfg.residual_weight), float(cfg.gradient_clipping)
        # the relative positions HF's rel_pos_enc tabulates: context_size // 2 down to 0
        self.context_size = self.chunk + self.context_left - 1 + self.context_right
        if self.context_left + self.context_right < self.context_size // 2:
            raise TraceToolError("the audio attention's context is too short for its relative position table")
        self.register_buffer("inv_timescales", tower.rel_pos_enc.inv_timescales.detach(), persistent=False)
        sub = tower.subsample_conv_projection
        self.sub_eps = []
        for i, layer in enumerate((sub.layer0, sub.layer1)):
            self.register_buffer(f"conv{i}", layer.conv.weight.detach(), persistent=False)
            self.register_buffer(f"conv_norm{i}", layer.norm.weight.detach(), persistent=False)
            self.sub_eps.append(float(layer.norm.eps))
        self.register_buffer("input_proj", sub.input_proj_linear.weight.detach(), persistent=False)
        self.layers = nn.ModuleList(_Layer(layer) for layer in tower.layers)
        self.register_buffer("output_proj", tower.output_proj.weight.detach(), persistent=False)
        self.register_buffer("output_bias", tower.output_proj.bias.detach(), persistent=False)
        self.embed_eps = float(embed.embedding_pre_projection_norm.eps)
        self.register_buffer("embed_proj", embed.embedding_projection.weight.detach(), persistent=False)

    # ------------------------------------------------------------------ the whole tower
    def encode(self, features: torch.Tensor, features_mask: torch.Tensor, probe=None) -> torch.Tensor:
        """(clips, mel frames, mel bins) features and their (clips, mel frames) validity -> the soft
        tokens of the valid subsampled frames, clip after clip: (tokens, text hidden)."""
        return self.run(features, features_mask, probe)[0]

    def run(self, features: torch.Tensor, features_mask: torch.Tensor, probe=None):
        """The tower: (soft tokens of the valid frames, the (clips, frames) validity of the subsampled frames)."""
        x, valid = self.subsample(features, features_mask.bool())
        self._report(probe, "subsampled", x, valid)
        rel = self.relative_positions(x.dtype)
        mask = self.attention_mask(valid)
        for i, layer in enumerate(self.layers):
            x = self.layer(layer, i, x, rel, mask, valid, probe)
        out = F.linear(x, self.output_proj, self.output_bias)
        self._report(probe, "output_proj", out, valid)
        soft = F.linear(rms_norm(out[valid], None, self.embed_eps), self.embed_proj)
        report(probe, "soft_tokens", soft, tower=AUDIO)
        return soft, valid

    @staticmethod
    def _report(probe, kind: str, x: torch.Tensor, valid, layer: int | None = None) -> None:
        """Report x (clips, frames, ...): the valid frames' rows, clip after clip."""
        if probe is not None:
            report(probe, kind, x[valid], layer=layer, tower=AUDIO)

    # ------------------------------------------------------------------ subsampling
    def subsample(self, features, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(clips, T, bins) -> (clips, T', hidden) after the two stride-2 convs and the projection,
        with the validity of the T' frames (the mask's every other frame, twice)."""
        h = features[:, None]  # (clips, 1, T, bins)
        for i in range(2):
            h, mask = self.subsample_conv(h, mask, i)
        n, c, t, f = h.shape
        h = h.permute(0, 2, 3, 1).reshape(n, t, f * c)
        return F.linear(h, self.input_proj), mask

    def subsample_conv(self, h, mask, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Subsampling conv i: the padding frames zeroed, a 3 x 3 stride-2 conv, a LayerNorm over the
        channels (no bias), ReLU; the mask keeps every other frame."""
        w = getattr(self, f"conv{i}")
        h = h * mask[:, None, :, None]
        h = F.conv2d(h.to(w.dtype), w, stride=2, padding=1)
        h = F.layer_norm(h.permute(0, 2, 3, 1), (w.shape[0],), getattr(self, f"conv_norm{i}"), None, self.sub_eps[i])
        return torch.relu(h).permute(0, 3, 1, 2), mask[:, ::2]

    # ------------------------------------------------------------------ attention's tables
    def relative_positions(self, dtype) -> torch.Tensor:
        """The sinusoidal table (positions, hidden) of relative positions context_size // 2 .. 0:
        [sin ..., cos ...] of position x inv_timescales, in the model's dtype."""
        pos = torch.arange(self.context_size // 2, -1, -1, device=self.inv_timescales.device)[..., None]
        t = pos * self.inv_timescales.reshape(1, -1)
        return torch.cat([torch.sin(t), torch.cos(t)], dim=-1).to(dtype)

    def attention_mask(self, valid) -> torch.Tensor:
        """allowed[clip, query, key]: a valid key in the query's chunk context and HF's window."""
        t = valid.shape[1]
        q = torch.arange(t, device=valid.device)[:, None]
        k = torch.arange(t, device=valid.device)[None, :]
        return valid[:, None, :] & self.chunk_context(q, k) & self.window(q, k)

    def chunk_context(self, q, k) -> torch.Tensor:
        """Is key k in the context of query q's chunk: from chunk_size * (q // chunk_size) minus
        context_left - 1 frames to the chunk's end plus context_right frames."""
        start = (q // self.chunk) * self.chunk
        return (k >= start - (self.context_left - 1)) & (k < start + self.chunk + self.context_right)

    def window(self, q, k) -> torch.Tensor:
        """HF's sliding window (context_left - 1, context_right): 0 <= q - k < context_left - 1, or
        0 < k - q < context_right."""
        d = q - k
        return ((d >= 0) & (d < self.context_left - 1)) | ((d < 0) & (-d < self.context_right))

    # ------------------------------------------------------------------ a conformer layer
    def layer(self, w: _Layer, i: int, x, rel, mask, valid, probe) -> torch.Tensor:
        """One conformer layer; its sites reported as the valid frames' rows."""
        gc = min(self.gradient_clipping, torch.finfo(w.norms.pre_attn.dtype).max)
        x = self.feed_forward(w.ff1, x, self.residual_scale(0))
        self._report(probe, "ff1_out", x, valid, i)
        h = w.norms.norm("pre_attn", torch.clamp(x, -gc, gc))
        attn = self.attention(w, h, rel, mask)
        self._report(probe, "attn_out", attn, valid, i)
        x = x + w.norms.norm("post_attn", torch.clamp(attn, -gc, gc))
        x = self.light_conv(w, x)
        self._report(probe, "lconv_out", x, valid, i)
        x = self.feed_forward(w.ff2, x, self.residual_scale(1))
        self._report(probe, "ff2_out", x, valid, i)
        x = w.norms.norm("out", torch.clamp(x, -gc, gc))
        self._report(probe, "layer_out", x, valid, i)
        return x

    def residual_scale(self, which: int) -> float:
        """The scale of feed-forward `which`'s output (0: the first, 1: the second) before its
        residual: residual_weight (a half step) for both."""
        return self.residual_weight

    def feed_forward(self, f: _FeedForward, x, scale: float) -> torch.Tensor:
        """x + scale * post_norm(down(act(up(pre_norm(x))))), clamped to gradient_clipping around."""
        gc = min(self.gradient_clipping, torch.finfo(x.dtype).max)
        h = f.norms.norm("pre", torch.clamp(x, -gc, gc))
        h = f.down(self.act(f.up(h)))
        h = f.norms.norm("post", torch.clamp(h, -gc, gc))
        return h * scale + x

    def attention(self, w: _Layer, h, rel, mask) -> torch.Tensor:
        """Local self-attention with a relative position bias, in float32: the `post` projection of
        softmax(cap(q k^T + q r_(q-k)^T)) v over the allowed keys."""
        n, t, _ = h.shape
        shape = (n, t, self.heads, self.head_dim)
        q, k, v = (p(h).float().view(shape) for p in (w.q, w.k, w.v))
        q = q * (self.head_dim**-0.5 / math.log(2)) * F.softplus(w.per_dim_scale)
        k = k * (math.log(1 + math.e) / math.log(2))
        rel_k = F.linear(rel, w.relative_k).view(-1, self.heads, self.head_dim).float()  # (positions, H, D)
        scores = torch.einsum("nqhd,nkhd->nhqk", q, k) + self.position_logits(q, rel_k)
        scores = self.soft_cap(scores)
        scores = scores.masked_fill(~mask[:, None], self.invalid_logit)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        out = torch.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, t, -1)
        return w.post(out.to(h.dtype))

    def position_logits(self, q, rel_k) -> torch.Tensor:
        """HF's rel-shifted logits q . r_j (n, heads, T, T): j = (context_left - 1) - (q - k), the
        table's row for distance q - k; zero where j falls outside the table (as the shift's padding)."""
        t = q.shape[1]
        bd = torch.einsum("nqhd,jhd->nhqj", q, rel_k)  # (n, H, T, positions)
        pos = torch.arange(t, device=q.device)
        j = (self.context_left - 1) - (pos[:, None] - pos[None, :])  # (T, T)
        inside = (j >= 0) & (j < rel_k.shape[0])
        idx = j.clamp(0, rel_k.shape[0] - 1).expand(*bd.shape[:2], t, t)
        return torch.where(inside, torch.gather(bd, -1, idx), torch.zeros((), dtype=bd.dtype, device=bd.device))

    def soft_cap(self, scores) -> torch.Tensor:
        """tanh(scores / cap) * cap."""
        return torch.tanh(scores / self.logit_cap) * self.logit_cap

    # ------------------------------------------------------------------ the light conv block
    def light_conv(self, w: _Layer, x) -> torch.Tensor:
        """x + end(act(conv_norm(depthwise(glu(start(pre_norm(x))))))), the conv clamped to gradient_clipping."""
        h = F.glu(w.start(w.norms.norm("lconv_pre", x)), dim=-1)
        h = self.depthwise_conv(h, w.depthwise)
        gc = min(self.gradient_clipping, torch.finfo(h.dtype).max)
        h = w.norms.norm("conv", torch.clamp(h, -gc, gc))
        return w.end(self.act(h)) + x

    def depthwise_conv(self, h, weight) -> torch.Tensor:
        """Causal depthwise conv over frames: (n, T, C) left-padded with kernel - 1 zero frames."""
        kernel = weight.shape[-1]
        y = F.conv1d(F.pad(h.transpose(1, 2), (kernel - 1, 0)), weight, groups=weight.shape[0])
        return y.transpose(1, 2)
