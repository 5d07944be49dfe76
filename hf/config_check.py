"""A model folder's config.json checked before anything reads it: a file the user passed with
--model is untrusted input like a trace (docs/robustness.md). Every command reads it through
model.read_config_json, which calls check() here, so no runtime, engine or converter (transformers,
mlx-lm, litert-torch, a GGUF writer) meets a config whose shape it would trip on: each refusal is
one line naming the file and the field.

What is checked is the shape the tool and the engines rely on, not every field transformers knows:
the top level and each sub-config are objects, the sizes are integers in range, the epsilons and
caps finite numbers, `layer_types` one known type per layer."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.inputs import read_bytes

MAX_CONFIG_BYTES = 64 << 20  # E2B's config.json is about 5 KiB; a million layer types, 21 MiB
MAX_SIZE = 1 << 31  # any size field (memory.py caps the ones that set the model's bytes far lower)
SUB_CONFIGS = ("text_config", "vision_config", "audio_config")
SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "head_dim",
    "global_head_dim",
    "vocab_size",
    "vocab_size_per_layer_input",
    "hidden_size_per_layer_input",
    "num_kv_shared_layers",
    "sliding_window",
    "max_position_embeddings",
    "patch_size",
    "pooling_kernel_size",
    "position_embedding_size",
    "default_output_length",
)
TOKEN_IDS = (  # each a token id, or a list of them (eos_token_id)
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "image_token_id",
    "audio_token_id",
    "video_token_id",
    "boi_token_id",
    "eoi_token_id",
    "boa_token_id",
    "eoa_token_id",
    "eoa_token_index",
)
NUMBERS = ("rms_norm_eps", "final_logit_softcapping", "attn_logit_softcapping", "rope_theta")
LAYER_TYPES = ("sliding_attention", "full_attention")


def load(path: Path) -> dict:
    """config.json's object, read within MAX_CONFIG_BYTES and checked (one line on anything wrong)."""
    raw = read_bytes(path, "the model's config", MAX_CONFIG_BYTES)  # a regular file, never a FIFO
    try:
        data = json.loads(raw)
    except RecursionError:
        raise TraceToolError(f"{path} is nested too deeply to be a model config") from None
    except ValueError as e:
        raise TraceToolError(f"{path} is not readable JSON ({e})") from None
    check(data, str(path))
    return data


def check(data, where: str) -> None:
    if not isinstance(data, dict):
        raise TraceToolError(f"{where} holds a JSON {type(data).__name__}, not an object (a save_pretrained config)")
    parts = [("", data)]
    for key in SUB_CONFIGS:
        sub = data.get(key)
        if sub is not None and not isinstance(sub, dict):
            raise TraceToolError(f"{where}: {key} is a {type(sub).__name__}, not an object")
        if sub is not None:
            parts.append((f"{key}.", sub))
    for prefix, part in parts:
        for key in SIZES:
            _size(part.get(key), f"{prefix}{key}", where)
        for key in NUMBERS:
            _number(part.get(key), f"{prefix}{key}", where)
        for key in TOKEN_IDS:
            ids = part.get(key)
            for value in ids[:1024] if isinstance(ids, list) and len(ids) <= 1024 else [ids]:
                _size(value, f"{prefix}{key}", where)
        per_layer = part.get("per_layer_config")
        if per_layer is not None and not isinstance(per_layer, dict):
            raise TraceToolError(f"{where}: {prefix}per_layer_config is a {type(per_layer).__name__}, not an object")
        _layer_types(part, prefix, where)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _size(value, name: str, where: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE:
        raise TraceToolError(f"{where}: {name} is {_shown(value)}, not a whole number from 0 to {MAX_SIZE}")


def _number(value, name: str, where: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceToolError(f"{where}: {name} is {_shown(value)}, not a finite number")


def _layer_types(part: dict, prefix: str, where: str) -> None:
    types = part.get("layer_types")
    if types is None:
        return
    n = part.get("num_hidden_layers")
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise TraceToolError(f"{where}: {prefix}layer_types must list {' or '.join(LAYER_TYPES)} per layer")
    if isinstance(n, int) and len(types) != n:
        raise TraceToolError(f"{where}: {prefix}layer_types has {len(types)} entries for {n} layers")
