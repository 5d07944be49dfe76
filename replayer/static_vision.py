"""The static runtime's vision tower (replayer/runtime.py): pixels -> soft tokens over the HF weights.

A port of Gemma 4's vision encoder in plain torch ops, nothing of HF's forward called: the patch
embedder (pixels scaled to [-1, 1], a linear projection, learned x and y position tables), encoder
layers (RMSNorms around bidirectional attention with q/k/v norms and 2D axial RoPE, scaling 1; a
GeGLU MLP; clipped linears where the config has them), the k x k average pooling of the patch grid
times sqrt(hidden), the optional standardization, and embed_vision (an unscaled RMSNorm and a
projection into the text tower's width).

Static shapes: every tensor is (images, patches, ...) with the processor's fixed patch budget per
image; padding patches (position (-1, -1)) are masked as attention keys and zeroed before pooling,
never sliced off. Only the last step keeps the pooled tokens that cover real patches (what HF
strips), image after image. Each vision site goes to the probe as the real patches' rows, image
after image (`report(..., tower="vision")`). The small methods are the seams a planted bug
overrides (tests/support/bug_zoo.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gemma4_trace.traces.errors import TraceToolError

from .api import report
from .ops import ACTIVATIONS, ClippedLinear, rms_norm, rotate_half

VISION = "vision"


class _Layer(nn.Module):
    def __init__(self, hf):
        super().__init__()
        a, m = hf.self_attn, hf.mlp
        self.q, self.k, self.v, self.o = (ClippedLinear(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
        self.gate, self.up, self.down = (ClippedLinear(p) for p in (m.gate_proj, m.up_proj, m.down_proj))
        norms = {
            "input_norm": hf.input_layernorm,
            "post_attn_norm": hf.post_attention_layernorm,
            "pre_ffn_norm": hf.pre_feedforward_layernorm,
            "post_ffn_norm": hf.post_feedforward_layernorm,
            "q_norm": a.q_norm,
            "k_norm": a.k_norm,
        }
        for name, norm in norms.items():
            self.register_buffer(name, norm.weight.detach(), persistent=False)


class StaticVision(nn.Module):
    """The vision tower and embed_vision of a Gemma4ForConditionalGeneration, ported.

    soft = StaticVision(model).encode(pixel_values, image_position_ids, probe)   # (soft tokens, text hidden)
    """

    def __init__(self, model):
        super().__init__()
        tower, embed = model.model.vision_tower, model.model.embed_vision
        cfg = model.config.vision_config
        self.hidden, self.heads, self.kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.eps, self.pooling = cfg.rms_norm_eps, cfg.pooling_kernel_size
        self.act = ACTIVATIONS.get(cfg.hidden_activation)
        if self.act is None:
            raise TraceToolError(f"vision hidden_activation {cfg.hidden_activation!r} is not supported")
        rope = cfg.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise TraceToolError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only axial)")
        self.rope_theta = float(rope["rope_theta"])
        pe = tower.patch_embedder
        self.register_buffer("patch_proj", pe.input_proj.weight.detach(), persistent=False)
        self.register_buffer("position_table", pe.position_embedding_table.detach(), persistent=False)
        self.layers = nn.ModuleList(_Layer(layer) for layer in tower.encoder.layers)
        self.standardize = bool(getattr(cfg, "standardize", False))
        if self.standardize:
            self.register_buffer("std_bias", tower.std_bias.detach(), persistent=False)
            self.register_buffer("std_scale", tower.std_scale.detach(), persistent=False)
        self.embed_eps = embed.eps
        self.register_buffer("embed_proj", embed.embedding_projection.weight.detach(), persistent=False)

    # ------------------------------------------------------------------ the whole tower
    def encode(self, pixels: torch.Tensor, positions: torch.Tensor, probe=None) -> torch.Tensor:
        """(images, patches, 3 p^2) pixels and (images, patches, 2) positions -> the soft tokens of
        the real patches, image after image: (tokens, text hidden)."""
        return self.run(pixels, positions, probe)[0]

    def run(self, pixels: torch.Tensor, positions: torch.Tensor, probe=None, padded: bool = False):
        """The tower: (soft tokens, which pooled tokens cover real patches). `padded`: every shape
        static, (images, tokens, text hidden) and its (images, tokens) mask, each site reported with
        its padding rows (a step graph's outputs: replayer/functional.py's VisionGraph strips them on
        the host); else only the real rows, image after image."""
        positions = positions.long()
        valid = (positions != -1).all(dim=-1)  # (images, patches): the real patches
        rows = None if padded else valid
        x = self.patch_embed(pixels, positions, valid)
        self._report(probe, "patch_embeddings", x, rows)
        cos, sin = self.rope_tables(positions)
        mask = self.attention_mask(valid)
        for i, layer in enumerate(self.layers):
            x = self.layer(layer, i, x, cos, sin, mask, rows, probe)
        pooled, kept = self.pool(x, positions, valid)
        pooled = self.standardized(pooled).to(x.dtype)
        if not padded:
            pooled = pooled[kept]  # the pooled tokens that cover real patches, image after image
        report(probe, "pooled", pooled, tower=VISION)
        soft = F.linear(rms_norm(pooled, None, self.embed_eps), self.embed_proj)
        report(probe, "soft_tokens", soft, tower=VISION)
        return soft, kept

    @staticmethod
    def _report(probe, kind: str, x: torch.Tensor, rows, layer: int | None = None) -> None:
        """Report x (images, patches, ...): its real rows (`rows` the real patches' mask), or all of
        them (rows None)."""
        if probe is not None:
            report(probe, kind, x if rows is None else x[rows], layer=layer, tower=VISION)

    # ------------------------------------------------------------------ the seams
    def patch_embed(self, pixels, positions, valid) -> torch.Tensor:
        """Pixels scaled to [-1, 1] (in their own dtype, then cast to the weights': HF's rounding in
        bfloat16) and projected, plus the x and y position tables (zero at padding)."""
        h = F.linear((2 * (pixels - 0.5)).to(self.patch_proj.dtype), self.patch_proj)
        p = positions.clamp(min=0)
        pos = F.embedding(p[..., 0], self.position_table[0]) + F.embedding(p[..., 1], self.position_table[1])
        return h + torch.where(valid[..., None], pos, torch.zeros((), dtype=pos.dtype))

    def rope_tables(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (images, patches, head_dim): the first half rotates by x, the second by y, each
        half over head_dim / 2 channels with frequencies theta^(-2j / (head_dim / 2))."""
        half = self.head_dim // 2
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        ang = positions.float()[..., None] * inv.to(positions.device)  # (images, patches, 2, half / 2)
        ang = torch.cat([ang[..., 0, :], ang[..., 0, :], ang[..., 1, :], ang[..., 1, :]], dim=-1)
        dtype = self.patch_proj.dtype
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def apply_rope(self, x, cos, sin) -> torch.Tensor:
        """x (images, patches, heads, head_dim): each half rotated by its own axis."""
        half = self.head_dim // 2
        c, s = cos[:, :, None], sin[:, :, None]
        parts = [
            x[..., sl] * c[..., sl] + rotate_half(x[..., sl]) * s[..., sl] for sl in (slice(0, half), slice(half, None))
        ]
        return torch.cat(parts, dim=-1)

    def attention_mask(self, valid) -> torch.Tensor:
        """allowed[image, query, key]: every real key, no padding key (bidirectional)."""
        return valid[:, None, :].expand(-1, valid.shape[1], -1)

    def layer(self, w: _Layer, i: int, x, cos, sin, mask, rows, probe) -> torch.Tensor:
        """One encoder layer; its sites reported as `_report` says (`rows`: the real patches, or None)."""
        n, p = x.shape[:2]
        h = rms_norm(x, w.input_norm, self.eps)
        q = self.apply_rope(rms_norm(w.q(h).view(n, p, self.heads, -1), w.q_norm, self.eps), cos, sin)
        k = self.apply_rope(rms_norm(w.k(h).view(n, p, self.kv_heads, -1), w.k_norm, self.eps), cos, sin)
        v = rms_norm(w.v(h).view(n, p, self.kv_heads, -1), None, self.eps)
        for kind, t in (("q", q), ("k", k), ("v", v)):
            self._report(probe, kind, t, rows, i)
        attn = self.attend(q, k, v, mask)
        attn = w.o(attn.reshape(n, p, -1))
        self._report(probe, "attn_out", attn, rows, i)
        x = x + rms_norm(attn, w.post_attn_norm, self.eps)
        h = rms_norm(x, w.pre_ffn_norm, self.eps)
        mlp = w.down(self.act(w.gate(h)) * w.up(h))
        self._report(probe, "mlp_out", mlp, rows, i)
        x = x + rms_norm(mlp, w.post_ffn_norm, self.eps)
        self._report(probe, "layer_out", x, rows, i)
        return x

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """softmax(q k^T) v with scaling 1 over the allowed keys (K/V heads repeated for the q heads)."""
        rep = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (k, v))
        scores = torch.einsum("nqhd,nkhd->nhqk", q, k).float()
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.einsum("nhqk,nkhd->nqhd", probs, v)

    def pool(self, x, positions, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """Average k x k cells of patches (padding zeroed) times sqrt(hidden), in float32: (images,
        tokens, hidden) and which tokens cover real patches."""
        n, p = x.shape[:2]
        k = self.pooling
        tokens = p // (k * k)
        h = torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype)).float()
        if tokens == p:
            return h * math.sqrt(self.hidden), valid
        pos = positions.clamp(min=0)
        width = (pos[..., 0].max(dim=-1, keepdim=True).values + 1) // k
        cell = pos[..., 0] // k + width * (pos[..., 1] // k)  # (images, patches): the token each patch joins
        weights = F.one_hot(cell, tokens).float() / (k * k)  # (images, patches, tokens)
        pooled = (weights.transpose(1, 2) @ h).to(x.dtype).float()  # back to the model's dtype, as HF
        kept = (weights != 0).any(dim=1)
        return pooled * math.sqrt(self.hidden), kept

    def standardized(self, pooled) -> torch.Tensor:
        if not self.standardize:
            return pooled
        return (pooled - self.std_bias.float()) * self.std_scale.float()
