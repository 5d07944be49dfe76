"""`trace replay REF --ir PATH [--ir-map MAP]`: the user's own OpenVINO IR compiled for the CPU plugin
(the `openvino` row's engine, openvino_engine.py, f32 inference precision), its tensors named by a
map in `--onnx-map`'s format (onnx_map.py) and resolved as onnx_user.py resolves one, against REF.

PATH (read and checked by openvino_file.py before any model loads) is the tool's own IR (a folder of
prefill.xml and decode.xml, `trace export-openvino`: the built-in map `export`, steps driven as
`--runtime openvino` drives them) or one .xml in the KV-cache layout (steps driven as `--runtime
mobius` drives mobius's graph; the built-in map `mobius` where its op names are mobius-onnx's, as in
mobius's graph converted by `openvino.convert_model`, else `--ir-map FILE`).

How a map addresses an IR: `value` is a tensor name (any of an op output's names: `convert_model`
keeps an ONNX graph's value names, the tool's IR names its outputs `<kind>`, `L07.<kind>`); `node` an
op's friendly name (an ONNX node's name survives conversion on the last op it becomes), `op` the
OpenVINO op type (`MatMul`, `Multiply`: not ONNX's), `input`/`output` the op's port, `pick` and
`fed_by` in the order of `Model.get_ordered_ops()` (the order `save_model` writes the ops);
`[inputs]`/`[outputs]` the Parameters' and Results' tensor names.

Once the model loads, the map is resolved against the graph (onnx_user.resolve: every kind at every
layer where REF's config has it; a name the graph lacks, or two sites on one tensor, is one line),
the graph checked against the layout and REF's checkpoint (layers that write K/V, their KV heads and
head_dim, vocabulary, hidden size, more layers than REF's: one line naming the field unless
--allow-config-mismatch). What runs is a copy in the artifact cache (`ir-file/`), keyed by the files'
sha256, the map's digest and the sites: the model as OpenVINO read it, each mapped value made an
output (`Model.add_outputs`, named `L07.q`; the step graphs' outputs the map does not name removed;
the KV-cache layout's inputs and outputs renamed to mobius's where the map names them otherwise),
written by `openvino.save_model`. The user's files are never written. The provenance names the map,
the kinds it found and those it does not name, and the files by basename and sha256.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.layers import layer_infos_from_config

from .. import functional as F
from ..artifacts import artifact_folder, code_digest
from ..functional import StepGraphRuntime
from . import onnx_map as M
from . import onnx_user as OU
from . import openvino_file as U
from .mobius import MobiusRuntime
from .openvino import CONFIG, tower_ir
from .openvino_engine import ENGINE as OPENVINO_ENGINE

NAME = "ir-file"  # what the provenance calls a replay of the user's IR
MAP_OPTION = "--ir-map"
FORMAT = 1  # bump when the copy's form changes (the cache key holds it)
TAPS = "taps.json"  # the KV-cache copy: output name -> [kind, layer]
MODEL = "model.xml"
TAP = "gemma4-trace."  # the KV-cache copy's mapped outputs: gemma4-trace.L03.q
CACHE = re.compile(r"L(\d{2})\.(k|v)_cache")

# mobius-onnx's Gemma 4 converted by openvino.convert_model: its node names are the ops' friendly names,
# but ONNX's fused ops are decomposed (Attention, RotaryEmbedding and RMSNormalization keep their
# name on the last op they become), so q and k are the RoPE outputs after q_proj and k_proj (their
# order among the ops differs from layer to layer), v the normalized values. final_hidden is the LM
# head's input: the final norm's last op is a Multiply by its weight, which the conversion removes
# when that weight is all ones (a freshly initialised checkpoint's), its name going with it
MOBIUS = """\
# mobius-onnx's Gemma 4 text decoder converted to IR by openvino.convert_model (its op names)
format = 1
layout = "kv-cache"
[kinds]
embeddings = { node = "model/embed_tokens/Mul_node_*", output = 0 }
per_layer_inputs = { node = "model/Mul_node_*", fed_by = "model/Add_node_*", output = 0 }
q = { node = "model/layers.{layer}/self_attn/RotaryEmbedding_node_*", after = "model/layers.{layer}/self_attn/q_proj/*", output = 0 }
k = { node = "model/layers.{layer}/self_attn/RotaryEmbedding_node_*", after = "model/layers.{layer}/self_attn/k_proj/*", output = 0 }
v = { node = "model/layers.{layer}/self_attn/Reshape_node_*", fed_by = "model/layers.{layer}/self_attn/Div_node_*", output = 0 }
attn_out = { node = "model/layers.{layer}/self_attn/o_proj/*", op = "MatMul", output = 0 }
layer_out = { node = "model/layers.{layer}/*", pick = "last", output = 0 }
final_hidden = { node = "lm_head/MatMul_node_*", input = 0 }
"""  # noqa: E501
MAPS = {"export": M.EXPORT, "mobius": MOBIUS}


def read_map(path) -> M.NameMap:
    """`--ir-map FILE` (or a built-in's name: export, mobius) read within bounds and checked (onnx_map.py)."""
    return M.read_map(path, MAP_OPTION, MAPS)


@dataclass(frozen=True)
class Op:
    """An IR op as onnx_user.Index reads a node: its friendly name, type and the ids of its ports' values."""

    name: str
    op_type: str
    input: list
    output: list


class IRIndex(OU.Index):
    """One IR's names for onnx_user.resolve: its ops in order, each value (an op's output) by an id (its
    first tensor name, else `op:port`), every tensor name of it, the Parameters' and Results' names and
    shapes."""

    def __init__(self, model):
        self.port_of, self.canon, self.nodes, ids = {}, {}, [], {}
        for op in model.get_ordered_ops():
            ins = [ids[(i.get_source_output().get_node().get_name(), i.get_source_output().get_index())]
                   for i in op.inputs()]  # fmt: skip
            outs = []
            for o in op.outputs() if op.get_type_name() != "Result" else ():
                names = sorted(o.get_names())
                pid = names[0] if names else f"{op.get_friendly_name()}:{o.get_index()}"
                pid = pid if pid not in self.port_of else f"{pid}:{op.get_name()}"
                self.port_of[pid], ids[(op.get_name(), o.get_index())] = o, pid
                self.canon.update({n: pid for n in names})
                outs.append(pid)
            self.nodes.append(Op(op.get_friendly_name(), op.get_type_name(), ins, outs))
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.values = set(self.canon)
        self.inputs = [n for p in model.inputs for n in sorted(p.get_names())]
        self.outputs = [n for p in model.outputs for n in sorted(p.get_names())]
        self.shapes = {n: _dims(p) for p in (*model.inputs, *model.outputs) for n in p.get_names()}

    def find(self, entry: M.Entry, layer: int | None, where: str) -> str | None:
        if entry.value is not None:
            return self.canon.get(M.fill(entry.value, layer=layer))
        return super().find(entry, layer, where)

    def shape(self, pid) -> list | None:
        return _dims(self.port_of[pid]) if pid in self.port_of else None


def at(layer) -> str:
    return "" if layer is None else f" layer {layer}"


def _dims(port) -> list | None:
    shape = port.get_partial_shape()
    if shape.rank.is_dynamic:
        return None
    return [d.get_length() if d.is_static else None for d in shape]


# ------------------------------------------------------------------ the layouts against REF
def step_layout(user: U.UserIR, indexes: dict) -> tuple[list[int], dict]:
    """The tool's step graphs: (the layers whose caches they take, their shapes by name), both graphs
    taking functional.py's inputs and the same caches and returning logits and the caches."""
    found = {}
    for g, first in (("prefill", F.PREFILL_INPUTS), ("decode", F.DECODE_INPUTS)):
        idx = indexes[g]
        head, caches = idx.inputs[: len(first)], idx.inputs[len(first) :]
        if tuple(head) != first or not all(CACHE.fullmatch(c) for c in caches):
            user.fail(f"{g}.xml takes {', '.join(idx.inputs[:8])}: not the tool's step graphs "
                      f"({', '.join(first)}, then L00.k_cache, ...)")  # fmt: skip
        missing = [o for o in ("logits", *(f"{c}_out" for c in caches)) if o not in idx.outputs]
        if missing:
            user.fail(f"{g}.xml has no output {missing[0]!r} (the tool's step graphs)")
        found[g] = (caches, idx.shapes)
    if found["prefill"][0] != found["decode"][0]:
        user.fail("prefill.xml and decode.xml take different caches")
    caches, shapes = found["prefill"]
    return sorted({int(CACHE.fullmatch(c).group(1)) for c in caches}), shapes


def differences(user: U.UserIR, nmap, indexes: dict, loaded, max_seq: int, sites: dict, more: bool) -> list[str]:
    """Where the IR's shapes differ from REF's checkpoint config (its text config)."""
    cfg = loaded.text_config
    infos = layer_infos_from_config(cfg)
    owners = [i for i, info in enumerate(infos) if info.kv_role != "reuses"]
    if user.steps:
        layers, shapes = step_layout(user, indexes)
        S = (shapes.get("ids") or [None, None])[1]
        if S != max_seq:
            user.fail(f"its graphs are converted for max_seq {S}; replay with --max-seq {S}")
        pairs = [("layers that write K/V", layers, owners)]
        heads = [(i, shapes.get(f"L{i:02}.k_cache")) for i in layers if i in owners]
        vocab, hidden = shapes.get("logits"), shapes.get("mm_embeds")
    else:
        index = indexes["model"]
        caches = OU.kv_layout(index, nmap, user)
        pairs = [("caches (layers that write K/V)", len(caches), len(owners))]
        heads = [(i, c[4]) for i, c in zip(owners, caches)]
        vocab, hidden = index.shapes.get(nmap.outputs["logits"]), index.shape(sites.get(("embeddings", None)))
    for i, shape in heads:
        pairs += [(f"KV heads of layer {i}", shape[1], infos[i].num_kv_heads)]
        pairs += [(f"head_dim of layer {i}", shape[3], infos[i].head_dim)]
    pairs += [("vocabulary", (vocab or [None])[-1], int(cfg.vocab_size))]
    pairs += [("hidden size", (hidden or [None])[-1], int(cfg.hidden_size))]
    if more:
        pairs.append(("layers", f"more than {len(infos)}", len(infos)))
    return [f"{what} {mine} (REF {ref})" for what, mine, ref in pairs if mine is not None and mine != ref]


# ------------------------------------------------------------------ the copy that runs
def layout_names(index: IRIndex, steps: bool) -> set:
    """The names the driver feeds and reads: every input, and the logits and cache outputs."""
    outs = [n for n in index.outputs if n == "logits" or n.endswith("_cache_out")] if steps else index.outputs
    return {*index.inputs, *outs}


def promote(model, index: IRIndex, sites: dict, steps: bool, rename: dict) -> dict:
    """The mapped values made outputs of `model` (changed in place; openvino's Model.add_outputs), each
    named `L07.q` (the KV-cache layout: `gemma4-trace.L07.q`); {output name: [kind, layer]}. Step
    graphs: the outputs the map does not name removed; the KV-cache layout: the layout's names renamed
    to mobius's (`rename`)."""
    fixed, taps = layout_names(index, steps), {}
    for (kind, layer), pid in sites.items():
        out = ("" if steps else TAP) + F.output_name(kind, layer)
        port = index.port_of[pid]
        names = set(port.get_names())
        if names & fixed:
            raise TraceToolError(f"{MAP_OPTION}: the map names {one_line(pid, 80)!r} as {kind}{at(layer)}"
                                 ", a tensor the layout feeds or reads")  # fmt: skip
        if out not in names and out in index.canon:
            raise TraceToolError(f"{MAP_OPTION}: the map names {one_line(pid, 80)!r} as {kind}{at(layer)}, "
                                 f"but the graph's own {out!r} is another tensor")  # fmt: skip
        model.add_outputs([port])[0].get_tensor().set_names({out})  # the Result's names (an output already: its own)
        taps[out] = [kind, layer]
    for p in (*model.get_parameters(), *model.get_results()):
        names = set(p.output(0).get_names())
        if names & set(rename):
            p.output(0).get_tensor().set_names({rename[sorted(names & set(rename))[0]]})
    if steps:
        for r in model.get_results():
            names = r.output(0).get_names()
            if not names & {"logits", *taps} and not any(n.endswith("_cache_out") for n in names):
                model.remove_result(r)
    return taps


def _build(folder, user: U.UserIR, indexes: dict, sites: dict, rename: dict) -> None:
    import openvino as ov

    for name in user.stamps:
        U.unchanged(user, name)  # OpenVINO maps the .bin: the copy is written from the file as it was hashed
    for graph, model in user.models.items():
        taps = promote(model, indexes[graph], sites[graph], user.steps, rename)
        ov.save_model(model, str(folder / (f"{graph}.xml" if user.steps else MODEL)), compress_to_fp16=False)
        if not user.steps:
            (folder / TAPS).write_text(json.dumps(taps, indent=1, sort_keys=True))
    for name in user.stamps:
        U.unchanged(user, name)


def copied(user: U.UserIR, nmap: M.NameMap, indexes: dict, sites: dict, rename: dict):
    """The artifact holding the copy that runs (keyed by the files' sha256, the map and the sites)."""
    from importlib.metadata import version

    key = OU.copy_key(user, nmap, sites, rename, FORMAT, openvino=version("openvino"))
    key["code"] = code_digest("runtimes/openvino_user.py", "runtimes/openvino_file.py", "runtimes/onnx_map.py")
    return artifact_folder(
        "ir-file",
        key,
        lambda folder: _build(folder, user, indexes, sites, rename),
        what=f"copying {user.shown()} with the map's tensors as outputs",
    )


# ------------------------------------------------------------------ the runtimes
def _label() -> str:
    from importlib.metadata import version

    return f"OpenVINO {version('openvino')}"


class UserStepIR(StepGraphRuntime):
    """The user's step graphs (the tool's own IR) run as `--runtime openvino` runs its own; an image or
    audio prompt's towers: the tool's own tower IR of REF's checkpoint."""

    def __init__(self, loaded, max_seq: int, user, nmap, indexes, sites: dict, diffs: list[str]):
        label = _label()
        self.name = OU.describe(label, user, nmap, sites, diffs, name=NAME)
        self.vision_artifact = lambda shape: tower_ir(loaded, "vision", shape)
        self.audio_artifact = lambda shape: tower_ir(loaded, "audio", shape)
        art = lambda: copied(user, nmap, indexes, sites, {})  # noqa: E731
        self.load_graphs(f"{NAME} ({label})", OPENVINO_ENGINE, loaded, max_seq, art, ".xml", CONFIG)


class UserKVIR(MobiusRuntime):
    """The user's KV-cache IR, its steps driven as mobius.py drives mobius's graph (prefill with empty
    caches, each decode step fed the present caches back)."""

    def __init__(self, loaded, max_seq: int, user, nmap, indexes, sites: dict, diffs: list[str], caches, rename):
        label = _label()
        self.name = OU.describe(label, user, nmap, sites, diffs, name=NAME)
        art = copied(user, nmap, indexes, sites, rename)
        child = self.start(f"{NAME} ({label})", OPENVINO_ENGINE)
        try:
            taps = json.loads((art.path / TAPS).read_text())
            self.outputs = child.call("load", {"model": str(art.path / MODEL)}, CONFIG, phase="loading")[1]["model"][1]
        except BaseException:
            self.close()
            raise
        finally:
            art.close()
        self.taps = {n: (k, layer) for n, (k, layer) in taps.items()}
        # the past caches' shapes as mobius.py reads them (name -> (batch, kv heads, past, head_dim))
        self.inputs = {
            M.fill(M.INPUTS[k], cache=i): c[4] for i, c in enumerate(caches) for k in ("past_key", "past_value")
        }
        self.infos = layer_infos_from_config(loaded.text_config)
        self.past = {}


# ------------------------------------------------------------------ the hand-over (openvino_spec.py)
def _map(user: U.UserIR, choice) -> M.NameMap:
    given = choice.file("ir_map") if choice is not None else None
    if given is not None:
        nmap = given[0]
    elif user.steps:
        nmap = M.built_in("export", MAP_OPTION, MAPS)
    elif user.mobius_like():
        nmap = M.built_in("mobius", MAP_OPTION, MAPS)
    else:
        user.fail("no built-in map fits this IR (its op names are not mobius-onnx's): name its tensors with "
                  "--ir-map FILE (docs/runtime-openvino.md, \"Your own file\")")  # fmt: skip
    if (nmap.layout == M.STEPS) != user.steps:
        what = "a folder of step graphs" if user.steps else "one graph"
        user.fail(f"is {what}; the map {nmap.name} is for the {nmap.layout} layout")
    return nmap


def _rename_of(user: U.UserIR, nmap: M.NameMap, index: IRIndex, caches: list) -> dict:
    """{the IR's name: mobius.py's} for the KV-cache layout's names the map gives otherwise."""
    out = {nmap.inputs[k]: M.INPUTS[k] for k in ("input_ids", "attention_mask", "position_ids")}
    out[nmap.outputs["logits"]] = M.OUTPUTS["logits"]
    for i, c in enumerate(caches):
        for j, k in enumerate(("past_key", "past_value", "present_key", "present_value")):
            out[c[j]] = M.fill({**M.INPUTS, **M.OUTPUTS}[k], cache=i)
    out = {a: b for a, b in out.items() if a != b}
    clash = [b for b in out.values() if b in index.canon and b not in out]
    if clash:
        user.fail(f"its tensor {one_line(clash[0], 80)!r} is not the layout's, yet has the name the runner "
                  "feeds: rename it or map the layout to it")  # fmt: skip
    return out


def run_file(loaded, max_seq: int, header: U.UserIR, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --ir PATH [--ir-map MAP]`: the user's IR under its map (module docstring)."""
    from .registry import captures

    nmap = _map(header, choice)
    indexes = {g: IRIndex(m) for g, m in header.models.items()}
    diffs = differences(header, nmap, indexes, loaded, max_seq, {}, False)  # the layout and caches, before names
    OU.check_config(header, diffs, allow_config_mismatch)
    infos = layer_infos_from_config(loaded.text_config)
    capture = None if choice is None else choice.capture
    sites, more, emb = {}, False, None
    for graph in header.models:
        found, beyond = OU.resolve(indexes[graph], nmap, infos, header.file_name(graph))
        sites[graph] = {s: n for s, n in found.items() if captures(capture, s[0])}
        more, emb = more or beyond, found.get(("embeddings", None))
    diffs = differences(header, nmap, indexes, loaded, max_seq, {("embeddings", None): emb}, more)
    OU.check_config(header, diffs, allow_config_mismatch)
    if header.steps:
        return UserStepIR(loaded, max_seq, header, nmap, indexes, sites, diffs)
    caches = OU.kv_layout(indexes["model"], nmap, header)
    rename = _rename_of(header, nmap, indexes["model"], caches)
    return UserKVIR(loaded, max_seq, header, nmap, indexes, sites, diffs, caches, rename)
