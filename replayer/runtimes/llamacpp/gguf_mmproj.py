"""HF Gemma 4 vision tower -> an mmproj GGUF (llama.cpp's `clip` architecture, projector
`gemma4v`), the file llama.cpp's multimodal library (mtmd) runs the tower from; written with the
`gguf` library's GGUFWriter (extra `llamacpp`).

What mtmd's gemma4v loader reads, and how the checkpoint maps onto it (the model's
`vision_tower` and `embed_vision`):
- `v.patch_embd.weight`: the patch projection (hidden, 3 p^2), its columns in (row, col, channel)
  order, written as the convolution kernel (hidden, 3, p, p);
- `v.position_embd.weight`: the (2, positions, hidden) table as it is (x then y);
- per layer `v.blk.N.*`: ln1 / ln2 (input and pre-feedforward norms), attn_q/k/v/out and their
  q/k norms, attn_post_norm, ffn_gate/up/down, ffn_post_norm; a clipped linear's four bounds as
  `<name>.input_min` ... (shape (1,));
- `v.std_bias` / `v.std_scale` when the tower standardizes; `mm.input_projection.weight`:
  embed_vision's projection (its norm has no weight).

Two keys llama.cpp's own converter leaves out, which the project writes because the checkpoint
says them (docs/upstream/llamacpp-gemma4v-mmproj.md):
- `clip.vision.projector.scale_factor`: the pooling kernel (`pooling_kernel_size`); without it
  mtmd pools 3 x 3 whatever the checkpoint says;
- `clip.use_gelu`: the MLP's tanh GELU (`gelu_pytorch_tanh`); without it mtmd uses its quick GELU.

Every tensor is written float32; llama.cpp still casts the pixels to F16 for the patch
convolution (ggml's im2col), the first rounding of its vision path.
"""

from __future__ import annotations

import numpy as np

from gemma4_trace.traces.errors import TraceToolError, one_line

from .gguf_writer import atomic_path, gguf_module

MMPROJ_NAME = "mmproj.gguf"
SCALE_FACTOR = "clip.vision.projector.scale_factor"  # mtmd's n_merge: the pooling kernel
MTMD_POOLING = 3  # what mtmd's gemma4v pools by when the file has no scale_factor
ACTIVATIONS = {"gelu_pytorch_tanh": "clip.use_gelu"}  # HF's MLP activation -> the clip key that selects it
LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
NORMS = {
    "input_layernorm": "ln1",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "attn_post_norm",
    "pre_feedforward_layernorm": "ln2",
    "post_feedforward_layernorm": "ffn_post_norm",
}
BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def vision_config(loaded):
    return getattr(loaded.model.config, "vision_config", None)


def check_supported(loaded) -> None:
    """Refuse, in one line, a checkpoint whose vision tower mtmd's gemma4v graph cannot express."""
    vc = vision_config(loaded)
    if vc is None:
        raise TraceToolError(f"{loaded.name} has no vision tower: there is no mmproj to write")
    act = getattr(vc, "hidden_activation", None)
    if act not in ACTIVATIONS:
        raise TraceToolError(f"the vision MLP's activation {act!r} has no gemma4v equivalent (it has tanh GELU)")
    heads, kv = int(vc.num_attention_heads), int(getattr(vc, "num_key_value_heads", vc.num_attention_heads))
    if heads != kv or int(vc.head_dim) * heads != int(vc.hidden_size):
        raise TraceToolError(
            f"the vision attention has {heads} heads of {vc.head_dim} over {kv} K/V heads, hidden {vc.hidden_size}: "
            "gemma4v takes hidden / heads per head and as many K/V heads as heads"
        )


def _np(t) -> np.ndarray:
    return np.ascontiguousarray(t.detach().float().cpu().numpy().astype(np.float32, copy=False))


def tensors(loaded):
    """(gguf name, float32 array) for every tensor the gemma4v graph reads."""
    tower, embed = loaded.model.model.vision_tower, loaded.model.model.embed_vision
    vc = vision_config(loaded)
    pe = tower.patch_embedder
    w = pe.input_proj.weight
    p = int(vc.patch_size)
    yield "v.patch_embd.weight", _np(w.reshape(w.shape[0], p, p, 3).permute(0, 3, 1, 2))
    yield "v.position_embd.weight", _np(pe.position_embedding_table)
    if getattr(vc, "standardize", False):
        yield "v.std_bias", _np(tower.std_bias)
        yield "v.std_scale", _np(tower.std_scale)
    yield "mm.input_projection.weight", _np(embed.embedding_projection.weight)
    for i, layer in enumerate(tower.encoder.layers):
        modules = dict(layer.named_modules())
        for hf, name in LINEARS.items():
            m = modules[hf]
            yield f"v.blk.{i}.{name}.weight", _np(m.linear.weight if hasattr(m, "linear") else m.weight)
            for bound in BOUNDS:
                if getattr(vc, "use_clipped_linears", False) and hasattr(m, bound):
                    yield f"v.blk.{i}.{name}.{bound}", _np(getattr(m, bound)).reshape(1)
        for hf, name in NORMS.items():
            yield f"v.blk.{i}.{name}.weight", _np(modules[hf].weight)


