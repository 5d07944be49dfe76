"""Checks of a user's model are real checks, not `assert`s: they hold under `python -O` too
(which removes every assert) and raise the one-line TraceToolError."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the model checks again under python -O; make test-fast skips it

EDITS = {  # what the checkpoint gets wrong -> the line that refuses it
    "del text.layers[-1]": "HF model has 7 layers, config says 8",
    "text.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(1))": (
        "attention_bias=True is not supported (q_proj)"
    ),
    "a = text.layers[0].self_attn; a.k_proj.weight = torch.nn.Parameter(a.k_proj.weight[:-1])": "layer k_proj (",
    "a = text.layers[0].self_attn; a.q_proj.weight = torch.nn.Parameter(a.q_proj.weight[:-1])": "q_proj (",
}
PROGRAM = """
import json, sys, torch
from gemma4_trace.hf.model import load_model
from gemma4_trace.replayer.runtime import StaticGemma4Runtime
from gemma4_trace.traces.errors import TraceToolError

out = {}
for edit in json.loads(sys.argv[1]):
    lm = load_model()
    text = lm.model.model.language_model
    exec(edit)
    try:
        StaticGemma4Runtime(lm, max_seq=16)
        out[edit] = "accepted"
    except TraceToolError as e:
        out[edit] = "refused: " + str(e)
print(json.dumps(out))
"""


def test_model_checks_hold_under_python_O():
    r = subprocess.run(
        [sys.executable, "-O", "-c", PROGRAM, json.dumps(list(EDITS))], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    for edit, needle in EDITS.items():
        assert got[edit].startswith("refused: ") and needle in got[edit], (edit, got[edit])
