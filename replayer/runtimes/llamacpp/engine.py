"""llama.cpp's engine in the child process (replayer/child.py) for `--runtime llama.cpp`
(replayer/runtimes/llamacpp/runtime.py). Commands (the child protocol's):

    ("quantize", src, dst, ftype)      -> ("done",)
    ("load", gguf_path, n_ctx, kinds) -> ("ready", description, n_vocab); kinds: the kinds to read
                                        (None: every kind; empty: no eval callback at all)
    ("decode", ids, first_position)    -> ("tensors", [(kind, layer, array), ...])..., ("logits", array)

A failure llama.cpp reports (a file it cannot load, a decode error) is an exception: the child
answers ("error", line). Tensors are captured through the scheduler's eval callback (`cb_eval`)
and streamed as each is computed (the child's emit: sent in batches, the last one reported kept
in its progress file, so the parent always knows where a crash came).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from gemma4_trace.replayer.child import EngineError
from gemma4_trace.replayer.runtimes.llamacpp.mtmd import MtmdEngine, read_f32
from gemma4_trace.replayer.runtimes.llamacpp.mtmd_audio import AudioMtmd
from gemma4_trace.replayer.runtimes.llamacpp.spec import LLAMACPP
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.schema import sites_of

# the nodes read, by name (set by the gemma4 graph's `cb(tensor, name, layer)`): the capture map's
# rows read from a node of their own (runtimes/captures.py)
NAMED = tuple(  # the text tower's
    r for r in LLAMACPP.rows if not r.ops and r.kind != "logits" and S.KIND_BY_NAME[r.kind].tower == S.TEXT
)
# attn_out (o_proj's output) has no name of its own in the graph: it is the matrix product whose
# operand 0 is the layer's attention output weight (its row: "blk.{layer}.attn_output.weight" via MUL_MAT[0])
ATTN_OUT = LLAMACPP.row("attn_out")
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
# the attention masks are graph inputs (leaves: never handed to the callback themselves), read as
# the mask operand of each layer's attention node (FLASH_ATTN_EXT, or SOFT_MAX with flash attention
# off); the layer is in the name of that node's first operand (its q, or the K.Q product): the
# mask's row says all three (its name, the ops with the mask's operand index, layer_from)
MASK = LLAMACPP.row("mask")
MASK_OPS = dict(MASK.ops)  # op -> the mask's operand index
GGML_LOG_LEVEL_ERROR = 4
LOAD_ERROR = "error loading model: "  # llama_model_load's prefix to the reason a file does not load
# llama.cpp's flash attention (auto: on for this CPU backend) computes attention with FP16 steps:
# "off" takes the plain softmax path, to tell its share of the difference from the FP16 GELU table's
FLASH_ATTN_ENV = "GEMMA4_TRACE_LLAMACPP_FLASH_ATTN"
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
UBATCH_ENV = "GEMMA4_TRACE_LLAMACPP_UBATCH"  # llama.cpp's n_ubatch (default 512, its own default)


def ubatch() -> int:
    """llama.cpp's n_ubatch from UBATCH_ENV: a whole number from 1 to 65536 (a test knob; 0 or junk
    would reach llama.cpp unchecked)."""
    text = os.environ.get(UBATCH_ENV, "512").strip()
    if not (text.isdigit() and 1 <= int(text) <= 65536):
        raise EngineError(f"{UBATCH_ENV}={text[:40]!r}: expected a whole number from 1 to 65536")
    return int(text)


class _Tensor(ctypes.Structure):
    """The head of ggml's `struct ggml_tensor` (ggml.h), up to its name."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


NAME_OFFSET, OP_OFFSET = _Tensor.name.offset, _Tensor.op.offset


def _ggml_lib(llama_cpp):
    """libggml-base, where ggml_backend_tensor_get and ggml_op_name live (shipped beside libllama)."""
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in sorted(os.listdir(lib_dir)):
        if name.startswith("libggml-base"):
            lib = ctypes.CDLL(os.path.join(lib_dir, name))
            lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
            lib.ggml_backend_tensor_get.restype = None
            lib.ggml_op_name.argtypes = [ctypes.c_int]
            lib.ggml_op_name.restype = ctypes.c_char_p
            return lib
    raise RuntimeError(f"libggml-base not found in {lib_dir}")


