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

from pathlib import Path

import torch

from gemma4_trace.traces.errors import TraceToolError

from ...api import TokenOnly
from ...child import ChildRuntime
from ...ops import resolve_prefill_chunk
from . import export as E

ENGINE = "gemma4_trace.replayer.runtimes.litert.engine:LiteRTLMEngine"


class LiteRTLM(ChildRuntime):
    """The bundle is exported (or taken from the artifact cache) when the driver prepares it, after
    it has set `prefill_chunk` (the export's prefill length; LiteRT-LM's results do not depend
    on it, so replays of one REF share the litert runtime's export)."""

    supports_prefill_chunk = True

    def __init__(self, loaded, max_seq: int, user_file=None):
        from importlib.metadata import version

        ver = version("litert-lm-api")
        self.loaded, self.max_seq, self.user_file = loaded, int(max_seq), user_file
        if user_file is not None and not Path(user_file).is_file():
            raise TraceToolError(f"--litertlm {user_file}: no such file")
        self.start(f"litert-lm (LiteRT-LM {ver})", ENGINE)
        note = "a user's file" if user_file is not None else "exported from REF's checkpoint by litert-torch"
        self.name = f"litert-lm (LiteRT-LM {ver}, CPU, greedy, text in and out: tokens only; {note})"
        self.prefill_chunk, self.ready = resolve_prefill_chunk(None, max_seq), False
        self.context: list[int] = []

    def _load(self) -> None:
        loaded, max_seq = self.loaded, self.max_seq
        try:
            if self.user_file is not None:
                path = Path(self.user_file)
                meta = self.child.call("load", str(path), max_seq, phase="loading")[1]
            else:
                art = E.exported(loaded, max_seq, self.prefill_chunk or max_seq)
                try:
                    path = art.path / E.BUNDLE
                    meta = self.child.call("load", str(path), max_seq, phase="loading")[1]
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
        return TokenOnly(self.child.call("next", list(self.context), phase=phase)[1])

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
