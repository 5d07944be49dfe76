"""The static runtime's step graphs (replayer/runtime.py): static-shape functions of tensors.

`prefill_step` (the whole prompt right-padded to max_seq), `prefill_chunk_step` (n prompt rows at
their positions) and `decode_step` (one token) run embeddings -> decoder layers -> logits over the
weights (static_weights.py), writing and reading the K/V caches (static_kv.py) through the masks
(static_masks.py); replayer/functional.py exports them with torch.export. The canonical tensors go
to an optional probe, `probe.tensor(kind, value, layer=None)`; with probe=None no reporting code
runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gemma4_trace.traces.schema import rope_kinds

from .ops import apply_rope, rms_norm
from .static_weights import LayerWeights


def through(probe, kind: str, x: torch.Tensor, rows: slice, layer: int | None = None) -> torch.Tensor:
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
class Step:
    """What every layer of one forward call (prefill or a decode step) shares."""

    input_pos: torch.Tensor  # (n,) absolute positions fed
    masks: dict  # layer type -> allowed[query, key] (1, n, max_seq) bool
    rope: dict  # layer type -> (cos, sin), each (1, n, head_dim of that type)
    valid: torch.Tensor | None  # prefill: (n,) bool, rows that are prompt (not padding); decode: None
    probe: object | None
    report: slice  # rows reported to the probe: the new prompt rows in prefill (never padding), 1 in decode


class StaticGraph:
    """Part of StaticGemma4Runtime: one forward call, embeddings to logits (every weight, cache and
    mask through the runtime's own attributes and seams)."""

    # ------------------------------------------------------------------ embeddings, FFN, head
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed) * self.embed_scale  # (1, n, H)

    def _per_layer_inputs(self, ple_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # token-identity part (ids with multimodal tokens replaced by pad) + context part from fused embeds
        n = x.shape[1]
        tok = (F.embedding(ple_ids, self.ple_embed) * self.ple_scale).view(1, n, self.n_layers, self.ple_dim)
        proj = F.linear(x, self.ple_model_proj) * (self.hidden**-0.5)
        proj = rms_norm(proj.view(1, n, self.n_layers, self.ple_dim), self.ple_proj_norm, self.eps)
        return (proj + tok) * (2.0**-0.5)  # (1, n, L, P)

    def _mlp(self, L: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, L.gate_proj)) * F.linear(x, L.up_proj), L.down_proj)

    def _moe(self, L: LayerWeights, residual: torch.Tensor) -> torch.Tensor:
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

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.lm_head)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # ------------------------------------------------------------------ decoder
    def _step(self, input_pos, masks, valid, probe, report_rows) -> Step:
        """The state of one forward call, with the RoPE rows (1, n, D) per layer type at input_pos.

        report_rows: the rows the probe gets, a slice, or an int for the leading rows.
        """
        rope = {
            t: (getattr(self, f"cos_{t}")[input_pos][None], getattr(self, f"sin_{t}")[input_pos][None])
            for t in self.types
        }
        report = report_rows if isinstance(report_rows, slice) else slice(0, report_rows)
        return Step(input_pos, masks, rope, valid, probe, report)

    def _attention(self, i: int, h: torch.Tensor, step: Step) -> torch.Tensor:
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

    def _layer(self, i: int, x: torch.Tensor, ple: torch.Tensor | None, step: Step) -> torch.Tensor:
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
            x = through(probe, "layer_out", x, rows, layer=i)
        return x

    def _decoder(self, x: torch.Tensor, ple_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """Embeddings (1, n, H) at positions step.input_pos (n,) -> final hidden (1, n, H)."""
        ple = self._per_layer_inputs(ple_ids, x) if self.ple_dim else None
        probe, rows = step.probe, step.report
        if probe is not None:
            x = through(probe, "embeddings", x, rows)
            if ple is not None:
                ple = through(probe, "per_layer_inputs", ple, rows)
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

    # ------------------------------------------------------------------ static steps (exportable)
    def prefill_step(
        self, ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid, probe=None, report_rows: int | None = None
    ):
        """Prefill over the padded prompt; all shapes fixed by max_seq.

        ids, ple_ids (1, S) long: prompt ids, multimodal tokens replaced by pad, right-padded
        mm_embeds (1, S, H): image and audio soft tokens at their slots; mm_slots (1, S) bool
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
