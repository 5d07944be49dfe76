"""`--runtime mistralrs`: mistral.rs's own Gemma 4 (Rust, candle: PLE, KV sharing, MoE) through its
Python binding, on the CPU in float32, in the child process (extra `gemma4-trace[mistralrs]`).

mistral.rs 0.9.5 loads a transformers checkpoint folder itself (`Which.MultimodalPlain`, its Gemma4
architecture), but reads the full-attention layers' head dim from `text_config.global_head_dim` (and
their K/V heads from `num_global_key_value_heads`), which transformers 5.24 folds into
`per_layer_config` and drops: without them it takes its default head dim and refuses the weights
("shape mismatch for model.language_model.layers.2.self_attn.q_proj.weight"). The fields are written
back (head_fixes.py: from the full layers' per-layer values) into a temporary copy of the folder (its
other files linked, never copied or written to), said once on stderr and kept in the trace's
provenance (the runtime's name). The copy is removed when the replay ends.

Its Python API takes text and gives text and log-probabilities (OpenAI-style): no token ids in, no
logits or tensors out. A step is a new chat completion of one greedy token whose message is the step's
context (REF's prompt and the tokens fed so far, teacher-forced: REF's, free-running: its own) as the
text its tokenizer reads back as exactly those ids (else refused), written verbatim by a chat template
of ours. Each request is a whole pass over its prefix (its prefix cache off: every step the same
computation whatever ran before). The chosen token's id is its top log-probability's
(mistralrs_engine.py). The trace holds the token alone (api.TokenOnly): the diff compares tokens and
lists logits and every tensor kind as not compared. The log-probabilities it returns (the chosen
token's and the top K's) have no place in the trace; the chosen tokens' are said on stderr when the
replay ends. Its KV cache on the CPU is float16 unless MISTRALRS_CPU_KV_F32 is set: the child sets it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from gemma4_trace.hf.model import config_dict
from gemma4_trace.traces.errors import TraceToolError

from ..api import TokenOnly
from ..child import ChildRuntime
from . import head_fixes

ENGINE = "gemma4_trace.replayer.runtimes.mistralrs_engine:MistralRSEngine"
TOP_K = 5  # the top log-probabilities asked of each step
TEMPLATE = "{{ messages[0]['content'] }}"  # the chat template: the step's text as it is
ENV = {"MISTRALRS_CPU_KV_F32": "1", "RUST_LOG": "error", "HF_HUB_OFFLINE": "1"}
_SAID: set = set()  # the model folders whose config fixes this process has said


def fixed_copy(model_dir, fixes: dict) -> Path:
    """head_fixes.fixed_copy, with our verbatim chat template beside it; the caller removes it."""
    folder = head_fixes.fixed_copy(model_dir, fixes, "mistralrs")
    try:
        (folder / "verbatim.jinja").write_text(TEMPLATE)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


class MistralRSRuntime(ChildRuntime):
    """mistral.rs's Runner in the child; each step sends the whole context as text and gets one token."""

    def __init__(self, loaded, max_seq: int):
        from importlib.metadata import version

        config = config_dict(loaded.config)
        self.loaded, self.max_seq = loaded, int(max_seq)
        self.fixes = head_fixes.config_fixes(config, "mistralrs")
        words = "; ".join(head_fixes.fixes_words(self.fixes)) or "none needed"
        self.version = version("mistralrs")
        self.name = (
            f"mistralrs (mistral.rs {self.version}, CPU, float32, f32 KV cache, greedy; config fixed in a copy: "
            f"{words}; text in, tokens and log-probabilities out: tokens only)"
        )
        key = str(loaded.model_dir)
        if self.fixes and key not in _SAID:
            print(f"mistralrs: the config mistral.rs reads, fixed in a temporary copy: {words}", file=sys.stderr)
            _SAID.add(key)
        self.folder: Path | None = None
        self.context: list[int] = []
        self.logprobs: list[float] = []  # the chosen tokens' log-probabilities, step by step

    def prepare(self, input_ids=None, extra_inputs=None) -> None:
        """The fixed copy made and loaded by mistral.rs in the child."""
        if self.child is not None:
            return
        try:
            self.folder = fixed_copy(self.loaded.model_dir, self.fixes)
            child = self.start(f"mistralrs (mistral.rs {self.version})", ENGINE, env=ENV)
            meta = child.call("load", str(self.folder), str(self.folder / "verbatim.jinja"), phase="loading")[1]
        except BaseException:
            self.close()
            raise
        limit = meta.get("max_len")
        if isinstance(limit, int) and limit < self.max_seq:
            self.close()
            raise TraceToolError(
                f"--runtime mistralrs: mistral.rs runs at most {limit} tokens; --max-seq is {self.max_seq}"
            )

    def _next(self, phase: str) -> TokenOnly:
        reply = self.child.call("next", list(self.context), TOP_K, phase=phase)
        self.logprobs.append(float(reply[2]))
        return TokenOnly(int(reply[1]))

    def prefill(self, input_ids, extra_inputs, probe):
        self.prepare()
        self.context = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        self.logprobs = []
        return self._next(self.phase(True))

    def decode(self, token_id, position, probe):
        if int(position) != len(self.context):
            raise TraceToolError(f"mistralrs: asked for position {position} after {len(self.context)} tokens")
        self.context.append(int(token_id))
        return self._next(self.phase(False))

    def close(self) -> None:
        if self.logprobs and sys.exc_info()[0] is None:  # a failed replay says its one line alone
            said = ", ".join(f"{v:.4g}" for v in self.logprobs)
            print(f"mistralrs: its chosen tokens' log-probabilities, step by step: {said}", file=sys.stderr)
        self.logprobs = []
        super().close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def create(loaded, max_seq: int, choice=None):
    return MistralRSRuntime(loaded, max_seq)
