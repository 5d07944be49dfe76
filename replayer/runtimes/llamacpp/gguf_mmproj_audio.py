"""HF Gemma 4 audio tower -> the audio half of an mmproj GGUF (llama.cpp's `clip` architecture,
audio projector `gemma4a`), the file llama.cpp's multimodal library (mtmd) runs the conformer
from; written with the `gguf` library's GGUFWriter (extra `llamacpp`). A checkpoint with a vision
tower gets both towers in the one file (gguf_mmproj.py's vision keys and tensors), as llama.cpp's
converter writes a Gemma 4 mmproj: mtmd loads each modality by its own `clip.<modality>.*` keys.

What clip.cpp's gemma4a loader reads (llama-cpp-python 0.3.36's vendored tools/mtmd/clip.cpp),
and how the checkpoint's `audio_tower` and `embed_audio` map onto it:
- keys: `clip.has_audio_encoder`, `clip.audio.projector_type` = gemma4a, `clip.audio.embedding_length`,
  `.feed_forward_length`, `.block_count`, `.attention.head_count`, `.projection_dim` (the text
  hidden), `.attention.layer_norm_epsilon` (clip.cpp then hard-codes 1e-6 for gemma4a anyway) and
  `clip.audio.num_mel_bins` (the feature extractor's 128);
- the subsampling: `a.conv1d.{0,1}.weight` (the 3 x 3 convolutions as they are, float32),
  `a.conv1d.{0,1}.norm.weight` (their channel LayerNorms), `a.input_projection.weight`;
- per layer `a.blk.N.*`: ffn_norm / ffn_up / ffn_down / ffn_post_norm (feed_forward1), ffn_norm_1 /
  ffn_up_1 / ffn_down_1 / ffn_post_norm_1 (feed_forward2), attn_pre_norm, attn_q/k/v, attn_out
  (the attention's `post`), attn_post_norm, attn_k_rel (relative_k_proj), per_dim_scale
  (softplus of HF's parameter: the graph multiplies by it), conv_norm (lconv1d's pre-norm: clip.cpp
  loads the two conv norms by swapped names), conv_pw1 / conv_pw2 (linear_start / linear_end),
  conv_dw (the depthwise kernel, (channels, width)), norm_conv (lconv1d's conv_norm), ln2 (norm_out);
  each clipped linear's four bounds as `<name>.input_min` ... (shape (1,));
- `a.pre_encode.out.weight` / `.bias`: output_proj; `mm.a.input_projection.weight`: embed_audio's
  projection (its norm has no weight).

Against llama.cpp's converter (vendor/llama.cpp/conversion/gemma.py, Gemma4VisionAudioModel, with
gguf-py's tensor name table): the same tensor names, shapes and transforms (softplus of
per_dim_scale, the depthwise kernel squeezed, scalar bounds as (1,)), so the same tensors bit for
bit, and the same keys and values except two: `clip.audio.feed_forward_length` is written here from
the checkpoint's feed-forward weights, the converter writes hidden x 4 (equal for every Gemma 4
checkpoint, whose audio feed-forward is 4 x hidden), and `clip.audio.attention.layer_norm_epsilon`
here is the audio config's `rms_norm_eps`, the converter's is `layer_norm_eps` (absent in Gemma 4's
config, so its default 1e-6; the same number). Everything is float32 here; the converter keeps the
convolutions float32 and writes the rest in its output type.

mtmd's gemma4a graph hard-codes what the config could vary (chunk 12, 12 past frames, the
depthwise kernel's 4 frames of left padding, the logit cap 50, the half-step residual 0.5, two
subsampling convolutions): a checkpoint that says otherwise is refused in one line (check_supported).
"""

from __future__ import annotations

import numpy as np

from gemma4_trace.traces.errors import TraceToolError

from . import gguf_mmproj as GM
from .gguf_writer import atomic_path, gguf_module

MMPROJ_NAME = "mmproj-audio.gguf"
# what mtmd's gemma4a graph hard-codes (tools/mtmd/models/gemma4a.cpp): config key -> its value
FIXED = {
    "attention_chunk_size": 12,
    "attention_context_left": 13,  # 12 past frames (context_left - 1)
    "attention_context_right": 0,
    "conv_kernel_size": 5,  # ggml_pad_ext(..., 4, ...): kernel - 1 frames of causal padding
    "attention_logit_cap": 50.0,
    "residual_weight": 0.5,
}
FFN = {"feed_forward1": "", "feed_forward2": "_1"}  # gguf suffix of each half-step feed-forward
LINEARS = {  # HF module (in a layer) -> gguf name
    "feed_forward1.ffw_layer_1": "ffn_up",
    "feed_forward1.ffw_layer_2": "ffn_down",
    "feed_forward2.ffw_layer_1": "ffn_up_1",
    "feed_forward2.ffw_layer_2": "ffn_down_1",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.post": "attn_out",
    "lconv1d.linear_start": "conv_pw1",
    "lconv1d.linear_end": "conv_pw2",
}
NORMS = {
    "feed_forward1.pre_layer_norm": "ffn_norm",
    "feed_forward1.post_layer_norm": "ffn_post_norm",
    "feed_forward2.pre_layer_norm": "ffn_norm_1",
    "feed_forward2.post_layer_norm": "ffn_post_norm_1",
    "norm_pre_attn": "attn_pre_norm",
    "norm_post_attn": "attn_post_norm",
    "lconv1d.pre_layer_norm": "conv_norm",  # clip.cpp's TN_CONV_NORM: the conv block's pre-norm
    "lconv1d.conv_norm": "norm_conv",  # and TN_NORM_CONV: the norm after the depthwise conv
    "norm_out": "ln2",
}
BOUNDS = GM.BOUNDS