def metadata(loaded) -> dict:
    """The clip keys (name -> value) the file carries; the GGUF type follows the value's."""
    vc, tc = vision_config(loaded), loaded.model.config.get_text_config()
    return {
        "general.type": "mmproj",
        "clip.has_vision_encoder": True,
        "clip.vision.projector_type": "gemma4v",
        "clip.vision.projection_dim": int(tc.hidden_size),
        "clip.vision.image_size": 224,  # read by the loader, not used by gemma4v
        "clip.vision.patch_size": int(vc.patch_size),
        "clip.vision.embedding_length": int(vc.hidden_size),
        "clip.vision.feed_forward_length": int(vc.intermediate_size),
        "clip.vision.block_count": int(vc.num_hidden_layers),
        "clip.vision.attention.head_count": int(vc.num_attention_heads),
        "clip.vision.attention.layer_norm_epsilon": float(vc.rms_norm_eps),
        "clip.vision.image_mean": [0.0, 0.0, 0.0],  # the graph scales the pixels itself (2 x - 1)
        "clip.vision.image_std": [1.0, 1.0, 1.0],
        SCALE_FACTOR: int(vc.pooling_kernel_size),
        ACTIVATIONS[vc.hidden_activation]: True,
    }


def write(loaded, path, drop=(), metadata_override=None) -> None:
    """Write `loaded`'s vision tower to `path` as an F32 mmproj GGUF (atomically). Faults for tests
    and the upstream write-ups: `drop` leaves keys out (what llama.cpp's converter writes), and
    `metadata_override` {key: value} changes written ones."""
    gguf = gguf_module()
    check_supported(loaded)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, "clip")
        for key, value in {**metadata(loaded), **(metadata_override or {})}.items():
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
        for name, arr in tensors(loaded):
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


# ------------------------------------------------------------------ a user's mmproj (--mmproj FILE)
CHECKED = (  # (key, words): what must equal REF's vision tower
    ("clip.vision.block_count", "vision layers"),
    ("clip.vision.embedding_length", "vision hidden"),
    ("clip.vision.feed_forward_length", "vision MLP width"),
    ("clip.vision.attention.head_count", "vision heads"),
    ("clip.vision.patch_size", "patch size"),
    ("clip.vision.attention.layer_norm_epsilon", "norm epsilon"),
)


def read_header(path):
    """The file's header read within bounds (gguf_reader.py), refused in one line unless it is a
    Gemma 4 vision projector (architecture clip, projector gemma4v)."""
    from .gguf_reader import MalformedGGUF
    from .gguf_reader import read_header as read_gguf

    header = read_gguf(path)
    meta = header.metadata
    projector = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if header.arch != "clip" or meta.get("clip.has_vision_encoder") is not True or projector != "gemma4v":
        found = f"architecture {str(header.arch)[:40]!r}, projector {str(projector)[:40]!r}"
        raise MalformedGGUF(f"{one_line(path, 200)}: not a Gemma 4 vision mmproj ({found}; expected clip, gemma4v)")
    return header


def config_differences(header, loaded) -> tuple[list[str], list[str]]:
    """(differences, notes): each way the file's tower differs from REF's in what it computes, and
    what the file leaves to mtmd's defaults that REF's checkpoint says otherwise."""
    from .gguf_reader import check_weight_types

    check_weight_types(header)
    check_supported(loaded)
    want, meta = metadata(loaded), header.metadata
    diffs = []
    for key, words in CHECKED:
        got, exp = meta.get(key), want[key]
        number = isinstance(got, (int, float)) and not isinstance(got, bool)
        same = number and abs(float(got) - float(exp)) <= 1e-6 * abs(exp)
        if not same:
            diffs.append(f"{words} {'absent' if got is None else one_line(got, 40)} (REF {exp})")
    pooling = meta.get(SCALE_FACTOR, MTMD_POOLING)
    if pooling != want[SCALE_FACTOR]:
        given = f"absent: mtmd pools {MTMD_POOLING}" if SCALE_FACTOR not in meta else one_line(pooling, 40)
        diffs.append(f"pooling {given} (REF {want[SCALE_FACTOR]})")
    table, size, hidden = (
        header.tensors.get("v.position_embd.weight"),
        vision_config(loaded).position_embedding_size,
        want["clip.vision.embedding_length"],
    )
    if table is None or tuple(table.dims) != (hidden, size, 2):
        got = "absent" if table is None else "x".join(map(str, table.dims[::-1]))
        diffs.append(f"position table {got} (REF 2x{size}x{hidden})")
    proj = header.tensors.get("mm.input_projection.weight")
    width = want["clip.vision.projection_dim"]
    if proj is None or len(proj.dims) != 2 or proj.dims[1] != width:
        diffs.append(f"projection to {'absent' if proj is None else proj.dims[-1]} (REF text hidden {width})")
    notes = []
    for key in ACTIVATIONS.values():
        if meta.get(key) is not True:
            notes.append(f"no {key} in the mmproj: mtmd's quick GELU where REF's vision MLP has tanh GELU")
    return diffs, notes
