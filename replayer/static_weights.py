"""The static runtime's weights (replayer/runtime.py): what it reads from the HF model once.

Every weight is a view of the HF tensor, never a copy, held as a non-persistent buffer with
the name quant.py and torch.export see (`layers.N.q_proj`, `embed`, `ple_model_proj`, ...);
the RoPE tables (max_seq, head_dim) per layer type are built here too, once.
"""

from __future__ import annotations

import torch
from torch import nn

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.layers import LayerInfo, layer_infos_from_config

from .ops import ACTIVATIONS, rope_inv_freq


class LayerWeights(nn.Module):
    """One decoder layer's weights (views of the HF tensors) and what they say of the layer: owns_kv,
    k_eq_v, ple, moe. A layer that owns K/V gets its cache buffers from StaticKV (static_kv.py)."""

    def __init__(self, hf_layer, info: LayerInfo):
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


def text_model(model):
    """The HF text decoder (embeddings, layers, final norm) of a causal LM or a multimodal model."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


class StaticWeights:
    """Part of StaticGemma4Runtime (an nn.Module): the config's facts, the weights and the RoPE tables,
    read by the runtime's __init__ in this order: _read_config, _bind_weights, (the caches), _build_rope."""

    def _read_config(self, model, max_seq: int) -> None:
        """The facts of the HF config the steps use (max_seq, layer infos, eps, window, ...); refuses
        what the static runtime does not support."""
        self.multimodal = getattr(model.config, "vision_config", None) is not None
        cfg = model.config.get_text_config()
        self.cfg = cfg
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

    def _bind_weights(self, model) -> None:
        """`layers` (LayerWeights each) and the model-level buffers, views of the HF weights; sets dtype."""
        text = text_model(model)
        dtype = text.embed_tokens.weight.dtype
        self.dtype = dtype
        ls = [layer for layer in text.layers]
        if len(ls) != self.n_layers:
            raise TraceToolError(f"HF model has {len(ls)} layers, config says {self.n_layers}")
        self.layers = nn.ModuleList(LayerWeights(ls[i], self.infos[i]) for i in range(self.n_layers))
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

    def _build_rope(self) -> None:
        """RoPE tables `cos_<type>`, `sin_<type>` (max_seq, head_dim) per layer type, indexed by position
        (_step); `head_dim` {layer type: head_dim}."""
        dtype, device = self.dtype, self.embed.device
        pos = torch.arange(self.max_seq, dtype=torch.int64).float()
        self.head_dim = {}
        for t in self.types:
            d = next(li.head_dim for li in self.infos if li.layer_type == t)
            self.head_dim[t] = d
            inv = rope_inv_freq(dict(self.cfg.rope_parameters[t]), d)
            freqs = pos[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_seq, D)
            self.register_buffer(f"cos_{t}", emb.cos().to(dtype).to(device), persistent=False)
            self.register_buffer(f"sin_{t}", emb.sin().to(dtype).to(device), persistent=False)