def audio_config(loaded):
    return getattr(loaded.model.config, "audio_config", None)


def check_supported(loaded) -> None:
    """Refuse, in one line, a checkpoint whose audio tower mtmd's gemma4a graph cannot express."""
    ac = audio_config(loaded)
    if ac is None:
        raise TraceToolError(f"{loaded.name} has no audio tower: there is no audio mmproj to write")
    for key, want in FIXED.items():
        got = getattr(ac, key, None)
        if got is None or float(got) != float(want):
            raise TraceToolError(f"the audio tower's {key} is {got}: llama.cpp's gemma4a graph hard-codes {want}")
    if len(getattr(ac, "subsampling_conv_channels", ())) != 2:
        raise TraceToolError("the audio tower's subsampling is not two convolutions: gemma4a hard-codes two")
    if getattr(ac, "hidden_act", "silu") != "silu":
        raise TraceToolError(f"the audio feed-forward's activation {ac.hidden_act!r}: gemma4a has SiLU only")


def _np(t) -> np.ndarray:
    return np.ascontiguousarray(t.detach().float().cpu().numpy().astype(np.float32, copy=False))


def tensors(loaded):
    """(gguf name, float32 array) for every tensor the gemma4a graph reads."""
    m = loaded.model.model
    tower, embed = m.audio_tower, m.embed_audio
    sub = tower.subsample_conv_projection
    for i in range(2):
        layer = getattr(sub, f"layer{i}")
        yield f"a.conv1d.{i}.weight", _np(layer.conv.weight)
        if getattr(layer.conv, "bias", None) is not None:
            yield f"a.conv1d.{i}.bias", _np(layer.conv.bias)
        if getattr(layer.norm, "weight", None) is not None:
            yield f"a.conv1d.{i}.norm.weight", _np(layer.norm.weight)
    yield "a.input_projection.weight", _np(sub.input_proj_linear.weight)
    for i, layer in enumerate(tower.layers):
        modules = dict(layer.named_modules())
        for hf, name in LINEARS.items():
            mod = modules[hf]
            yield f"a.blk.{i}.{name}.weight", _np(mod.linear.weight if hasattr(mod, "linear") else mod.weight)
            for bound in BOUNDS:
                if hasattr(mod, bound) and getattr(mod, bound) is not None:
                    yield f"a.blk.{i}.{name}.{bound}", _np(getattr(mod, bound)).reshape(1)
        for hf, name in NORMS.items():
            yield f"a.blk.{i}.{name}.weight", _np(modules[hf].weight)
        attn = layer.self_attn
        yield f"a.blk.{i}.attn_k_rel.weight", _np(attn.relative_k_proj.weight)
        yield f"a.blk.{i}.per_dim_scale.weight", _np(torch_softplus(attn.per_dim_scale))
        if getattr(attn, "per_dim_key_scale", None) is not None:
            yield f"a.blk.{i}.per_dim_k_scale.weight", _np(torch_softplus(attn.per_dim_key_scale))
        dw = layer.lconv1d.depthwise_conv1d.weight
        yield f"a.blk.{i}.conv_dw.weight", _np(dw.reshape(dw.shape[0], dw.shape[2]))
    yield "a.pre_encode.out.weight", _np(tower.output_proj.weight)
    if getattr(tower.output_proj, "bias", None) is not None:
        yield "a.pre_encode.out.bias", _np(tower.output_proj.bias)
    yield "mm.a.input_projection.weight", _np(embed.embedding_projection.weight)


def torch_softplus(t):
    import torch.nn.functional as F

    return F.softplus(t.detach().float())


def metadata(loaded) -> dict:
    """The clip keys of the audio tower (name -> value); the GGUF type follows the value's."""
    ac, tc = audio_config(loaded), loaded.model.config.get_text_config()
    ffn = loaded.model.model.audio_tower.layers[0].feed_forward1.ffw_layer_1
    fe = getattr(loaded.processor, "feature_extractor", None)
    return {
        "clip.has_audio_encoder": True,
        "clip.audio.projector_type": "gemma4a",
        "clip.audio.projection_dim": int(tc.hidden_size),
        "clip.audio.embedding_length": int(ac.hidden_size),
        "clip.audio.feed_forward_length": int((ffn.linear if hasattr(ffn, "linear") else ffn).weight.shape[0]),
        "clip.audio.block_count": int(ac.num_hidden_layers),
        "clip.audio.attention.head_count": int(ac.num_attention_heads),
        "clip.audio.attention.layer_norm_epsilon": float(ac.rms_norm_eps),
        "clip.audio.num_mel_bins": int(getattr(fe, "feature_size", 128) or 128),
    }


def write(loaded, path, drop=(), metadata_override=None) -> None:
    """Write `loaded`'s audio tower (and its vision tower, where it has one) to `path` as an F32
    mmproj GGUF (atomically). `drop` leaves keys out, `metadata_override` changes written ones."""
    gguf = gguf_module()
    check_supported(loaded)
    vision = GM.vision_config(loaded) is not None
    if vision:
        GM.check_supported(loaded)
    meta = {"general.type": "mmproj", **(GM.metadata(loaded) if vision else {}), **metadata(loaded)}
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, "clip")
        for key, value in {**meta, **(metadata_override or {})}.items():
            if key in drop:
                continue
            if isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            else:
                w.add_array(key, value)
        for name, arr in (*(GM.tensors(loaded) if vision else ()), *tensors(loaded)):
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
