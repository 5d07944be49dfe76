"""StaticGemma4Runtime: a static-shape Gemma 4 text decoder over the HF weights.

gpt-fast style: the weights are read from the HF model once (no copies), the per-layer
KV caches are preallocated buffers (1, kv_heads, max_seq, head_dim), and the RoPE
tables and masks are built once for max_seq and indexed by position. Prefill runs the
whole padded prompt (right padding to max_seq) and writes only the valid K/V rows; the
decode step writes one row at its position and attends over all max_seq slots through
the mask. Nothing here calls HF's decoder layers, attention, rotary embedding or text
model; only the vision tower (pixels -> soft tokens) runs through HF.

The canonical tensors go to an optional probe: `probe.tensor(kind, value, layer=None)`.
With probe=None no reporting code runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.layers import LayerInfo, layer_infos_from_config
from gemma4_trace.traces.schema import rope_kinds

from .api import Runtime
from .ops import ACTIVATIONS, ChunkProbe, apply_rope, check_fits, chunk_plan, rms_norm, rope_inv_freq

UNSUPPORTED_INPUTS = ("pixel_values_videos", "input_features", "input_features_mask")


# ----------------------------------------------------------------------------- weights
class _Layer(nn.Module):
    """One decoder layer's weights (views of the HF tensors) and, if it owns K/V, its cache."""

    def __init__(self, hf_layer, info: LayerInfo, max_seq: int, dtype: torch.dtype, device):
        super().__init__()
        attn = hf_layer.self_attn
        w = lambda t: t.detach()  # noqa: E731  (a view, never a copy)
        buffers = {
            "input_norm": hf_layer.input_layernorm.weight,
            "post_attn_norm": hf_layer.post_attention_layernorm.weight,
            "pre_ffn_norm": hf_layer.pre_feedforward_layernorm.weight,
            "post_ffn_norm": hf_layer.post_feedforward_layernorm.weight,
            "q_proj": attn.q_proj.weight,
            "q_norm": attn.q_norm.weight,
            "o_proj": attn.o_proj.weight,
            "gate_proj": hf_layer.mlp.gate_proj.weight,
            "up_proj": hf_layer.mlp.up_proj.weight,
            "down_proj": hf_layer.mlp.down_proj.weight,
            "layer_scalar": hf_layer.layer_scalar,
        }
        for name in ("q_proj", "o_proj"):
            if getattr(attn, name).bias is not None:
                raise TraceToolError(f"attention_bias=True is not supported ({name})")
        self.owns_kv = info.kv_role != "reuses"
        self.k_eq_v = False
        if self.owns_kv:
            if attn.k_proj.weight.shape != (info.num_kv_heads * info.head_dim, hf_layer.hidden_size):
                raise TraceToolError(
                    f"layer k_proj {tuple(attn.k_proj.weight.shape)} != kv_heads {info.num_kv_heads} x head_dim "
                    f"{info.head_dim}"
                )
            buffers["k_proj"] = attn.k_proj.weight
            buffers["k_norm"] = attn.k_norm.weight
            self.k_eq_v = attn.v_proj is None
            if not self.k_eq_v:
                buffers["v_proj"] = attn.v_proj.weight
        self.ple = bool(getattr(hf_layer, "hidden_size_per_layer_input", 0))
        if self.ple:
            buffers["ple_gate"] = hf_layer.per_layer_input_gate.weight
            buffers["ple_proj"] = hf_layer.per_layer_projection.weight
            buffers["ple_norm"] = hf_layer.post_per_layer_input_norm.weight
        self.moe = bool(getattr(hf_layer, "enable_moe_block", False))
        if self.moe:
            buffers.update(
                router_scale=hf_layer.router.scale,
                router_proj=hf_layer.router.proj.weight,
                router_expert_scale=hf_layer.router.per_expert_scale,
                experts_gate_up=hf_layer.experts.gate_up_proj,
                experts_down=hf_layer.experts.down_proj,
                post_ffn_norm_1=hf_layer.post_feedforward_layernorm_1.weight,
                post_ffn_norm_2=hf_layer.post_feedforward_layernorm_2.weight,
                pre_ffn_norm_2=hf_layer.pre_feedforward_layernorm_2.weight,
            )
        for name, t in buffers.items():
            self.register_buffer(name, w(t), persistent=False)
        if self.q_proj.shape[0] != info.num_heads * info.head_dim:
            raise TraceToolError(
                f"q_proj {tuple(self.q_proj.shape)} != heads {info.num_heads} x head_dim {info.head_dim}"
            )
        if self.owns_kv:
            shape = (1, info.num_kv_heads, max_seq, info.head_dim)
            self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


