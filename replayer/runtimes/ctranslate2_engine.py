"""CTranslate2 in the child process (replayer/child.py's protocol), for --runtime ctranslate2
(replayer/runtimes/ctranslate2.py): a converted model loaded by its Generator on the CPU, in float32."""

from __future__ import annotations

ENGINE = f"{__name__}:CT2Engine"


class CT2Engine:
    """("load", folder) -> ("ready", {}); ("forward", [token ids]) -> ("logits", the last row of
    Generator.forward_batch over those ids, float32 (vocab,))."""

    def __init__(self, emit):
        import ctranslate2

        self.ct2, self.generator = ctranslate2, None

    def handle(self, command: str, *args):
        import numpy as np

        if command == "load":
            (folder,) = args
            self.generator = self.ct2.Generator(folder, device="cpu", compute_type="float32")
            return ("ready", {})
        (ids,) = args
        logits = self.generator.forward_batch([list(ids)])  # a StorageView (1, n, vocab) on the CPU
        return ("logits", np.array(logits, dtype=np.float32)[0, -1].copy())
