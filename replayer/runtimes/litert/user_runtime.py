"""The `litert` runtime's engine on the user's own litert-torch export (`--tflite PATH`,
user_files.py): the same steps, taps and kinds as runtime.py's LiteRTRuntime, on the files read and
checked by user_files.read_files instead of the tool's own export.

The export's prefill length and cache length are the files' own: the prefill signature is
prefill_P for --prefill-chunk P where the files have it, else prefill_{max_seq}, else the longest
they have; its rows must fit the cache (max_seq rounded up to whole chunks). An image or audio
prompt's towers are the tool's own export of REF's checkpoint (vision.py, audio.py), as with
`--runtime litert`. The provenance names the files and their sha256, never their path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, one_line

from . import export as E
from . import user_files as U
from .runtime import LiteRTRuntime
from .spec import LITERT


class Staged:
    """The folder the engine loads the user's files from, held (and then removed) as an artifact is."""

    def __init__(self, path: Path, remove: bool):
        self.path, self.remove, self.note = path, remove, "the user's files"

    def close(self) -> None:
        if self.remove:
            shutil.rmtree(self.path, ignore_errors=True)


class UserFilesRuntime(LiteRTRuntime):
    def __init__(self, loaded, max_seq: int, files: U.UserFiles, notes: list[str], capture=None):
        self.user, self.config_notes = files, notes
        try:
            super().__init__(loaded, max_seq, U.NAME, capture)
        except BaseException:
            files.discard()
            raise

    @property
    def prefill_chunk(self) -> int | None:
        return None if self.P == self.max_seq else self.P

    @prefill_chunk.setter
    def prefill_chunk(self, rows: int | None) -> None:
        """The files' own prefill length (module docstring); their cache length."""
        have, S = self.user.prefill, self.user.cache
        P = rows if rows in have else (self.max_seq if self.max_seq in have else max(have))
        if self.graph is not None and P != self.P:
            raise TraceToolError("the LiteRT files are loaded; set prefill_chunk before the replay starts")
        if E.cache_length(self.max_seq, P) > S:
            raise TraceToolError(
                f"{U.OPTION}: prefill chunks of {P} rows up to max_seq {self.max_seq} write "
                f"{E.cache_length(self.max_seq, P)} cache rows; its K/V caches hold {S}"
            )
        # a chunk the files have no signature for (--prefill-chunk, or its default at max_seq >= 1024): theirs
        self.chunk_note = f"; --prefill-chunk {rows}: no prefill_{rows} signature" if rows and rows != P else ""
        self.P, self.S = P, S

    def _files(self, arts: list) -> dict:
        folder = U.staged(self.user)
        arts.append(Staged(folder, not self.user.bundle))
        return {role: str(folder / U.ROLES[role]) for role in self.user.sigs}

    def _taps(self, graph: dict) -> dict:
        out = super()._taps(graph)
        found = {t.kind for taps in out.values() for t in taps}
        kinds = [r.kind for r in LITERT.rows if "." not in r.kind and r.kind not in ("embeddings", "k", "v", "logits")]
        self.unmapped = [k for k in dict.fromkeys(kinds) if self.captures(k) and k not in found]
        return out

    def _describe(self) -> str:
        vers, f = self.vers, self.user
        more = "".join(f"; config differs from REF: {d}" for d in self.config_notes)
        if self.unmapped:
            more += f"; not in its graphs: {', '.join(self.unmapped)}"
        return (
            f"{U.NAME} {one_line(f.path.name, 100)} (litert-torch's export, ai-edge-litert {vers['ai-edge-litert']}, "
            f"XNNPACK CPU; prefill {self.P}, cache {self.S}{self.chunk_note}{self._notes()}; "
            f"files: {f.files_text()}{more})"
        )

    def close(self) -> None:
        super().close()
        self.user.discard()


def run_files(loaded, max_seq: int, header: U.UserFiles, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --tflite PATH`: the litert runtime's engine on the user's export, per layer."""
    try:
        notes = U.check_config(header, loaded, max_seq, allow_config_mismatch)
    except BaseException:
        header.discard()
        raise
    return UserFilesRuntime(loaded, max_seq, header, notes, None if choice is None else choice.capture)
