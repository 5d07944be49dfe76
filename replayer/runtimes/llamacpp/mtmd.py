"""llama.cpp's multimodal library (mtmd) in the child: the vision tower run from an mmproj GGUF,
its named graph nodes read through the tower's own eval callback, and the soft tokens decoded by
the text model as an embeddings batch. Commands (the child protocol's, engine.py's engine):

    ("vision", mmproj_path, n_layers, kinds, min_tokens, max_tokens) -> ("ready", n_embd)
    ("encode", rgb_bytes, width, height) -> ("vision.*", layer, array)..., ("embd", array, non_causal)
    ("decode_embd", embd, first, non_causal) -> ("tensors", ...)..., ("logits", array)

`encode` hands mtmd one image as 8-bit RGB; mtmd sizes it to its token budget (min_tokens and
max_tokens: mtmd's image_min_tokens / image_max_tokens, 0 for its own default) and runs the
tower; the nodes are read by the names mtmd's gemma4v graph gives them (llamacpp/spec.py's
capture map: the rows of the vision tower).
"""

from __future__ import annotations

import ctypes

import numpy as np

from gemma4_trace.replayer.child import EngineError
from gemma4_trace.traces import schema as S

from .spec import LLAMACPP

GGML_TYPE_F32 = 0
VISION_ROWS = tuple(r for r in LLAMACPP.rows if S.KIND_BY_NAME[r.kind].tower == "vision")
# a kind also read from a later node where the graph has it: the standardized pooled tokens
LATER = {"vision.pooled": "std_scaled"}
TEXT_OF_IMAGE = b"<__media__>"  # mtmd's default media marker: a prompt of the image alone


def read_f32(ggml, t, ptr) -> np.ndarray | None:
    """A contiguous F32 graph node's values in numpy order (ne3, ne2, ne1, ne0); None for another
    type or layout."""
    ne = [int(x) for x in t.ne]
    contiguous = t.nb[0] == 4 and all(t.nb[i] == t.nb[i - 1] * ne[i - 1] for i in range(1, 4))
    if t.type != GGML_TYPE_F32 or not contiguous:
        return None
    arr = np.empty(ne[::-1], dtype=np.float32)
    ggml.ggml_backend_tensor_get(ptr, arr.ctypes.data, 0, arr.nbytes)
    return arr


class VisionCapture:
    """The tower's eval callback: the named nodes of the asked kinds, read as they are computed."""

    def __init__(self, ggml, emit, tensor_type):
        self.ggml, self.emit, self.tensor_type = ggml, emit, tensor_type
        self.on = False
        self.named: dict[bytes, tuple[str, int | None]] = {}
        self.c_callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(self._cb)

    def ask_for(self, kinds, n_layers: int) -> None:
        self.named = {}
        for row in VISION_ROWS:
            if kinds is None or row.kind in kinds:
                for site in S.sites_of(row.kind, n_layers):
                    self.named[row.name(site.layer).encode()] = (row.kind, site.layer)
                if row.kind in LATER:
                    self.named[LATER[row.kind].encode()] = (row.kind, None)

    def _cb(self, ptr, ask, _user):
        try:
            if not self.on:
                return not ask
            t = self.tensor_type.from_address(ptr)
            target = self.named.get(t.name)
            if ask:
                return target is not None
            arr = None if target is None else read_f32(self.ggml, t, ptr)
            if arr is not None:
                self.emit(*target, arr)  # (batch, patches, heads, head_dim) / (batch, patches, hidden)
            return True
        except Exception:  # noqa: BLE001 - never let a Python error unwind into C
            return True


class MtmdEngine:
    """The engine's mtmd commands (a mix-in of engine.py's LlamaCppEngine: self.L, self.model,
    self.cap, self.ggml_tensor, self.threads, self._log, self.said, self.run_batch)."""

    mtmd = None

    def vision(self, path: str, n_layers: int, kinds, min_tokens: int, max_tokens: int):
        import llama_cpp.mtmd_cpp as M

        self.M = M
        self.vcap = VisionCapture(self.cap.ggml, self.cap.emit, self.ggml_tensor)
        self.vcap.ask_for(None if kinds is None else frozenset(kinds), int(n_layers))
        p = M.mtmd_context_params_default()
        p.use_gpu = False
        p.print_timings = False
        p.warmup = False
        p.n_threads = self.threads
        p.image_min_tokens = int(min_tokens) or -1
        p.image_max_tokens = int(max_tokens) or -1
        p.cb_eval = ctypes.cast(self.vcap.c_callback, type(p.cb_eval))
        p.cb_eval_user_data = None
        M.mtmd_log_set(ctypes.cast(self._log, self.L.llama_log_callback), None)  # its error lines: self.said
        self.said.clear()
        self.mtmd = M.mtmd_init_from_file(path.encode(), self.model, p)
        if not self.mtmd:
            why = self.said[0] if self.said else "mtmd_init_from_file failed"
            raise EngineError(f"llama.cpp's mtmd could not load the mmproj file ({why})")
        if not M.mtmd_support_vision(self.mtmd):
            raise EngineError("the mmproj file has no vision encoder")
        self.n_embd = int(self.L.llama_model_n_embd_inp(self.model))
        return ("ready", self.n_embd)

    def encode(self, rgb: bytes, width: int, height: int):
        M = self.M
        if self.mtmd is None:
            raise EngineError("no mmproj loaded: the image cannot be encoded")
        data = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
        bitmap = M.mtmd_bitmap_init(int(width), int(height), data)
        chunks = M.mtmd_input_chunks_init()
        try:
            marker = TEXT_OF_IMAGE
            text = M.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
            if M.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
                raise EngineError("mtmd_tokenize failed on the image")
            found = [
                M.mtmd_input_chunks_get(chunks, i)
                for i in range(M.mtmd_input_chunks_size(chunks))
                if M.mtmd_input_chunk_get_type(M.mtmd_input_chunks_get(chunks, i)) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE
            ]
            if len(found) != 1:
                raise EngineError(f"mtmd made {len(found)} image chunks of one image")
            chunk = found[0]
            n = int(M.mtmd_input_chunk_get_n_tokens(chunk))
            self.vcap.on = True
            rc = M.mtmd_encode_chunk(self.mtmd, chunk)
            self.vcap.on = False
            if rc != 0:
                raise EngineError(f"mtmd_encode_chunk returned {rc}")
            embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(self.mtmd), shape=(n * self.n_embd,))
            non_causal = bool(M.mtmd_decode_use_non_causal(self.mtmd, chunk))
            return ("embd", embd.reshape(n, self.n_embd).copy(), non_causal)
        finally:
            self.vcap.on = False
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    def decode_embd(self, embd, first: int, non_causal: bool):
        """Decode the soft tokens `embd` (tokens, n_embd) at positions first.. as mtmd's helper does:
        one batch, the text model's attention non-causal over it when mtmd says so."""
        embd = np.ascontiguousarray(embd, dtype=np.float32)

        def rows(batch):
            ctypes.memmove(batch.embd, embd.ctypes.data, embd.nbytes)

        return self.run_batch(int(embd.shape[0]), first, rows, self.n_embd, non_causal)

    def close_mtmd(self) -> None:
        if self.mtmd:
            self.M.mtmd_free(self.mtmd)
        self.mtmd = None