def _through(probe, kind: str, x: torch.Tensor, rows: slice, layer: int | None = None) -> torch.Tensor:
    """Report x's rows `rows` (of (1, n, ...)) and continue with what the probe returns.

    A probe returns None or the same rows (x goes on unchanged), or other rows: an isolating
    probe hands back REF's (replayer/isolate.py), so the next layer sees REF's input.
    """
    view = x[0, rows]
    got = probe.tensor(kind, view, layer=layer)
    if got is None or got is view:
        return x
    return torch.cat([x[:, : rows.start], got.to(x.dtype)[None], x[:, rows.stop :]], dim=1)


@dataclass
class _Step:
    """What every layer of one forward call (prefill or a decode step) shares."""

    input_pos: torch.Tensor  # (n,) absolute positions fed
    masks: dict  # layer type -> allowed[query, key] (1, n, max_seq) bool
    rope: dict  # layer type -> (cos, sin), each (1, n, head_dim of that type)
    valid: torch.Tensor | None  # prefill: (n,) bool, rows that are prompt (not padding); decode: None
    probe: object | None
    report: slice  # rows reported to the probe: the new prompt rows in prefill (never padding), 1 in decode


class StaticGemma4Runtime(nn.Module, Runtime):
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
        self.multimodal = getattr(model.config, "vision_config", None) is not None
        cfg = model.config.get_text_config()
        self.cfg = cfg
        text = model.model.language_model if hasattr(model.model, "language_model") else model.model
        self.max_seq = int(max_seq)
        self.infos = layer_infos_from_config(cfg)
        self.n_layers = len(self.infos)
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.window = int(cfg.sliding_window)
        self.softcap = cfg.final_logit_softcapping
        self.ple_dim = int(cfg.hidden_size_per_layer_input or 0)
        self.pad_id = int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        self.types = sorted(set(cfg.layer_types))
        if getattr(cfg, "use_bidirectional_attention", None) == "all":
            raise TraceToolError(
                "use_bidirectional_attention='all' (encoder-style Gemma 4) is not supported by the static runtime"
            )
        if cfg.hidden_activation not in ACTIVATIONS:
            raise TraceToolError(f"hidden_activation {cfg.hidden_activation!r} is not supported by the static runtime")
        self.act = ACTIVATIONS[cfg.hidden_activation]
        self.bidir_vision = getattr(cfg, "use_bidirectional_attention", None) == "vision"
        top = model.config
        self.mm_token_ids = [
            int(t)
            for t in (
                getattr(top, "image_token_id", None),
                getattr(top, "video_token_id", None),
                getattr(top, "audio_token_id", None),
            )
            if t is not None and self.multimodal
        ]
        self.top_k = int(cfg.top_k_experts or 0)

        dtype = text.embed_tokens.weight.dtype
        device = text.embed_tokens.weight.device
        self.dtype = dtype
        ls = [layer for layer in text.layers]
        if len(ls) != self.n_layers:
            raise TraceToolError(f"HF model has {len(ls)} layers, config says {self.n_layers}")
        self.layers = nn.ModuleList(
            _Layer(ls[i], self.infos[i], self.max_seq, dtype, device) for i in range(self.n_layers)
        )
        self.register_buffer("embed", text.embed_tokens.weight.detach(), persistent=False)
        # sqrt(hidden) cast to the weight dtype first, as HF does (bf16 rounds it)
        self.register_buffer("embed_scale", torch.tensor(self.hidden**0.5).to(dtype), persistent=False)
        self.register_buffer("final_norm", text.norm.weight.detach(), persistent=False)
        self.register_buffer("lm_head", model.lm_head.weight.detach(), persistent=False)
        if self.ple_dim:
            self.register_buffer("ple_embed", text.embed_tokens_per_layer.weight.detach(), persistent=False)
            self.register_buffer("ple_scale", torch.tensor(self.ple_dim**0.5).to(dtype), persistent=False)
            self.register_buffer("ple_model_proj", text.per_layer_model_projection.weight.detach(), persistent=False)
            self.register_buffer("ple_proj_norm", text.per_layer_projection_norm.weight.detach(), persistent=False)

        # RoPE tables (max_seq, head_dim) per layer type, built once and indexed by position
        pos = torch.arange(self.max_seq, dtype=torch.int64).float()
        self.head_dim = {}
        for t in self.types:
            d = next(li.head_dim for li in self.infos if li.layer_type == t)
            self.head_dim[t] = d
            inv = rope_inv_freq(dict(cfg.rope_parameters[t]), d)
            freqs = pos[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_seq, D)
            self.register_buffer(f"cos_{t}", emb.cos().to(dtype).to(device), persistent=False)
            self.register_buffer(f"sin_{t}", emb.sin().to(dtype).to(device), persistent=False)

        # masks are computed per step from positions (_mask_rows): a (max_seq, max_seq) table
        # would be the one thing whose memory grows with max_seq squared
        # the HF multimodal model, for get_image_features only; kept out of this module's state
        self.__dict__["vision"] = model.model if self.multimodal else None

    # ------------------------------------------------------------------ helpers
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed) * self.embed_scale  # (1, n, H)

    def _per_layer_inputs(self, ple_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # token-identity part (ids with multimodal tokens replaced by pad) + context part from fused embeds
        n = x.shape[1]
        tok = (F.embedding(ple_ids, self.ple_embed) * self.ple_scale).view(1, n, self.n_layers, self.ple_dim)
        proj = F.linear(x, self.ple_model_proj) * (self.hidden**-0.5)
        proj = rms_norm(proj.view(1, n, self.n_layers, self.ple_dim), self.ple_proj_norm, self.eps)
        return (proj + tok) * (2.0**-0.5)  # (1, n, L, P)

    def _mlp(self, L: _Layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, L.gate_proj)) * F.linear(x, L.up_proj), L.down_proj)

    def _moe(self, L: _Layer, residual: torch.Tensor) -> torch.Tensor:
        """Router on the pre-MLP residual, then the top-k experts; static shapes throughout."""
        n = residual.shape[1]
        h = residual.view(n, -1)  # (n, H)
        r = rms_norm(h, None, self.eps) * L.router_scale * (self.hidden**-0.5)
        probs = torch.softmax(F.linear(r, L.router_proj), dim=-1, dtype=torch.float32)  # (n, E)
        top_w, top_i = torch.topk(probs, k=self.top_k, dim=-1)  # (n, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w * L.router_expert_scale[top_i]
        x = rms_norm(h, L.pre_ffn_norm_2, self.eps)
        if n == 1:  # decode: gather the k chosen experts' weights
            gu = L.experts_gate_up[top_i[0]]  # (k, 2I, H)
            gate, up = torch.einsum("kih,h->ki", gu, x[0]).chunk(2, dim=-1)
            y = torch.einsum("khi,ki->kh", L.experts_down[top_i[0]], self.act(gate) * up)  # (k, H)
            out = (y * top_w[0, :, None]).to(x.dtype).sum(0, keepdim=True)
        else:  # prefill: every expert over every row, weighted by a dense (n, E) routing table
            dense = torch.zeros(n, L.experts_gate_up.shape[0], dtype=top_w.dtype, device=x.device)
            dense = dense.scatter(1, top_i, top_w)
            out = torch.zeros_like(x)
            for e in range(L.experts_gate_up.shape[0]):
                gate, up = F.linear(x, L.experts_gate_up[e]).chunk(2, dim=-1)
                y = F.linear(self.act(gate) * up, L.experts_down[e])
                out = out + (y * dense[:, e, None]).to(x.dtype)
        return rms_norm(out.view(1, n, -1), L.post_ffn_norm_2, self.eps)

    def _check_cache(self, i: int, what: str, cache: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Raise naming layer i when a K/V buffer cannot hold its (1, kv_heads, n, head_dim) rows.

        Shapes are static, so this costs nothing in an exported graph.
        """
        info = self.infos[i]
        want = (1, info.num_kv_heads, self.max_seq, info.head_dim)
        got = tuple(cache.shape)
        bad = got != want or (rows is not None and (tuple(rows.shape[:2]) != want[:2] or rows.shape[3] != want[3]))
        if bad:
            src = f" (K/V of layer {info.kv_source})" if info.kv_source != i else ""
            rows_s = f" for rows {tuple(rows.shape)}" if rows is not None else ""
            raise TraceToolError(
                f"{self.name} runtime: layer {i} ({info.layer_type}) {what}{src}: cache buffer {got}{rows_s}, "
                f"expected (1, kv_heads {info.num_kv_heads}, max_seq {self.max_seq}, head_dim {info.head_dim})"
            )

    def _write_kv(self, i: int, k_t: torch.Tensor, v_t: torch.Tensor, input_pos: torch.Tensor, valid) -> None:
        """Write layer i's K/V rows (1, KV, n, D) into its cache.

        Prefill (valid (n,) bool given) writes padding rows as zeros: over the whole max_seq it
        rewrites the whole cache, a chunk writes its n rows at their positions; decode (valid
        None) writes one row per position.
        """
        L = self.layers[i]
        self._check_cache(i, "writes K/V", L.k_cache, k_t)
        self._check_cache(i, "writes K/V", L.v_cache, v_t)
        if valid is None:
            L.k_cache.index_copy_(2, input_pos, k_t)
            L.v_cache.index_copy_(2, input_pos, v_t)
        else:
            keep = valid[None, None, :, None]
            k_t, v_t = torch.where(keep, k_t, torch.zeros_like(k_t)), torch.where(keep, v_t, torch.zeros_like(v_t))
            if k_t.shape[2] == self.max_seq:
                L.k_cache.copy_(k_t)
                L.v_cache.copy_(v_t)
            else:
                L.k_cache.index_copy_(2, input_pos, k_t)
                L.v_cache.index_copy_(2, input_pos, v_t)

    def _read_kv(self, i: int, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V (1, KV, max_seq, D) layer i attends over at positions input_pos.

        A reusing layer reads the storing layer's cache, which already holds this step's rows.
        """
        src = self.layers[self.infos[i].kv_source]
        self._check_cache(i, "reads K/V", src.k_cache)
        self._check_cache(i, "reads K/V", src.v_cache)
        return src.k_cache, src.v_cache

    def _step(self, input_pos, masks, valid, probe, report_rows) -> _Step:
        """The state of one forward call, with the RoPE rows (1, n, D) per layer type at input_pos.

        report_rows: the rows the probe gets, a slice, or an int for the leading rows.
        """
        rope = {
            t: (getattr(self, f"cos_{t}")[input_pos][None], getattr(self, f"sin_{t}")[input_pos][None])
            for t in self.types
        }
        report = report_rows if isinstance(report_rows, slice) else slice(0, report_rows)
        return _Step(input_pos, masks, rope, valid, probe, report)

    def _attention(self, i: int, h: torch.Tensor, step: _Step) -> torch.Tensor:
        """Layer i's attention on the normed input h (1, n, H): writes its K/V rows (if it owns
        K/V), attends over the whole cache through the mask; returns o_proj's output (1, n, H)."""
        L, info = self.layers[i], self.infos[i]
        n, H, D, KV = h.shape[1], info.num_heads, info.head_dim, info.num_kv_heads
        cos, sin = step.rope[info.layer_type]
        mask = step.masks[info.layer_type]
        probe, rows = step.probe, step.report

        q = rms_norm(F.linear(h, L.q_proj).view(1, n, H, D), L.q_norm, self.eps)
        q = apply_rope(q, cos, sin)  # (1, n, H, D)
        if L.owns_kv:
            k_raw = F.linear(h, L.k_proj).view(1, n, KV, D)
            v = k_raw if L.k_eq_v else F.linear(h, L.v_proj).view(1, n, KV, D)
            k = apply_rope(rms_norm(k_raw, L.k_norm, self.eps), cos, sin)
            v = rms_norm(v, None, self.eps)
            self._write_kv(i, k.transpose(1, 2), v.transpose(1, 2), step.input_pos, step.valid)  # rows (1, KV, n, D)
            if probe is not None:
                probe.tensor("k", k[0, rows], layer=i)
                probe.tensor("v", v[0, rows], layer=i)
        k_all, v_all = self._read_kv(i, step.input_pos)  # (1, KV, S, D)
        if probe is not None:
            probe.tensor("mask", mask[0, rows], layer=i)
            probe.tensor("q", q[0, rows], layer=i)

        G = H // KV  # query heads per KV head; head h reads KV head h // G
        # scores, softmax and the PV product in float32, as HF's SDPA keeps them (its kernels
        # accumulate and hold scores in float32); rounding scores to bf16 before the softmax
        # drifts measurably at E2B scale. For float32 weights .float() is a no-op: same graph.
        qg = q.transpose(1, 2).reshape(1, KV, G * n, D).float()
        scores = torch.matmul(qg, k_all.float().transpose(2, 3)).view(1, KV, G, n, -1)  # scaling = 1.0
        scores = scores.masked_fill(~mask[:, None, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).view(1, KV, G * n, -1)
        attn = torch.matmul(probs, v_all.float()).to(q.dtype)  # (1, KV, G * n, D)
        attn = attn.view(1, H, n, D).transpose(1, 2).reshape(1, n, H * D)
        return F.linear(attn, L.o_proj)  # (1, n, hidden)

    def _layer(self, i: int, x: torch.Tensor, ple: torch.Tensor | None, step: _Step) -> torch.Tensor:
        """One decoder layer on x (1, n, H) at positions step.input_pos (n,)."""
        L = self.layers[i]
        probe, rows = step.probe, step.report
        attn = self._attention(i, rms_norm(x, L.input_norm, self.eps), step)
        if probe is not None:
            probe.tensor("attn_out", attn[0, rows], layer=i)
        x = x + rms_norm(attn, L.post_attn_norm, self.eps)

        residual = x
        h = self._mlp(L, rms_norm(x, L.pre_ffn_norm, self.eps))
        if L.moe:
            h = rms_norm(h, L.post_ffn_norm_1, self.eps) + self._moe(L, residual)
        x = residual + rms_norm(h, L.post_ffn_norm, self.eps)

        if L.ple:
            g = self.act(F.linear(x, L.ple_gate)) * ple[:, :, i, :]
            x = x + rms_norm(F.linear(g, L.ple_proj), L.ple_norm, self.eps)
        x = x * L.layer_scalar
        if probe is not None:
            x = _through(probe, "layer_out", x, rows, layer=i)
        return x

    def _decoder(self, x: torch.Tensor, ple_ids: torch.Tensor, step: _Step) -> torch.Tensor:
        """Embeddings (1, n, H) at positions step.input_pos (n,) -> final hidden (1, n, H)."""
        ple = self._per_layer_inputs(ple_ids, x) if self.ple_dim else None
        probe, rows = step.probe, step.report
        if probe is not None:
            x = _through(probe, "embeddings", x, rows)
            if ple is not None:
                ple = _through(probe, "per_layer_inputs", ple, rows)
            for t in self.types:
                cos_kind, sin_kind = rope_kinds(t)
                probe.tensor(cos_kind, step.rope[t][0][0, rows])
                probe.tensor(sin_kind, step.rope[t][1][0, rows])
        for i in range(self.n_layers):
            x = self._layer(i, x, ple, step)
        x = rms_norm(x, self.final_norm, self.eps)
        if probe is not None:
            probe.tensor("final_hidden", x[0, rows])
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.lm_head)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _prefill_masks(self, input_pos, valid, block_ids) -> dict:
        """{layer type: allowed (1, n, S)} for the n queries at input_pos (n,) of the padded
        prompt; valid (S,): keys that are prompt, padding keys are never visible."""
        masks = {"full_attention": self._mask_rows("full_attention", input_pos) & valid[None, :]}
        sliding = self._mask_rows("sliding_attention", input_pos)
        if self.bidir_vision:
            # sliding layers: window AND (causal OR same image block); full layers stay causal
            q_block = block_ids[input_pos]
            same = (q_block[:, None] == block_ids[None, :]) & (q_block[:, None] >= 0)
            keys = torch.arange(self.max_seq, device=input_pos.device)
            window = keys[None, :] > input_pos[:, None] - self.window
            sliding = sliding | (same & window)
        masks["sliding_attention"] = sliding & valid[None, :]
        return {t: m[None] for t, m in masks.items()}  # (1, n, S)

    def _decode_masks(self, input_pos) -> dict:
        """{layer type: allowed (1, 1, S)} for one query at input_pos (1,)."""
        return {t: self._mask_rows(t, input_pos)[None] for t in self.types}

    def _mask_rows(self, layer_type: str, input_pos: torch.Tensor) -> torch.Tensor:
        """allowed[query, key] (n, max_seq) for the queries at input_pos (n,): causal, and on sliding
        layers within the window (key k visible from query q iff q - window < k <= q)."""
        keys = torch.arange(self.max_seq, device=input_pos.device)[None, :]
        q = input_pos[:, None]
        allowed = keys <= q
        if layer_type == "sliding_attention":
            allowed = allowed & (keys > q - self.window)
        return allowed

    # ------------------------------------------------------------------ static steps (exportable)
    def prefill_step(
        self, ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid, probe=None, report_rows: int | None = None
    ):
        """Prefill over the padded prompt; all shapes fixed by max_seq.

        ids, ple_ids (1, S) long: prompt ids, multimodal tokens replaced by pad, right-padded
        mm_embeds (1, S, H): vision soft tokens at their slots; mm_slots (1, S) bool
        block_ids (S,) long: image block of each position (-1 for text) for bidirectional masks
        n_valid () long: prompt length T. Returns the logits (vocab,) at position T - 1.
        report_rows: how many leading rows the probe gets (the T prompt rows, never padding;
        a Python int, since n_valid is a tensor in an exported graph); default all S.
        """
        S = self.max_seq
        input_pos = torch.arange(S, device=ids.device)
        return self.prefill_chunk_step(
            ids,
            ple_ids,
            mm_embeds,
            mm_slots,
            block_ids,
            n_valid,
            input_pos,
            probe,
            S if report_rows is None else report_rows,
        )

    def prefill_chunk_step(
        self, ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid, input_pos, probe=None, report_rows=None
    ):
        """Prefill of the n prompt rows at input_pos (n,) (consecutive positions); shapes (n, max_seq).

        ids, ple_ids (1, n), mm_embeds (1, n, H), mm_slots (1, n): the rows of prepare_prefill's
        tensors at input_pos; block_ids (S,) and n_valid () as for prefill_step. Writes the K/V
        rows of these positions (padding rows as zeros) and attends over the cache, which holds
        every earlier chunk's rows. Returns the logits (vocab,) at position n_valid - 1 when it
        is among input_pos (else at the nearest row). report_rows: int (leading rows) or slice.
        """
        S, n = self.max_seq, ids.shape[1]
        x = torch.where(mm_slots[..., None], mm_embeds, self._embed(ids))  # soft tokens are not scaled
        keys_valid = torch.arange(S, device=ids.device) < n_valid
        masks = self._prefill_masks(input_pos, keys_valid, block_ids)
        step = self._step(input_pos, masks, input_pos < n_valid, probe, n if report_rows is None else report_rows)
        h = self._decoder(x, ple_ids, step)
        row = torch.clamp(n_valid - 1 - input_pos[0], 0, n - 1)
        last = torch.index_select(h[0], 0, row.reshape(1))  # (1, H)
        return self._logits(last)[0]

    def decode_step(self, token, input_pos, probe=None):
        """One token (1, 1) long (multimodal ids already replaced by pad) at input_pos (1,)."""
        x = self._embed(token)
        step = self._step(input_pos, self._decode_masks(input_pos), None, probe, report_rows=1)
        h = self._decoder(x, token, step)
        return self._logits(h[0, 0])

    # ------------------------------------------------------------------ public API
    def prepare_prefill(self, input_ids, extra_inputs: dict) -> tuple:
        """Prompt ids (T,) + processor outputs -> the static tensors prefill_step takes."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        T = int(ids.shape[0])
        if T > self.max_seq:
            raise TraceToolError(f"the prompt has {T} tokens, more than max_seq {self.max_seq}")
        extra = {k: torch.as_tensor(v) for k, v in (extra_inputs or {}).items()}
        bad = [k for k in UNSUPPORTED_INPUTS if k in extra]
        if bad:
            raise TraceToolError(f"the static runtime does not support {', '.join(bad)} inputs (images and text only)")
        dev = self.embed.device
        S, Hd = self.max_seq, self.hidden
        padded = torch.full((S,), self.pad_id, dtype=torch.long)
        padded[:T] = ids
        mm = torch.zeros(S, dtype=torch.bool)
        for t in self.mm_token_ids:
            mm[:T] |= ids == t
        ple_ids = torch.where(mm, self.pad_id, padded)
        mm_embeds = torch.zeros(1, S, Hd, dtype=self.dtype, device=dev)
        image_slots = torch.zeros(S, dtype=torch.bool)
        if "pixel_values" in extra:
            if self.vision is None:
                raise TraceToolError("pixel_values given to a text-only model")
            image_slots[:T] = ids == self.loaded.model.config.image_token_id
            with torch.no_grad():
                feats = self.vision.get_image_features(
                    extra["pixel_values"].to(dev, self.dtype), extra["image_position_ids"].to(dev), return_dict=True
                ).pooler_output
            feats = torch.cat(list(feats), dim=0).to(self.dtype)  # (n_soft, H)
            n_slots = int(image_slots.sum())
            if feats.shape[0] != n_slots:
                raise TraceToolError(
                    f"the images give {feats.shape[0]} soft tokens for {n_slots} image-token slots in the prompt"
                )
            mm_embeds[0, image_slots.to(dev)] = feats
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
            image_slots[None].to(dev),
            block_ids.to(dev),
            torch.tensor(T, device=dev),
        )

    @torch.no_grad()
    def prefill(self, input_ids, extra_inputs: dict | None = None, probe=None) -> torch.Tensor:
        """Run the prompt (T,) ids; return the logits (vocab,) at position T - 1.

        With `prefill_chunk` N < max_seq the prompt runs in chunks of N rows (shapes (N, max_seq),
        see chunk_plan), else over the whole padded max_seq in one step.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        args = self.prepare_prefill(ids, extra_inputs or {})
        N = self.prefill_chunk
        if N is None or N >= self.max_seq:
            return self.prefill_step(*args, probe=probe, report_rows=len(ids))
        ids_p, ple_ids, mm_embeds, mm_slots, block_ids, n_valid = args
        for L in self.layers:  # chunks write only the rows they cover; the rest must read as empty
            if L.owns_kv:
                L.k_cache.zero_()
                L.v_cache.zero_()
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