class Capture:
    """The eval callback: which nodes to read (ask) and reading them (not ask)."""

    def __init__(self, ggml, emit):
        self.ggml, self.emit = ggml, emit
        self.on = False
        ops: dict[str, int] = {}  # ggml_op's values, scanned up to the last one needed (never past GGML_OP_COUNT)
        (product, self.weight), *_ = ATTN_OUT.ops  # the product and the weight's operand index
        for i in range(1000):
            ops.setdefault(ggml.ggml_op_name(i).decode(errors="replace"), i)
            if {product, *MASK_OPS} <= ops.keys():
                break
        self.mul_mat = ops[product]
        self.mask_ops = {ops[name]: src for name, src in MASK_OPS.items()}
        self.n_ctx = 0  # the trace's max_seq: a mask row's width
        self.first = 0  # the position of the decode's first token
        self.mask_rows: dict[int, int] = {}  # layer -> mask rows read in this decode (ubatches in order)
        self.kinds: frozenset | None = None  # the kinds asked for (None: every kind)
        self.every: dict[str, tuple] = {}  # node name -> (kind, layer) of every kind found by name
        self.named: dict[bytes, tuple] = {}  # node name -> (kind, layer) of the asked kinds found by name
        self.by_op: frozenset = frozenset()  # the ops whose operands say whether an asked kind is there
        self.c_callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(self._cb)

    def ask_for(self, kinds, n_layer: int) -> None:
        """Ask for `kinds` (None: every kind) of a model of `n_layer` layers. The scheduler asks the
        callback about every node of every graph, so the answer must be cheap: the kinds found by
        name are looked up by the node's name alone; only the products (attn_out) and attention
        nodes (mask) need their operands read, and only when those kinds are asked."""
        self.kinds = None if kinds is None else frozenset(kinds)
        names = {}
        for row in NAMED:
            for site in sites_of(row.kind, n_layer):
                names[row.name(site.layer).encode()] = (site.kind, site.layer)
        self.every = {n.decode(): t for n, t in names.items()}
        self.named = {n: t for n, t in names.items() if self.kinds is None or t[0] in self.kinds}
        ops = {ATTN_OUT.kind: {self.mul_mat}, MASK.kind: set(self.mask_ops)}
        self.by_op = frozenset(o for k, s in ops.items() if self.kinds is None or k in self.kinds for o in s)

    def ask(self, ptr) -> bool:
        """Is the node at `ptr` one to read (the scheduler then computes up to it and calls back)?"""
        if ctypes.string_at(ptr + NAME_OFFSET) in self.named:
            return True
        if ctypes.c_int.from_address(ptr + OP_OFFSET).value not in self.by_op:
            return False
        return self._asked(_Tensor.from_address(ptr)) is not None

    def _asked(self, t: _Tensor):
        """The node's (kind, layer) when it is one of the asked kinds, else None."""
        target = self._target(t)
        return target if target is not None and (self.kinds is None or target[0] in self.kinds) else None

    def _target(self, t: _Tensor):
        name = t.name.decode(errors="replace")
        if name in self.every:
            return self.every[name]
        if t.op == self.mul_mat and t.src[self.weight]:
            layer = ATTN_OUT.layer_of(_Tensor.from_address(t.src[self.weight]).name.decode(errors="replace"))
            if layer is not None:
                return ATTN_OUT.kind, layer
        if t.op in self.mask_ops and t.src[0] and t.src[self.mask_ops[t.op]]:
            mask = _Tensor.from_address(t.src[self.mask_ops[t.op]])
            layer = MASK.layer_of(_Tensor.from_address(t.src[0]).name.decode(errors="replace"))
            if layer is not None and MASK.matches(mask.name.decode(errors="replace")):
                return MASK.kind, layer
        return None

    def _mask(self, t: _Tensor, layer: int):
        """allowed[query, key position] (max_seq wide) from the attention node's mask operand: one
        row per token of the ubatch (ne1; padding rows dropped), one column per KV cache cell (ne0),
        0 allowed, -inf not. A fresh single-sequence cache fills its cells in position order and
        (full-size, swa_full) has a cell for every position, so cell = position; a position past
        the cells (a cache that reuses cells) gives None, and the mask is absent, not misread."""
        mask = _Tensor.from_address(t.src[self.mask_ops[t.op]])
        n_kv, n_tok = int(mask.ne[0]), int(t.src[0] and _Tensor.from_address(t.src[0]).ne[1])
        dtype = {GGML_TYPE_F16: np.float16, GGML_TYPE_F32: np.float32}.get(mask.type)
        rows = int(mask.ne[1])
        if dtype is None or int(mask.ne[2]) * int(mask.ne[3]) != 1 or not 0 < n_tok <= rows:
            return None
        if mask.nb[0] != np.dtype(dtype).itemsize or mask.nb[1] != mask.nb[0] * n_kv:
            return None
        done = self.mask_rows.get(layer, 0)
        self.mask_rows[layer] = done + n_tok
        if self.first + done + n_tok > n_kv:  # a position past the cells: they no longer map to positions
            return None
        arr = np.empty((rows, n_kv), dtype=dtype)
        self.ggml.ggml_backend_tensor_get(ctypes.addressof(mask), arr.ctypes.data, 0, arr.nbytes)
        allowed = np.zeros((n_tok, self.n_ctx), dtype=np.bool_)
        width = min(n_kv, self.n_ctx)
        allowed[:, :width] = arr[:n_tok, :width] == 0
        return allowed

    def _cb(self, ptr, ask, _user):
        try:
            if not self.on:
                return not ask  # nothing asked; compute on
            if ask:
                return self.ask(ptr)
            t = _Tensor.from_address(ptr)
            target = self._asked(t)
            if target is not None and target[0] == MASK.kind:
                allowed = self._mask(t, target[1])
                if allowed is not None:
                    self.emit(MASK.kind, target[1], allowed)
                return True
            arr = None if target is None else read_f32(self.ggml, t, ptr)
            if arr is not None:
                self.emit(*target, arr)  # numpy order (ne3, ne2, ne1, ne0): rows lead
            return True
        except Exception:  # noqa: BLE001 - never let a Python error unwind into C
            return True


