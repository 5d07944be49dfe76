"""`--runtime litert-lm [--litertlm FILE]`: LiteRT-LM (Google's on-device LLM engine, `litert_lm`,
CPU) on a .litertlm bundle: the one litert-torch's export writes from REF's checkpoint
(replayer/runtimes/litert/export.py), or a user's file.

LiteRT-LM's Python API takes text and gives text: no token ids in, no logits or tensors out. A
step here is a new session prefilled with the step's context (REF's prompt and the tokens fed
so far, as text that LiteRT-LM's tokenizer reads back as exactly those ids, else refused) and one
greedy token decoded (its text read back as one id). The trace holds that token alone
(api.TokenOnly): the diff compares tokens; logits and every tensor kind are not compared.
Teacher-forced and free-running both work (each step starts from its own context).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gemma4_trace.traces.errors import TraceToolError

from ...api import TokenOnly
from ...child import ChildRuntime
from . import export as E

ENGINE = "gemma4_trace.replayer.runtimes.litert.engine:LiteRTLMEngine"
# LiteRT-LM 0.18.1 prefills at most L - 2 tokens in a session whose bundle's cache holds S positions,
# L being S rounded down to even (measured on litert-torch exports: caches 16, 17, 18 took prompts of
# 14, 14, 16 tokens and one decoded token; at L - 2, a session asked for two tokens gives one). The
# replay's last step prefills max_seq - 1 tokens and may ask for two (engine.py: a token withheld
# by a stop sequence), so the bundle exported for a replay has a cache of max_seq + 3 (a cache of
# max_seq failed there). Odd caches misbehave beyond that rule (a cache of 43 refused a prompt of 31
# tokens): the cache is rounded up to even, and the bundle's prefill takes it whole (LiteRT-LM's
# results do not depend on the prefill length; --prefill-chunk does not apply).
ROOM = 3


class LiteRTLM(ChildRuntime):
    """The bundle is exported (or taken from the artifact cache) when the driver prepares it: a cache
    of max_seq + ROOM positions rounded up to even, its prefill taking the cache whole (an export
    of its own, not the litert runtime's: LiteRT-LM needs the room)."""

    def __init__(self, loaded, max_seq: int, user_file=None):
        from importlib.metadata import version

        ver = version("litert-lm-api")
        self.loaded, self.max_seq, self.user_file = loaded, int(max_seq), user_file
        if user_file is not None and not Path(user_file).is_file():
            raise TraceToolError(f"--litertlm {user_file}: no such file")
        self.start(f"litert-lm (LiteRT-LM {ver})", ENGINE)
        note = "a user's file" if user_file is not None else "exported from REF's checkpoint by litert-torch"
        self.name = f"litert-lm (LiteRT-LM {ver}, CPU, greedy, text in and out: tokens only; {note})"
        self.ready = False
        self.context: list[int] = []

    def _load(self) -> None:
        loaded, max_seq = self.loaded, self.max_seq
        try:
            if self.user_file is not None:
                path = Path(self.user_file)
                meta = self.child.call("load", str(path), max_seq, phase="loading")[1]
            else:
                S = max_seq + ROOM + (max_seq + ROOM) % 2  # room past the replay's last position; even
                art = E.exported(loaded, S, S)
                try:
                    path = art.path / E.BUNDLE
                    meta = self.child.call("load", str(path), S, phase="loading")[1]
                finally:
                    art.close()
        except BaseException:
            self.close()
            raise
        bos, want = meta.get("bos"), getattr(loaded.text_config, "bos_token_id", None)
        if bos is not None and want is not None and int(bos) != int(want):
            raise TraceToolError(f"{path}: its BOS token is {bos}; REF's model's is {want}")
        self.ready = True

    def prepare(self, input_ids=None, extra_inputs=None) -> None:
        """Export (or take from the artifact cache) the bundle, or check the user's, and load it."""
        if not self.ready:
            self._load()

    def _next(self, phase: str) -> TokenOnly:
        reply = self.child.call("next", list(self.context), phase=phase)
        if len(reply) > 2:  # the token showed no text (engine.py): said, as the trace holds an id
            print(f"note: {phase}: LiteRT-LM's token {reply[1]}: {reply[2]}", file=sys.stderr, flush=True)
        return TokenOnly(reply[1])

    def prefill(self, input_ids, extra_inputs, probe):
        self.prepare()
        self.context = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        return self._next(self.phase(True))

    def decode(self, token_id, position, probe):
        self.context = self.context[:position] + [int(token_id)]
        return self._next(self.phase(False))


def create(loaded, max_seq: int, choice=None):
    return LiteRTLM(loaded, max_seq)


def run_bundle(loaded, max_seq: int, path, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --litertlm FILE`: LiteRT-LM on the user's bundle (litert/spec.py); the engine
    checks the bundle's BOS token against REF's model when it loads it."""
    return LiteRTLM(loaded, max_seq, path)
