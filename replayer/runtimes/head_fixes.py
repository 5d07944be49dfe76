"""The full-attention layers' head dims a third-party Gemma 4 reads from the config's global fields.

transformers 5.24 keeps Gemma 4's head dims per layer, in `text_config.per_layer_config`, and no
longer writes `global_head_dim` (the full-attention layers' head_dim) or `num_global_key_value_heads`
(their K/V heads). CTranslate2's converter (ctranslate2.py) and mistral.rs (mistralrs.py) read those
global fields, and without them take a default that is not the checkpoint's: `config_fixes` gives
them from the full layers' per-layer values (all equal, else refused), `fixes_words` says them, and
`fixed_copy` writes them into a temporary copy of a checkpoint folder (mistral.rs and keras-hub load
a folder: mistralrs.py, keras_hub.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError


def config_fixes(config: dict, runtime: str) -> dict:
    """{global field: value} that the text config (config.json's dict, or its text_config) lacks and
    the full-attention layers' per_layer_config gives; one line for `--runtime runtime` where no fix
    can (full-attention layers that differ among themselves)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    types = text.get("layer_types") or []
    per_layer = text.get("per_layer_config") or {}
    full = [v for i, v in per_layer.items() if int(i) < len(types) and types[int(i)] == "full_attention"]
    fixes = {}
    for key, global_key in (("head_dim", "global_head_dim"), ("num_key_value_heads", "num_global_key_value_heads")):
        values = {v[key] for v in full if key in v}
        if len(values) > 1:
            raise TraceToolError(
                f"--runtime {runtime}: the full-attention layers have different {key}s {sorted(values)}"
            )
        if values:
            fixes[global_key] = values.pop()
    return fixes


def fixes_words(fixes: dict) -> list[str]:
    """Each fix in words, for stderr and the provenance."""
    return [f"{k} set to {v} (from per_layer_config)" for k, v in fixes.items()]


def fixed_copy(model_dir, fixes: dict, runtime: str) -> Path:
    """A temporary folder holding REF's checkpoint: config.json with `fixes` set in its text config
    (or at its top, a text-only config), every other file a link to REF's; the caller removes it."""
    src = Path(model_dir)
    config = json.loads((src / "config.json").read_text())
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    text.update(fixes)
    folder = Path(tempfile.mkdtemp(prefix=f"gemma4-trace-{runtime}-"))
    try:
        for f in src.iterdir():
            if f.name != "config.json":
                os.symlink(f.resolve(), folder / f.name)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder
