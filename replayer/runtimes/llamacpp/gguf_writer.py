"""HF Gemma 4 text checkpoint -> GGUF (llama.cpp's `gemma4` architecture), written with the
`gguf` library's GGUFWriter, its tensor name tables and metadata keys (extra `llamacpp`).

What llama.cpp's Gemma 4 loader reads, and how an HF checkpoint maps onto it:
- per layer type: head dim (`key_length` full, `key_length_swa` sliding), RoPE base
  (`rope.freq_base` full, `rope.freq_base_swa` sliding), rotated dims (`rope.dimension_count[_swa]`);
- proportional RoPE (full layers): ggml's NEOX rope over the whole head with a `rope_freqs`
  tensor of per-frequency divisors, 1 for the rotated frequencies and 1e30 (no rotation) for
  the rest, which is HF's zero inverse frequency past `partial_rotary_factor`;
- `attention.sliding_window` (same meaning as HF's: a query sees the last `window` positions,
  itself included) and `attention.sliding_window_pattern` (one bool per layer);
- KV sharing: `attention.shared_kv_layers` (the last N layers read an earlier layer's cache);
- double-wide MLPs: `feed_forward_length` as one width per layer when they differ;
- per-layer embeddings: `embedding_length_per_layer_input` and the per_layer_* tensors;
- RMSNorm weights are stored as they are (Gemma 4 multiplies by w, not 1 + w as earlier Gemmas);
- `final_logit_softcapping`; tied embeddings: no `output` tensor (llama.cpp reuses token_embd).

HF Linear weights (out, in) are written as they are: GGUF lists dims innermost first, so
(out, in) is ggml's {in, out}, the layout llama.cpp multiplies with. The file is always F32,
each tensor upcast in row blocks as it is written (the model stays in the dtype it was loaded in);
other types are made from it with llama.cpp's own `llama_model_quantize` (in the child
process, engine.py). Converted files are artifact-cache entries (runtime.py gguf_artifact).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from gemma4_trace.traces.errors import TraceToolError, install_hint

# llama.cpp's own type names (replayer/runtimes/registry.py GGUF_TYPES) -> its llama_ftype (include/llama.h);
# F32 is what the writer writes
GGUF_TYPES = {
    "F32": 0,
    "F16": 1,
    "BF16": 32,
    "Q8_0": 7,
    "Q6_K": 18,
    "Q5_K_M": 17,
    "Q4_K_M": 15,
    "Q4_0": 2,
    "Q3_K_M": 12,
}


def gguf_module():
    try:
        import gguf
    except ImportError as e:
        raise TraceToolError(f"GGUF conversion needs the gguf package: {install_hint('llamacpp')} ({e})") from None
    return gguf


def _text_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float32, copy=False)


def _rope(tc, layer_type: str) -> dict:
    params = getattr(tc, "rope_parameters", None) or {}
    return dict(params.get(layer_type, params) or {})


def tensors(loaded):
    """(gguf name, float32 array) for every tensor the `gemma4` graph reads, in file order."""
    for name, t in sources(loaded):
        yield name, t if isinstance(t, np.ndarray) else _np(t)


def sources(loaded):
    """(gguf name, the model's torch tensor) for every tensor the `gemma4` graph reads, in file
    order; a tensor the writer derives from the config (rope_freqs) comes as its float32 array.
    One table both ways: the writer reads it, `--weights-from` (replayer/gguf_reader.py) writes
    a GGUF's tensors back into the model through it."""
    from gemma4_trace.traces.layers import layer_infos_from_config

    gguf = gguf_module()
    T = gguf.MODEL_TENSOR
    names = gguf.TENSOR_NAMES
    tc = loaded.text_config
    tm = _text_model(loaded.model)
    infos = layer_infos_from_config(tc)
    full = [i for i, info in enumerate(infos) if info.layer_type == "full_attention"]
    if full:
        rope = _rope(tc, "full_attention")
        head_dim = infos[full[0]].head_dim
        rotated = (
            int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
            if rope.get("rope_type", "default") == "proportional"
            else head_dim // 2
        )
        freqs = np.array([1.0] * rotated + [1e30] * (head_dim // 2 - rotated), dtype=np.float32)
        yield names[T.ROPE_FREQS] + ".weight", freqs
    yield names[T.TOKEN_EMBD] + ".weight", tm.embed_tokens.weight
    lm_head = getattr(loaded.model, "lm_head", None)
    if lm_head is not None and lm_head.weight.data_ptr() != tm.embed_tokens.weight.data_ptr():
        yield names[T.OUTPUT] + ".weight", lm_head.weight
    yield names[T.OUTPUT_NORM] + ".weight", tm.norm.weight
    if getattr(tc, "hidden_size_per_layer_input", 0):
        yield names[T.PER_LAYER_TOKEN_EMBD] + ".weight", tm.embed_tokens_per_layer.weight
        yield names[T.PER_LAYER_MODEL_PROJ] + ".weight", tm.per_layer_model_projection.weight
        yield names[T.PER_LAYER_PROJ_NORM] + ".weight", tm.per_layer_projection_norm.weight
    for i, layer in enumerate(tm.layers):
        a = layer.self_attn
        per_layer = [
            (T.ATTN_NORM, layer.input_layernorm.weight),
            (T.ATTN_Q, a.q_proj.weight),
            (T.ATTN_Q_NORM, a.q_norm.weight),
        ]
        if infos[i].kv_role != "reuses":
            per_layer += [(T.ATTN_K, a.k_proj.weight), (T.ATTN_K_NORM, a.k_norm.weight)]
            if getattr(a, "v_proj", None) is not None:  # attention_k_eq_v: llama.cpp uses K as V
                per_layer.append((T.ATTN_V, a.v_proj.weight))
        per_layer += [
            (T.ATTN_OUT, a.o_proj.weight),
            (T.ATTN_POST_NORM, layer.post_attention_layernorm.weight),
            (T.FFN_NORM, layer.pre_feedforward_layernorm.weight),
            (T.FFN_GATE, layer.mlp.gate_proj.weight),
            (T.FFN_UP, layer.mlp.up_proj.weight),
            (T.FFN_DOWN, layer.mlp.down_proj.weight),
            (T.FFN_POST_NORM, layer.post_feedforward_layernorm.weight),
            (T.LAYER_OUT_SCALE, layer.layer_scalar),
        ]
        if getattr(tc, "hidden_size_per_layer_input", 0):
            per_layer += [
                (T.PER_LAYER_INP_GATE, layer.per_layer_input_gate.weight),
                (T.PER_LAYER_PROJ, layer.per_layer_projection.weight),
                (T.PER_LAYER_POST_NORM, layer.post_per_layer_input_norm.weight),
            ]
        for kind, t in per_layer:
            yield names[kind].format(bid=i) + ".weight", t


def check_supported(loaded) -> None:
    tc = loaded.text_config
    if getattr(tc, "enable_moe_block", False):
        raise TraceToolError("GGUF export of Gemma 4 MoE checkpoints is not supported (enable_moe_block)")
    if getattr(tc, "attention_bias", False):
        raise TraceToolError("GGUF export with attention_bias=True is not supported")
    _check_kv_sharing(tc)
    for lt in set(tc.layer_types):
        rope = _rope(tc, lt)
        if (
            rope.get("rope_type", "default") not in ("default", "proportional")
            or float(rope.get("factor", 1.0) or 1.0) != 1.0
        ):
            raise TraceToolError(
                f"GGUF export: RoPE {rope.get('rope_type')} with factor {rope.get('factor')} ({lt}) is not supported"
            )


def _check_kv_sharing(tc) -> None:
    """llama.cpp's Gemma 4 has a KV-sharing layer read the last layer before the sharing ones
    if it is a full layer, the one before that if sliding: it must be the layer HF reads."""
    from gemma4_trace.traces.layers import layer_infos_from_config

    infos = layer_infos_from_config(tc)
    first = len(infos) - int(getattr(tc, "num_kv_shared_layers", 0) or 0)
    for i in range(first, len(infos)):
        llama = first - (1 if infos[i].layer_type == "full_attention" else 2)
        if infos[i].kv_source != llama:
            raise TraceToolError(
                f"llama.cpp cannot run this KV sharing: its layer {i} ({infos[i].layer_type}) would read layer "
                f"{llama}'s K/V, HF reads layer {infos[i].kv_source}'s (llama.cpp expects the last layer before the "
                "sharing ones to be a full layer and the one before it sliding)"
            )


def expected_metadata(loaded) -> dict:
    """{key: value} of the metadata the writer would write for `loaded` (no vocabulary): what a
    user's GGUF is checked against (replayer/gguf_reader.py)."""
    gguf = gguf_module()
    w = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA4])
    _metadata(w, loaded, vocab=False)
    return {k: v.value for k, v in w.kv_data[0].items()}


def _metadata(w, loaded, vocab: bool = True) -> None:
    from gemma4_trace.traces.layers import layer_infos_from_config

    tc = loaded.text_config
    tm = _text_model(loaded.model)
    infos = layer_infos_from_config(tc)
    by_type = {info.layer_type: info for info in infos}
    full = by_type.get("full_attention", infos[0])
    swa = by_type.get("sliding_attention", infos[0])
    w.add_name(loaded.name)
    w.add_block_count(len(infos))
    w.add_context_length(int(getattr(tc, "max_position_embeddings", 131072)))
    w.add_embedding_length(int(tc.hidden_size))
    widths = [int(layer.mlp.gate_proj.weight.shape[0]) for layer in tm.layers]  # double-wide MLPs differ
    w.add_feed_forward_length(widths if len(set(widths)) > 1 else widths[0])
    w.add_head_count(int(tc.num_attention_heads))
    kv = [info.num_kv_heads for info in infos]
    w.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_key_length_swa(swa.head_dim)
    w.add_value_length_swa(swa.head_dim)
    w.add_layer_norm_rms_eps(float(tc.rms_norm_eps))
    w.add_rope_freq_base(float(_rope(tc, "full_attention").get("rope_theta", 1e6)))
    w.add_rope_freq_base_swa(float(_rope(tc, "sliding_attention").get("rope_theta", 1e4)))
    w.add_rope_dimension_count(full.head_dim)  # proportional: the whole head, rope_freqs stops the rest
    w.add_rope_dimension_count_swa(
        int(swa.head_dim * float(_rope(tc, "sliding_attention").get("partial_rotary_factor", 1.0)))
    )
    w.add_sliding_window(int(tc.sliding_window))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in tc.layer_types])
    w.add_shared_kv_layers(int(getattr(tc, "num_kv_shared_layers", 0) or 0))
    w.add_embedding_length_per_layer_input(int(getattr(tc, "hidden_size_per_layer_input", 0) or 0))
    if getattr(tc, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(float(tc.final_logit_softcapping))
    w.add_file_type(GGUF_TYPES["F32"])
    if vocab:
        _vocab(w, loaded)


def _vocab(w, loaded) -> None:
    """The checkpoint's tokenizer through gguf's own vocab readers, so llama.cpp's tools can use
    the file; a checkpoint without one gets an id-only vocabulary of the model's size."""
    gguf = gguf_module()
    d = Path(loaded.model_dir)
    vocab_size = int(loaded.text_config.vocab_size)
    logging.disable(logging.WARNING)  # gguf's vocab readers log about every unusual token
    try:
        v = gguf.LlamaHfVocab(d)
        toks = list(v.all_tokens())
        if len(toks) != vocab_size:
            raise ValueError(f"{len(toks)} tokens, model has {vocab_size}")
        special = gguf.SpecialVocab(d, load_merges=True)
        if not special.merges:
            raise ValueError("no merges")
    except Exception:  # noqa: BLE001 - any tokenizer gguf cannot read: ids only
        w.add_tokenizer_model("none")
        w.add_vocab_size(vocab_size)
        return
    finally:
        logging.disable(logging.NOTSET)
    w.add_tokenizer_model("gemma4")
    w.add_token_list([t for t, _, _ in toks])
    w.add_token_scores([s for _, s, _ in toks])
    w.add_token_types([int(k) for _, _, k in toks])
    special.add_to_gguf(w, quiet=True)
    w.add_add_space_prefix(False)


BLOCK_BYTES = 64 << 20  # float32 bytes upcast at a time while a tensor is written


class _RowBlocks:
    """A model tensor as the gguf writer writes it (`nbytes`, `tofile`), upcast to float32 a block
    of rows at a time: the writer never holds a float32 copy of the model (E2B's per-layer
    embedding table alone is 9.4 GB in float32)."""

    def __init__(self, t):
        self.t = t.detach()
        self.shape = tuple(self.t.shape)
        self.nbytes = self.t.numel() * 4

    def tofile(self, f) -> None:
        row = max(1, self.t[0].numel() if self.t.dim() > 1 else 1)
        step = max(1, BLOCK_BYTES // (4 * row))
        for a in range(0, self.shape[0], step):
            np.ascontiguousarray(_np(self.t[a : a + step])).tofile(f)


def write_f32(loaded, path, mutate=None, metadata=None) -> None:
    """Write `loaded`'s text decoder to `path` as an F32 GGUF (atomically: a temporary file
    beside it, renamed when complete). Faults for tests: `mutate(name, array) -> array` changes
    tensors, `metadata` {key: value} replaces the values of keys the writer wrote (same GGUF type)."""
    gguf = gguf_module()
    check_supported(loaded)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA4])
        _metadata(w, loaded)
        for key, value in (metadata or {}).items():
            old = w.kv_data[0][key]  # only keys the writer wrote: a typo is a KeyError
            w.kv_data[0][key] = gguf.GGUFValue(value, old.type, old.sub_type)
        if mutate is not None:  # faults for tests (small models): every tensor in memory, shapes may change
            for name, arr in tensors(loaded):
                w.add_tensor(name, mutate(name, arr))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        else:  # streamed: each tensor upcast to float32 in row blocks as it is written
            items = [(name, t if isinstance(t, np.ndarray) else _RowBlocks(t)) for name, t in sources(loaded)]
            for name, t in items:
                w.add_tensor_info(name, tuple(t.shape), np.dtype(np.float32), t.nbytes)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for _, t in items:
                w.write_tensor_data(t)
        w.close()


@contextlib.contextmanager
def atomic_path(path):
    """A temporary file's name beside `path`, renamed to `path` when the block ends without an
    error (removed when it fails): a GGUF file is never seen half-written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp made it private; a written file gets the user's usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def with_weights(loaded):
    """`loaded`, or the same checkpoint loaded with its weights if it was built without them
    (a replay on llama.cpp loads them only to convert)."""
    if loaded.has_weights:
        return loaded
    from gemma4_trace.hf.model import load_model, read_config_json

    # in the dtype the checkpoint stores (bf16 for E2B: half the memory; the writer upcasts as it writes)
    cfg = read_config_json(Path(loaded.model_dir))
    stored = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return load_model(loaded.model_dir, dtype="bfloat16" if stored == "bfloat16" else "float32", device=loaded.device)
