"""llama.cpp's mtmd on audio, in the child: the audio tower (gemma4a) run from an mmproj GGUF, its
nodes read through the tower's eval callback, and its soft tokens handed to the text model like an
image's (mtmd.py's decode_embd). Commands (engine.py's engine):

    ("audio", mmproj_path, n_layers, kinds) -> ("ready", n_embd, sample_rate)
    ("encode_audio", samples, features) -> ("audio.*", layer, array)..., ("embd", array, non_causal, mel)

`encode_audio` hands mtmd the clip as float32 samples (mtmd_bitmap_init_from_audio); mtmd computes
its own log-mel features and runs the tower. `features` (frames, mel bins), when given, replace
mtmd's: the graph's first node is the features transposed into (frames, bins) order (a copy of
the `inp_raw` input), and the callback writes them over it once it is computed, before anything
reads it (the binding has no call that takes features: mtmd_bitmap_init_from_audio takes samples,
and a saved chunk (mtmd_input_chunk_save / _load) is a placeholder without its features). `mel`:
that node as mtmd computed it (its own features), or None when features were given.

The gemma4a graph names no node of its own (only clip.cpp's generic `norm_w-L`, `ffn_*-L`, each
several times a layer), so each site is found by its position relative to a weight it reads: the
capture map's audio rows (llamacpp/spec.py) give the weight's name and, in `via`, the chain of
ops from the node down to it (`ADD[1] SCALE[0] MUL[1]`: an ADD whose operand 1 is a SCALE whose
operand 0 is the MUL by the weight). A clipped linear's output CLAMP is looked through on the way down to its MUL_MAT,
and a CLAMP over a matched product is that site too (read later, it replaces the product); a
clamp over anything else (the next linear's input clamp) is not looked through.
"""

from __future__ import annotations

import ctypes

import numpy as np

from gemma4_trace.replayer.child import EngineError
from gemma4_trace.traces import schema as S

from .mtmd import TEXT_OF_IMAGE, read_f32
from .spec import LLAMACPP

AUDIO_ROWS = tuple(r for r in LLAMACPP.rows if S.KIND_BY_NAME[r.kind].tower == "audio")
FEATURES = ("CONT", 0, "TRANSPOSE", 0, b"inp_raw")  # the graph's first node: inp_raw, transposed, copied
OPS = {"CLAMP", "CONT", "TRANSPOSE", *(op for r in AUDIO_ROWS for op, _ in r.ops)}


class AudioCapture:
    """The audio tower's eval callback: each asked site by its chain of ops down to a named weight,
    and the features node (read, or overwritten with the given features)."""

    def __init__(self, ggml, emit, tensor_type):
        self.ggml, self.emit, self.T = ggml, emit, tensor_type
        self.on = False
        self.features: np.ndarray | None = None  # to write over the features node
        self.mel: np.ndarray | None = None  # the features node as computed
        self.fault: str | None = None
        self.written = False  # the given features were written over the features node
        ops: dict[str, int] = {}
        for i in range(1000):  # ggml_op's values, up to the last one needed (never past GGML_OP_COUNT)
            ops.setdefault(ggml.ggml_op_name(i).decode(errors="replace"), i)
            if OPS <= ops.keys():
                break
        self.op = ops
        self.chains: list[tuple[tuple, object]] = []
        ggml.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        ggml.ggml_backend_tensor_set.restype = None
        self.c_callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(self._cb)

    def ask_for(self, kinds) -> None:
        self.chains = [
            (tuple((self.op[o], i) for o, i in r.ops), r)
            for r in AUDIO_ROWS
            if r.ops and (kinds is None or r.kind in kinds)
        ]

    def _down(self, t, op: int, src: int):
        """The operand `src` of `t` when `t` is `op` (CLAMPs looked through), else None."""
        if t.op == self.op["CLAMP"] and op == self.op["MUL_MAT"] and t.src[0]:  # a clipped linear's output
            t = self.T.from_address(t.src[0])
        if t.op != op or not t.src[src]:
            return None
        return self.T.from_address(t.src[src])

    def target(self, t):
        """(kind, layer) of the node, or "features", or None."""
        leaf = self._walk(t, ((self.op["CONT"], 0), (self.op["TRANSPOSE"], 0)))
        if leaf is not None and leaf.name == FEATURES[-1]:
            return "features"
        for chain, row in self.chains:
            leaf = self._walk(t, chain)
            if leaf is not None:
                name = leaf.name.decode(errors="replace")
                if S.layered(row.kind):
                    layer = row.layer_of(name)
                    if layer is not None:
                        return row.kind, layer
                elif row.matches(name):
                    return row.kind, None
        return None

    def _walk(self, t, chain):
        for op, src in chain:
            t = self._down(t, op, src)
            if t is None:
                return None
        return t

    def _cb(self, ptr, ask, _user):
        try:
            if not self.on:
                return not ask
            t = self.T.from_address(ptr)
            target = self.target(t)
            if ask:
                return target is not None
            if target == "features":
                self._features(t, ptr)
            elif target is not None:
                arr = read_f32(self.ggml, t, ptr)
                if arr is not None:
                    self.emit(*target, arr)
            return True
        except Exception as e:  # noqa: BLE001 - never let a Python error unwind into C
            self.fault = f"{type(e).__name__}: {e}"
            return True

    def _features(self, t, ptr) -> None:
        arr = read_f32(self.ggml, t, ptr)
        if arr is None:
            self.fault = "the features node is not a contiguous float32 tensor"
            return
        arr = arr.reshape(-1, arr.shape[-1])
        if self.features is None:
            self.mel = arr.copy()
            return
        if self.features.shape != arr.shape:
            got, want = "x".join(map(str, arr.shape)), "x".join(map(str, self.features.shape))
            self.fault = f"mtmd's features are {got} (frames x bins), the trace's {want}"
            return
        data = np.ascontiguousarray(self.features, dtype=np.float32)
        self.ggml.ggml_backend_tensor_set(ptr, data.ctypes.data, 0, data.nbytes)
        self.written = True


