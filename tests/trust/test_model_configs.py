"""Trust of a model folder's config.json (hf/config_check.py): a hostile or malformed config is one
line naming the file and the field, exit 2, for every command and runtime that takes --model,
before any engine (transformers, mlx-lm, a converter) reads it."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from gemma4_trace.hf.model import embedded_model_dir
from gemma4_trace.recorder.golden import golden_path
from tests.support.cli import invoke, one_line_error

REF = golden_path("short")


def text(**kw):
    """An edit of the config: text_config's keys set to kw."""
    return lambda c: {**c, "text_config": {**c["text_config"], **kw}}


CASES = {  # name -> (edit of the parsed config, or raw file bytes; what the one line says)
    "a list": (b"[1, 2]", "holds a JSON list, not an object"),
    "a string": (b'"gemma4"', "holds a JSON str, not an object"),
    "text_config a list": (lambda c: {**c, "text_config": [1]}, "text_config is a list, not an object"),
    "text_config a string": (lambda c: {**c, "text_config": "x"}, "text_config is a str, not an object"),
    "vision_config a number": (lambda c: {**c, "vision_config": 3}, "vision_config is a int, not an object"),
    "per_layer_config a list": (text(per_layer_config=[]), "text_config.per_layer_config is a list"),
    "hidden_size a string": (text(hidden_size="64"), "text_config.hidden_size is '64', not a whole number"),
    "hidden_size a float": (text(hidden_size=64.5), "text_config.hidden_size is 64.5, not a whole number"),
    "hidden_size 1e400": (b'{"model_type": "gemma4_text", "hidden_size": 1e400}', "hidden_size is inf"),
    "hidden_size negative": (text(hidden_size=-1), "text_config.hidden_size is -1"),
    "heads a bool": (text(num_attention_heads=True), "num_attention_heads is True"),
    "eps NaN": (b'{"model_type": "gemma4_text", "rms_norm_eps": NaN}', "rms_norm_eps is nan, not a finite number"),
    "layer_types bogus": (text(layer_types=["sliding_attention", "other"] * 4), "layer_types must list"),
    "layer_types short": (text(layer_types=["full_attention"]), "layer_types has 1 entries for 8 layers"),
    "a token id past any vocabulary": (lambda c: {**c, "image_token_id": 10**400}, "image_token_id is 1000000"),
    "eos a list with a string": (text(eos_token_id=[1, "x"]), "text_config.eos_token_id is 'x'"),
    "nested 100k deep": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "over 64 MiB": (b" " * (64 << 20) + b"{}", "bytes, more than the 67108864 allowed"),
}


def folder(tmp_path, case):
    model = tmp_path / "model"
    shutil.copytree(embedded_model_dir(), model)
    edit, _ = CASES[case]
    raw = edit if isinstance(edit, bytes) else json.dumps(edit(json.loads((model / "config.json").read_text())))
    (model / "config.json").write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    return model


COMMANDS = [
    ("record", "--input-ids", "2,3", "--max-new-tokens", 1),
    ("replay", REF),
    pytest.param(
        ("replay", REF, "--runtime", "mlx"),
        marks=pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs the [mlx] extra"),
    ),
]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", COMMANDS, ids=["record", "replay", "replay-mlx"])
def test_a_hostile_config_is_one_line_naming_the_field(tmp_path, case, command):
    model = folder(tmp_path, case)
    out = tmp_path / "o.h5"
    one_line_error(invoke(*command, "--model", model, "-o", out), "config.json", CASES[case][1], out=out)