class LlamaCppEngine(MtmdEngine, AudioMtmd):
    """The child's engine (replayer/child.py): llama.cpp through llama-cpp-python's C API (and its
    multimodal library for images and audio: mtmd.py, mtmd_audio.py)."""

    def __init__(self, emit):
        import llama_cpp as L

        self.L, self.said = L, []  # llama.cpp's error-level log lines: the first names why a file does not load

        def log(level, text, _user):
            if level == GGML_LOG_LEVEL_ERROR:
                self.said.append(" ".join((text or b"").decode(errors="replace").split(LOAD_ERROR)[-1].split())[:300])

        self._log = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(log)
        L.llama_log_set(self._log, None)
        L.llama_backend_init()
        self.cap = Capture(_ggml_lib(L), emit)
        self.ggml_tensor = _Tensor  # the head of a graph node, for the vision tower's callback too
        self.model = self.ctx = None
        self.n_vocab = 0
        self.threads = max(1, min(4, os.cpu_count() or 1))

    def close(self) -> None:
        """Free mtmd, the context and the model (the child's exit does it too)."""
        self.close_mtmd()
        if self.ctx:
            self.L.llama_free(self.ctx)
        if self.model:
            self.L.llama_model_free(self.model)
        self.model = self.ctx = None

    def handle(self, command: str, *args):
        return getattr(self, command)(*args)

    def quantize(self, src: str, dst: str, ftype: int):
        L = self.L
        qp = L.llama_model_quantize_default_params()
        qp.ftype = ftype
        qp.nthread = self.threads
        rc = L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(qp))
        if rc != 0:
            raise EngineError(f"llama_model_quantize returned {rc}")
        return ("done",)

    def load(self, path: str, n_ctx: int, kinds=None):
        """Load the file and make a context that reads `kinds` (None: every kind); none: no eval
        callback, llama.cpp's own fast path with tokens and logits only (what the capture costs is
        measured against it)."""
        L = self.L
        self.cap.n_ctx = n_ctx
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False  # the AMX repacked buffers crash on quantized Gemma 4 (ggml_backend_amx_mul_mat)
        self.said.clear()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            why = self.said[0] if self.said else "llama_model_load_from_file failed"
            raise EngineError(f"llama.cpp could not load the GGUF file ({why})")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        # a prompt longer than a ubatch runs as several graphs; the parent stitches their rows in order
        cp.n_ubatch = min(n_ctx, ubatch())
        cp.n_seq_max = 1
        cp.flash_attn_type = FLASH_ATTN.get(os.environ.get(FLASH_ATTN_ENV, "auto"), -1)
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.type_k = cp.type_v = GGML_TYPE_F32  # the cache keeps what the layers computed
        cp.swa_full = True  # (its default) a full-size sliding cache: cell i holds position i, a mask column
        self.cap.ask_for(kinds, L.llama_model_n_layer(self.model))
        if kinds is None or kinds:
            cp.cb_eval = ctypes.cast(self.cap.c_callback, type(cp.cb_eval))
            cp.cb_eval_user_data = None
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise EngineError("llama.cpp could not create a context (llama_init_from_model failed)")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        desc = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, desc, 256)
        return ("ready", desc.value.decode(errors="replace"), self.n_vocab)

    def decode(self, ids: list, first: int):
        def tokens(batch):
            for j, tok in enumerate(ids):
                batch.token[j] = tok

        return self.run_batch(len(ids), first, tokens)

    def run_batch(self, n: int, first: int, fill, n_embd: int = 0, non_causal: bool = False):
        """One llama_decode of n rows at positions first.. (`fill(batch)` puts their tokens or, with
        n_embd, their embeddings in), the eval callback on; the last row's logits. `non_causal`: the
        text model attends both ways over the batch (mtmd's choice for an image)."""
        L, cap = self.L, self.cap
        batch = L.llama_batch_init(n, n_embd, 1)
        try:
            fill(batch)
            for j in range(n):
                batch.pos[j] = first + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = j == n - 1
            batch.n_tokens = n
            cap.first, cap.mask_rows = first, {}
            if non_causal:
                L.llama_set_causal_attn(self.ctx, False)
            cap.on = True
            try:
                rc = L.llama_decode(self.ctx, batch)
            finally:
                cap.on = False
                if non_causal:
                    L.llama_set_causal_attn(self.ctx, True)
        finally:
            L.llama_batch_free(batch)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()
        return ("logits", logits)
