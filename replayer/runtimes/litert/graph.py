"""What a LiteRT .tflite graph computes, read from the file with LiteRT's own flatbuffer schema
(`ai_edge_litert.schema_py_generated`), and which of its tensors are the canonical kinds.

litert-torch keeps the torch module path in each tensor's name (`.../Gemma4TextDecoderLayer_3/
.../Gemma4TextAttention_self_attn/...Linear_o_proj;2`, parts of fused ops joined by ';'), so a
tensor's layer and module are read from its name, and its place in the data flow from the
operators. For each signature (prefill_N, decode) the taps are (the names and operators are
LiteRT's capture map's, runtimes/captures.py: LITERT):

    q             the RoPE sum (an ADD output of shape (1, n, heads, head_dim)) in layer i's
                  attention that writes no cache (k's RoPE sum writes the cache)
    attn_out      o_proj's last output (1, n, hidden)
    layer_out     the last output of layer i's own scope (1, n, hidden) (its scalar included)
    per_layer_inputs  the last (1, n, layers, ple) tensor of the language model's own scope
    final_hidden  the final norm's output (1, n, hidden) (decode only: the prefill graph ends at the caches)
    mask          the operand added to layer i's attention scores before the SOFTMAX (additive)
    rope tables   COS / SIN outputs of the rotary embedding, (1, n, head_dim); the layer type is
                  that of the layers whose ops consume the table
    k, v          not taps: the rows the step wrote into the cache outputs (`kv_cache_k_j`, `_v_j`)

The vision encoder's signature (vision_SOFT of vision_encoder.tflite, one image of the processor's
patch budget) holds the tower's sites the same way (vision_taps; the capture map's vision rows):

    vision.patch_embeddings  the patch embedder scope's last (1, n, hidden)
    vision.q, vision.k       the first (1, n, heads, head_dim) CONCATENATION after layer i's q_norm
                             (k_norm): its 2D RoPE's two halves joined
    vision.v                 v_norm's output
    vision.attn_out          o_proj's last (1, n, hidden)
    vision.mlp_out           the MLP scope's last (1, n, hidden) (down_proj's output)
    vision.layer_out         the last output of encoder layer i's own scope (1, n, hidden)
    vision.pooled, .soft_tokens  not taps: the encoder's `features` output and the adapter's output

A graph whose names do not give every layer's layer_out is refused in one line (another
litert-torch release names its modules otherwise). Nothing here runs the graph.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.schema import rope_kinds

from .spec import LITERT

# the capture map's rows (runtimes/captures.py: LITERT) this module reads the graph by
IN_LAYER, TOP = LITERT.row("q"), LITERT.row("layer_out")  # a tensor of layer i's scope, and the scope itself
O_PROJ, MASK, PLE, NORM = (LITERT.row(k) for k in ("attn_out", "mask", "per_layer_inputs", "final_hidden"))
VISION_ROWS = {k: LITERT.row(f"vision.{k}") for k in ("q", "k", "v", "attn_out", "mlp_out", "layer_out")}
PATCHES = LITERT.row("vision.patch_embeddings")
ROPE_ROWS = tuple(r for r in LITERT.rows if r.kind.startswith("rope_"))
K_CACHE = LITERT.row("k").prefix()  # the cache inputs and outputs: kv_cache_k_<j>, kv_cache_v_<j>


@dataclass
class Tensor:
    index: int
    name: str
    shape: tuple

    def parts(self) -> list[str]:
        """The module path of each op fused into this tensor (the name's ';'-separated parts)."""
        return [p.strip() for p in self.name.split(";")]

    def layer(self) -> int | None:
        first = self.parts()[0]
        layer = IN_LAYER.layer_of(first)
        return TOP.layer_of(first) if layer is None else layer

    def scope(self) -> str:
        """The innermost module of the tensor's first part ("Gemma4RMSNorm_v_norm", "Linear_o_proj")."""
        return self.parts()[0].rsplit("/", 1)[-1].rsplit(".", 1)[-1]


@dataclass
class Signature:
    """One signature's subgraph: tensors, operators in order, and named inputs and outputs."""

    key: str
    subgraph: int
    tensors: list[Tensor]
    ops: list[tuple[str, list[int], list[int]]]  # (opcode name, inputs, outputs) in execution order
    inputs: dict = field(default_factory=dict)  # name -> tensor index
    outputs: dict = field(default_factory=dict)
    producer: dict = field(default_factory=dict)  # tensor index -> op position
    consumers: dict = field(default_factory=dict)  # tensor index -> [op positions]

    def op_of(self, t: int) -> str | None:
        k = self.producer.get(t)
        return None if k is None else self.ops[k][0]

    def fed_ops(self, t: int) -> list[str]:
        return [self.ops[k][0] for k in self.consumers.get(t, [])]


MAX_ENTRIES = 1 << 20  # tensors and operators over every signature read (E2B's export: about 10^4 a signature)
MAX_SIGNATURES = 64  # litert-torch writes one per prefill length and one decode


class _Budget:
    """Bytes a parse may read: the file's vectors, counted as they are read. A well-formed file's
    vectors do not overlap, so they add up to less than the file; a hostile one can point every
    entry at one long vector, and is refused before the parse turns quadratic. And entries: the
    tensors and operators made into Python objects, counted before any is made."""

    def __init__(self, size: int):
        self.left = 4 * size + (1 << 20)
        self.entries = MAX_ENTRIES

    def take(self, count: int, width: int = 4) -> int:
        self.left -= max(int(count), 0) * width
        if self.left < 0:
            raise ValueError("its vectors add up to more than the file")
        return int(count)

    def entries_of(self, count: int, what: str) -> int:
        self.entries -= max(int(count), 0)
        if self.entries < 0:
            raise ValueError(f"more than {MAX_ENTRIES} tensors and operators ({what})")
        return self.take(count)


def read(path, file=None) -> dict[str, Signature]:
    """Every signature of a .tflite file (`file`: the file already opened, and checked, by the caller)."""
    from ai_edge_litert import schema_py_generated as fb

    with open(path, "rb") if file is None else contextlib.nullcontext(file) as f:
        size = os.fstat(f.fileno()).st_size
        # mapped, not read: only the flatbuffer's tables are touched, not the weights (a 2 GiB model
        # read whole would be 2 GiB of this process's memory)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        return _read(path, buf, fb)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


def _read(path, buf, fb) -> dict[str, Signature]:
    budget = _Budget(len(buf))
    try:
        if len(buf) < 8 or not fb.Model.ModelBufferHasIdentifier(buf, 0):
            raise ValueError("no TFL3 identifier")
        model = fb.Model.GetRootAsModel(buf, 0)
        opnames = {v: k for k, v in vars(fb.BuiltinOperator).items() if not k.startswith("_")}
        codes = []
        for i in range(budget.take(model.OperatorCodesLength())):
            c = model.OperatorCodes(i)
            codes.append(opnames.get(max(c.BuiltinCode(), c.DeprecatedBuiltinCode()), "CUSTOM"))
        out = {}
        if model.SignatureDefsLength() > MAX_SIGNATURES:
            raise ValueError(f"{model.SignatureDefsLength()} signatures, more than {MAX_SIGNATURES}")
        for s in range(budget.take(model.SignatureDefsLength())):
            sd = model.SignatureDefs(s)
            sg = model.Subgraphs(sd.SubgraphIndex())
            tensors = []
            for i in range(budget.entries_of(sg.TensorsLength(), "tensors")):
                t = sg.Tensors(i)
                name = t.Name() or b""
                budget.take(len(name), 1)
                shape = tuple(int(d) for d in t.ShapeAsNumpy()) if budget.take(t.ShapeLength()) else ()
                tensors.append(Tensor(i, name.decode(errors="replace"), shape))
            ops = []
            for k in range(budget.entries_of(sg.OperatorsLength(), "operators")):
                op = sg.Operators(k)
                ins = [int(i) for i in op.InputsAsNumpy()] if budget.take(op.InputsLength()) else []
                outs = [int(i) for i in op.OutputsAsNumpy()] if budget.take(op.OutputsLength()) else []
                if not all(-1 <= i < len(tensors) for i in ins + outs) or op.OpcodeIndex() >= len(codes):
                    raise ValueError(f"operator {k} names a tensor or an opcode that does not exist")
                ops.append((codes[op.OpcodeIndex()], ins, outs))
            sig = Signature(sd.SignatureKey().decode(errors="replace"), sd.SubgraphIndex(), tensors, ops)
            n_in, n_out = budget.take(sd.InputsLength()), budget.take(sd.OutputsLength())
            sig.inputs = {sd.Inputs(i).Name().decode(errors="replace"): sd.Inputs(i).TensorIndex() for i in range(n_in)}
            sig.outputs = {
                sd.Outputs(i).Name().decode(errors="replace"): sd.Outputs(i).TensorIndex() for i in range(n_out)
            }
            if not all(0 <= t < len(tensors) for t in [*sig.inputs.values(), *sig.outputs.values()]):
                raise ValueError(f"signature {sig.key} names a tensor that does not exist")
            for k, (_, ins, outs) in enumerate(ops):
                for t in outs:
                    sig.producer[t] = k
                for t in ins:
                    if t >= 0:
                        sig.consumers.setdefault(t, []).append(k)
            out[sig.key] = sig
    except Exception as e:  # noqa: BLE001 - a file that is no .tflite fails in flatbuffers' own ways
        why = str(e) if isinstance(e, ValueError) and str(e) else type(e).__name__
        raise TraceToolError(f"{path}: not a LiteRT model ({why[:120]})") from None
    return out


@dataclass(frozen=True)
class Tap:
    index: int  # the tensor, in the signature's subgraph
    kind: str
    layer: int | None


def taps(sig: Signature, infos, hidden: int, ple: tuple | None) -> list[Tap]:
    """The canonical kinds' tensors of one signature (module docstring). `infos`: the model's
    LayerInfo list (traces/layers.py); `ple`: (layers, per-layer width) or None."""
    heads = {i: (x.num_heads, x.num_kv_heads, x.head_dim) for i, x in enumerate(infos)}
    produced = sorted(sig.producer, key=lambda t: sig.producer[t])  # tensors in the order they are computed
    by_layer: dict[int, list[Tensor]] = {}
    own: list[Tensor] = []  # the language model's own scope (outside the layers)
    for t in produced:
        x = sig.tensors[t]
        layer = x.layer()
        if layer is not None and 0 <= layer < len(infos):
            by_layer.setdefault(layer, []).append(x)
        elif PLE.matches(x.scope()):
            own.append(x)
    out = []
    for i, xs in sorted(by_layer.items()):
        out += _layer_taps(sig, i, xs, hidden, heads[i])
    if ple is not None:
        cands = [x for x in own if len(x.shape) == 4 and x.shape[0] == 1 and x.shape[2:] == ple]
        if cands:
            out.append(Tap(cands[-1].index, "per_layer_inputs", None))
    norms = [x for x in produced if NORM.matches(sig.tensors[x].scope())]
    norms = [x for x in norms if len(sig.tensors[x].shape) == 3 and sig.tensors[x].shape[-1] == hidden]
    if norms:
        out.append(Tap(norms[-1], "final_hidden", None))
    return out + _rope_taps(sig, produced, infos)


def _layer_taps(sig: Signature, i: int, xs: list[Tensor], hidden: int, dims: tuple) -> list[Tap]:
    H, _, D = dims
    out = []
    rope_sums = [x for x in xs if len(x.shape) == 4 and x.shape[2:] == (H, D) and _is_rope_sum(sig, x.index)]
    q = [x for x in rope_sums if "DYNAMIC_UPDATE_SLICE" not in _reach(sig, x.index, 2)]
    if q:
        out.append(Tap(q[-1].index, "q", i))
    o = [x for x in xs if O_PROJ.matches(x.parts()[0]) and x.shape[-1] == hidden and len(x.shape) == 3]
    if o:
        out.append(Tap(o[-1].index, "attn_out", i))
    top = [x for x in xs if TOP.matches(x.parts()[0]) and x.shape[-1] == hidden]
    if top:
        out.append(Tap(top[-1].index, "layer_out", i))
    m = _mask_operand(sig, xs)
    if m is not None:
        out.append(Tap(m.index, "mask", i))
    return out


def _is_rope_sum(sig: Signature, t: int) -> bool:
    """t = x * cos + rotate_half(x) * sin: an ADD of two MUL outputs."""
    k = sig.producer.get(t)
    if k is None or sig.ops[k][0] != IN_LAYER.ops[0][0]:
        return False
    return all(sig.op_of(i) == "MUL" for i in sig.ops[k][1])


def _mask_operand(sig: Signature, xs: list[Tensor]) -> Tensor | None:
    """The mask added to layer i's attention scores: the ADD feeding the SOFTMAX, its operand that
    is not the scores' BATCH_MATMUL."""
    for x in xs:
        if sig.op_of(x.index) == MASK.ops[0][0] and "SOFTMAX" in sig.fed_ops(x.index):
            operands = [i for i in sig.ops[sig.producer[x.index]][1] if sig.op_of(i) != "BATCH_MATMUL"]
            if len(operands) == 1:
                return sig.tensors[operands[0]]
    return None


def _downstream(sig: Signature, t: int, hops: int, stop=lambda o: False):
    """(op position, its output tensors) of each op within `hops` operators downstream of tensor t,
    each op and tensor visited once (a hostile graph that lists a tensor many times, or reaches
    one tensor by many paths, costs its size, not its number of paths); a tensor for which
    stop(tensor) holds is not walked past."""
    ops, visited, frontier = set(), {t}, [t]
    for _ in range(hops):
        nxt = []
        for x in frontier:
            for k in set(sig.consumers.get(x, ())) - ops:
                ops.add(k)
                outs = sig.ops[k][2]
                yield k, outs
                for o in outs:
                    if o not in visited and not stop(o):
                        visited.add(o)
                        nxt.append(o)
        frontier = nxt


def _reach(sig: Signature, t: int, hops: int) -> set[str]:
    """The op names within `hops` operators downstream of tensor t."""
    return {sig.ops[k][0] for k, _ in _downstream(sig, t, hops)}


def _rope_taps(sig: Signature, produced: list[int], infos) -> list[Tap]:
    """COS and SIN outputs of the rotary embedding; each table's layer type is that of the layers
    its values reach (within a few ops); a table no layer reads, or that layers of both types
    read, is left out."""
    out, seen = [], set()
    for t in produced:
        op, name = sig.op_of(t), sig.tensors[t].name
        rows = [r for r in ROPE_ROWS if r.ops[0][0] == op and r.matches(name)]
        if not rows:
            continue
        types = {infos[i].layer_type for i in _reached_layers(sig, t, 4) if 0 <= i < len(infos)}
        if len(types) != 1:
            continue
        kinds = rope_kinds(types.pop())
        kind = next(r.kind for r in rows if r.kind in kinds)
        if kind not in seen:
            seen.add(kind)
            out.append(Tap(t, kind, None))
    return out


def _reached_layers(sig: Signature, t: int, hops: int) -> set[int]:
    """The layers of the tensors within `hops` operators downstream of tensor t (the walk stops at
    a tensor that belongs to a layer)."""
    in_layer = lambda o: sig.tensors[o].layer() is not None  # noqa: E731
    found = (o for _, outs in _downstream(sig, t, hops, in_layer) for o in outs)
    return {layer for layer in (sig.tensors[o].layer() for o in found) if layer is not None}


def cache_layers(sig: Signature, infos) -> dict[int, int]:
    """kv_cache_k_j -> the layer j-th of the layers that write a cache (their order in the model)."""
    owners = [i for i, info in enumerate(infos) if info.kv_role != "reuses"]
    names = [k[len(K_CACHE) :] for k in sig.inputs if k.startswith(K_CACHE)]
    if len(names) != len(owners):
        raise TraceToolError(
            f"the LiteRT graph has {len(names)} K/V caches; the model has {len(owners)} layers that write K/V"
        )
    if sorted(names) != sorted(str(j) for j in range(len(owners))):
        raise TraceToolError(f"the LiteRT graph's K/V caches are not numbered 0 to {len(owners) - 1}")
    return {j: owners[j] for j in range(len(owners))}


def layers_present(taps_: list[Tap]) -> set[int]:
    return {t.layer for t in taps_ if t.kind == "layer_out"}


def rows(x: np.ndarray) -> np.ndarray:
    """A tapped tensor (1, n, ...) as its rows (n, ...)."""
    return np.ascontiguousarray(x[0])


def vision_taps(sig: Signature, layers: int, hidden: int, dims: tuple) -> list[Tap]:
    """The vision tower's sites in the encoder's signature (module docstring), in the order the
    static port reports them; `dims` (heads, kv heads, head_dim) of the tower. A graph that does not
    give every encoder layer's output is refused in one line."""
    H, KV, D = dims
    found: dict = {}  # (kind key, layer) -> tensor index; a later tensor replaces an earlier one
    for t in sorted(sig.producer, key=lambda t: sig.producer[t]):
        x = sig.tensors[t]
        first, shape = x.parts()[0], x.shape
        wide = len(shape) == 3 and shape[0] == 1 and shape[-1] == hidden
        if PATCHES.matches(first) and wide:
            found[("vision.patch_embeddings", None)] = t
            continue
        for kind, row in VISION_ROWS.items():
            layer = row.layer_of(first)
            if layer is None or not 0 <= layer < layers:
                continue
            if kind in ("q", "k") and shape == (1, shape[1], H if kind == "q" else KV, D):
                found.setdefault((f"vision.{kind}", layer), _rope_concat(sig, t, shape))
            elif kind == "v" and shape[2:] == (KV, D):
                found[("vision.v", layer)] = t
            elif kind in ("attn_out", "mlp_out", "layer_out") and wide:
                found[(f"vision.{kind}", layer)] = t
            break
    have = {layer for (k, layer) in found if k == "vision.layer_out"}
    if have != set(range(layers)):
        raise TraceToolError(
            f"the LiteRT vision encoder names layer outputs {sorted(have)}; REF's vision tower has {layers} layers "
            "(another litert-torch release names its tensors otherwise)"
        )
    order = ["vision.patch_embeddings"] + [f"vision.{k}" for k in VISION_ROWS]
    return [
        Tap(found[(k, i)], k, i)
        for k, i in sorted(
            ((k, i) for (k, i), t in found.items() if t is not None),
            key=lambda ki: (ki[1] is not None, ki[1] or 0, order.index(ki[0])),
        )
    ]


def _rope_concat(sig: Signature, t: int, shape: tuple) -> int | None:
    """The 2D RoPE's result after a q_norm / k_norm output t: the first CONCATENATION of t's shape
    downstream (the halves rotated by x and y joined), not walking past the attention's transposes."""
    stop = lambda o: sig.op_of(o) in ("TRANSPOSE", "BATCH_MATMUL")  # noqa: E731
    for k, outs in _downstream(sig, t, 12, stop):
        if sig.ops[k][0] == "CONCATENATION" and any(sig.tensors[o].shape == shape for o in outs):
            return next(o for o in outs if sig.tensors[o].shape == shape)
    return None