class AudioMtmd:
    """The engine's audio commands (a mix-in of engine.py's LlamaCppEngine, beside mtmd.py's MtmdEngine)."""

    acap = None

    def audio(self, path: str, n_layers: int, kinds):
        import llama_cpp.mtmd_cpp as M

        self.M = M
        self.acap = AudioCapture(self.cap.ggml, self.cap.emit, self.ggml_tensor)
        self.acap.ask_for(None if kinds is None else frozenset(kinds))
        p = M.mtmd_context_params_default()
        p.use_gpu = False
        p.print_timings = False
        p.warmup = False
        p.n_threads = self.threads
        p.cb_eval = ctypes.cast(self.acap.c_callback, type(p.cb_eval))
        p.cb_eval_user_data = None
        M.mtmd_log_set(ctypes.cast(self._log, self.L.llama_log_callback), None)
        self.said.clear()
        self.mtmd = M.mtmd_init_from_file(path.encode(), self.model, p)
        if not self.mtmd:
            why = self.said[0] if self.said else "mtmd_init_from_file failed"
            raise EngineError(f"llama.cpp's mtmd could not load the mmproj file ({why})")
        if not M.mtmd_support_audio(self.mtmd):
            raise EngineError("the mmproj file has no audio encoder: an audio prompt cannot be encoded")
        self.n_embd = int(self.L.llama_model_n_embd_inp(self.model))
        return ("ready", self.n_embd, int(M.mtmd_get_audio_sample_rate(self.mtmd)))

    def encode_audio(self, samples, features):
        M, cap = self.M, self.acap
        if cap is None:
            raise EngineError("no audio mmproj loaded: the clip cannot be encoded")
        wave = np.ascontiguousarray(samples, dtype=np.float32)
        bitmap = M.mtmd_bitmap_init_from_audio(len(wave), wave.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        chunks = M.mtmd_input_chunks_init()
        try:
            marker = TEXT_OF_IMAGE
            text = M.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
            if M.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
                raise EngineError("mtmd_tokenize failed on the clip")
            found = [
                M.mtmd_input_chunks_get(chunks, i)
                for i in range(M.mtmd_input_chunks_size(chunks))
                if M.mtmd_input_chunk_get_type(M.mtmd_input_chunks_get(chunks, i)) == M.MTMD_INPUT_CHUNK_TYPE_AUDIO
            ]
            if len(found) != 1:
                raise EngineError(f"mtmd made {len(found)} audio chunks of one clip (it cuts clips at 30 s)")
            chunk = found[0]
            n = int(M.mtmd_input_chunk_get_n_tokens(chunk))
            cap.features = None if features is None else np.asarray(features, dtype=np.float32)
            cap.mel, cap.fault, cap.written = None, None, False
            cap.on = True
            rc = M.mtmd_encode_chunk(self.mtmd, chunk)
            cap.on = False
            if rc != 0:
                raise EngineError(f"mtmd_encode_chunk returned {rc}")
            if cap.fault is not None:
                raise EngineError(f"the audio features could not be handed to the tower: {cap.fault}")
            if cap.features is not None and not cap.written:
                raise EngineError("the audio graph's features node (inp_raw, transposed) was not found")
            embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(self.mtmd), shape=(n * self.n_embd,))
            non_causal = bool(M.mtmd_decode_use_non_causal(self.mtmd, chunk))
            return ("embd", embd.reshape(n, self.n_embd).copy(), non_causal, cap.mel)
        finally:
            cap.on = False
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)
