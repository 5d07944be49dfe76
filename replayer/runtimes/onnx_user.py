"""`trace replay REF --onnx PATH [--onnx-map MAP]`: the user's own ONNX graph run by onnxruntime (the
`onnx` row's engine, onnx_engine.py), its tensors named by a map (onnx_map.py), against REF.

PATH (read and checked by onnx_file.py before any model loads) is the tool's own step graphs (a
folder of prefill.onnx and decode.onnx: the built-in map `export`, steps driven as `--runtime
onnx` drives them, functional.py's StepGraphRuntime) or one graph in the KV-cache layout
(mobius-onnx, onnxruntime-genai, optimum: steps driven as `--runtime mobius` drives them, mobius.py's
MobiusRuntime; the built-in map `mobius` where its node names are mobius's, else `--onnx-map FILE`).

Once the model loads, the map is resolved against the graph (`resolve`: every kind it names at
every layer where REF's config has it, k and v at the layers that write K/V; a name that is not in
the graph, or two sites on one tensor, is one line), the graph's inputs are checked against the
layout and its shapes against REF's checkpoint (`differences`: layers that write K/V, their KV
heads and head_dim, vocabulary, hidden size, and more layers than REF's; refused in one line naming
the field unless --allow-config-mismatch). What runs is a copy in the artifact cache, keyed by the
files' sha256, the map's digest and the sites: the mapped values made graph outputs (the KV-cache
layout's inputs and outputs renamed to mobius's where the map names them otherwise), the user's
external-data files copied beside it after checking they are unchanged. The user's files are never
written. The provenance names the map, the kinds it found and those it does not name, and the
files by basename and sha256.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.layers import layer_infos_from_config

from .. import functional as F
from ..artifacts import artifact_folder, code_digest
from ..functional import StepGraphRuntime
from . import onnx_file as U
from . import onnx_map as M
from .mobius import MobiusRuntime
from .onnx_engine import ENGINE as ORT_ENGINE
from .onnx_engine import SESSION as ORT_SESSION

NAME = "onnx-file"  # what the provenance calls a replay of the user's graph
FORMAT = 1  # bump when the copy's form changes (the cache key holds it)
TAPS = "taps.json"  # the KV-cache copy: output name -> [kind, layer]
MODEL = "model.onnx"
RESERVED = (MODEL, TAPS, "manifest.json", *(f"{g}.onnx" for g in U.STEPS))
STANDARD = {**M.INPUTS, **M.OUTPUTS}  # the KV-cache layout's names as mobius.py's driver feeds and reads them
CACHE = re.compile(r"L(\d{2})\.(k|v)_cache")


class Index:
    """One graph's names: its nodes in order, every value, who makes each, the shapes it declares."""

    def __init__(self, graph):
        self.nodes = list(graph.node)
        self.inputs = [i.name for i in graph.input if i.name not in {t.name for t in graph.initializer}]
        self.outputs = [o.name for o in graph.output]
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.values = set(self.producer) | {i.name for i in graph.input} | {t.name for t in graph.initializer}
        self.shapes = {}
        for v in (*graph.input, *graph.output, *graph.value_info):
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
                dims = v.type.tensor_type.shape.dim
                self.shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]

    def find(self, entry: M.Entry, layer: int | None, where: str) -> str | None:
        """The value an entry names at `layer` (None: the pattern matches nothing)."""
        if entry.value is not None:
            name = M.fill(entry.value, layer=layer)
            return name if name in self.values else None
        rx = M.matcher(M.fill(entry.node, layer=layer) if layer is not None else entry.node)
        fed = (
            M.matcher(M.fill(entry.fed_by, layer=layer) if layer is not None else entry.fed_by)
            if entry.fed_by
            else None
        )

        up = M.matcher(M.fill(entry.after, layer=layer)) if entry.after else None

        def feeds(n) -> bool:
            return any(i in self.producer and fed.fullmatch(self.producer[i].name) for i in n.input)

        found = [
            n
            for n in self.nodes
            if rx.fullmatch(n.name)
            and entry.op in (None, n.op_type)
            and (fed is None or feeds(n))
            and (up is None or self.after(n, up))
        ]
        if not found:
            return None
        if entry.pick == "only" and len(found) > 1:
            raise TraceToolError(
                f"{where}: [kinds] {entry.kind}{_at(layer)}: {len(found)} nodes match {one_line(entry.node, 80)!r} "
                f"({one_line(found[0].name, 60)}, {one_line(found[1].name, 60)}, ...); narrow it or set pick"
            )
        node = found[-1] if entry.pick == "last" else found[0]
        port, i = entry.port
        names = node.input if port == "input" else node.output
        if i >= len(names) or not names[i]:
            raise TraceToolError(
                f"{where}: [kinds] {entry.kind}{_at(layer)}: node {one_line(node.name, 80)!r} has no {port} {i}"
            )
        return names[i]

    def after(self, node, rx) -> bool:
        """Whether a node named as `rx` matches is upstream of `node` (any number of steps)."""
        seen, todo = set(), list(node.input)
        while todo:
            n = self.producer.get(todo.pop())
            if n is None or id(n) in seen:
                continue
            if rx.fullmatch(n.name):
                return True
            seen.add(id(n))
            todo.extend(n.input)
        return False


def _at(layer) -> str:
    return "" if layer is None else f" layer {layer}"


def site_layers(kind: str, infos) -> list:
    """The layers where REF's config has a per-layer kind (k, v: those that write K/V); [None] for a global one."""
    if kind not in M.PER_LAYER:
        return [None]
    return [i for i, info in enumerate(infos) if kind not in ("k", "v") or info.kv_role != "reuses"]


def resolve(index: Index, nmap: M.NameMap, infos, file: str) -> tuple[dict, bool]:
    """({(kind, layer): value name} of every site the map names, whether a per-layer pattern also
    matches past REF's last layer); one line for a name the graph lacks or two sites on one tensor."""
    where = f"{nmap.option} {nmap.name}"
    sites, more = {}, False
    for entry in nmap.entries:
        for layer in site_layers(entry.kind, infos):
            name = index.find(entry, layer, where)
            if name is None:
                raise TraceToolError(f"{where}: [kinds] {entry.kind}{_at(layer)}: no {_filled(entry, layer)} in {file}")
            sites[(entry.kind, layer)] = name
        if entry.kind in M.PER_LAYER and not more:
            more = index.find(entry, len(infos), where) is not None
    seen = {}
    for (kind, layer), name in sites.items():
        if name in seen:
            (k0, l0) = seen[name]
            raise TraceToolError(
                f"{where}: maps {k0}{_at(l0)} and {kind}{_at(layer)} to one tensor {one_line(name, 80)!r}"
            )
        seen[name] = (kind, layer)
    return sites, more


def _filled(entry: M.Entry, layer) -> str:
    e = entry
    if layer is not None:
        fill = {"value": e.value and M.fill(e.value, layer=layer), "node": e.node and M.fill(e.node, layer=layer)}
        e = M.Entry(e.kind, fill["value"], fill["node"], e.op, e.port, e.pick, e.fed_by, e.after)
    return e.text()


# ------------------------------------------------------------------ the layouts against REF
def kv_layout(index: Index, nmap: M.NameMap, user) -> list[tuple]:
    """The KV-cache layout's caches [(past key, past value, present key, present value, shape)], the
    graph's inputs and outputs checked against the map's names."""
    name = user.file_name("model")
    ins, outs = nmap.inputs, nmap.outputs
    caches = []
    while M.fill(ins["past_key"], cache=len(caches)) in index.inputs:
        i = len(caches)
        pk, pv = M.fill(ins["past_key"], cache=i), M.fill(ins["past_value"], cache=i)
        qk, qv = M.fill(outs["present_key"], cache=i), M.fill(outs["present_value"], cache=i)
        caches.append((pk, pv, qk, qv, index.shapes.get(pk)))
    fed = {ins["input_ids"], ins["attention_mask"], ins["position_ids"], *(c[k] for c in caches for k in (0, 1))}
    for want in (ins["input_ids"], ins["attention_mask"], ins["position_ids"]):
        if want not in index.inputs:
            user.fail(f"{name} takes no input {one_line(want, 80)!r} (the {M.KV} layout; a map's [inputs] "
                   "names what it feeds)")  # fmt: skip
    other = [i for i in index.inputs if i not in fed]
    if other:
        user.fail(f"{name} takes input {one_line(other[0], 80)!r}, which the {M.KV} layout does not feed "
               f"({len(caches)} caches found as {one_line(ins['past_key'], 60)!r})")  # fmt: skip
    for want in (outs["logits"], *(c[k] for c in caches for k in (2, 3))):
        if want not in index.outputs:
            user.fail(f"{name} has no output {one_line(want, 80)!r} (the {M.KV} layout)")
    for pk, pv, _, _, shape in caches:
        vshape = index.shapes.get(pv)
        for n, s in ((pk, shape), (pv, vshape)):
            if s is None or len(s) != 4 or s[1] is None or s[3] is None:
                user.fail(f"{name}'s input {one_line(n, 80)!r} is {s}, not (batch, kv_heads, past, head_dim) "
                       "with static heads and head_dim")  # fmt: skip
    return caches


def step_layout(user: U.UserGraph) -> tuple[list[int], dict]:
    """The tool's step graphs: (the layers whose caches they take, their shapes by name), both graphs
    taking functional.py's inputs and the same caches and returning logits and the caches."""
    found = {}
    for g, first in (("prefill", F.PREFILL_INPUTS), ("decode", F.DECODE_INPUTS)):
        idx = Index(user.models[g].graph)
        head, caches = idx.inputs[: len(first)], idx.inputs[len(first) :]
        if tuple(head) != first or not all(CACHE.fullmatch(c) for c in caches):
            U.fail(user.path, f"{g}.onnx takes {', '.join(idx.inputs[:8])}: not the tool's step graphs "
                   f"({', '.join(first)}, then L00.k_cache, ...)")  # fmt: skip
        missing = [o for o in ("logits", *(f"{c}_out" for c in caches)) if o not in idx.outputs]
        if missing:
            U.fail(user.path, f"{g}.onnx has no output {missing[0]!r} (the tool's step graphs)")
        found[g] = (caches, idx.shapes)
    if found["prefill"][0] != found["decode"][0]:
        U.fail(user.path, "prefill.onnx and decode.onnx take different caches")
    caches, shapes = found["prefill"]
    layers = sorted({int(CACHE.fullmatch(c).group(1)) for c in caches})
    return layers, shapes


def differences(user: U.UserGraph, nmap: M.NameMap, loaded, max_seq: int, sites: dict, more: bool) -> list[str]:
    """Where the graph's shapes differ from REF's checkpoint config (its text config)."""
    cfg = loaded.text_config
    infos = layer_infos_from_config(cfg)
    owners = [i for i, info in enumerate(infos) if info.kv_role != "reuses"]
    pairs = []
    if user.steps:
        layers, shapes = step_layout(user)
        S = (shapes.get("ids") or [None, None])[1]
        if S != max_seq:
            U.fail(user.path, f"its graphs are exported for max_seq {S}; replay with --max-seq {S}")
        pairs.append(("layers that write K/V", layers, owners))
        heads = [(i, shapes.get(f"L{i:02}.k_cache")) for i in layers if i in owners]
        vocab, hidden = (shapes.get("logits") or [None])[-1:], (shapes.get("mm_embeds") or [None])[-1:]
    else:
        index = Index(user.models["model"].graph)
        caches = kv_layout(index, nmap, user)
        pairs.append(("caches (layers that write K/V)", len(caches), len(owners)))
        heads = [(i, c[4]) for i, c in zip(owners, caches)]
        vocab = (index.shapes.get(nmap.outputs["logits"]) or [None])[-1:]
        hidden = (index.shapes.get(sites.get(("embeddings", None)), None) or [None])[-1:]
    for i, shape in heads:
        pairs += [(f"KV heads of layer {i}", shape[1], infos[i].num_kv_heads)]
        pairs += [(f"head_dim of layer {i}", shape[3], infos[i].head_dim)]
    pairs += [("vocabulary", vocab[0] if vocab else None, int(cfg.vocab_size))]
    pairs += [("hidden size", hidden[0] if hidden else None, int(cfg.hidden_size))]
    if more:
        pairs.append(("layers", f"more than {len(infos)}", len(infos)))
    return [f"{what} {mine} (REF {ref})" for what, mine, ref in pairs if mine is not None and mine != ref]


def check_config(user, diffs: list[str], allow: bool) -> None:
    if diffs and not allow:
        user.fail(
            f"does not match REF's model config: {diffs[0]}"
            + (f" and {len(diffs) - 1} more" if len(diffs) > 1 else "")
            + " (--allow-config-mismatch replays it anyway)",
        )


# ------------------------------------------------------------------ the copy that runs
def _rename(graph, names: dict) -> None:
    """Values renamed everywhere in a graph and its subgraphs (the KV-cache layout's names made mobius.py's)."""
    for v in (*graph.input, *graph.output, *graph.value_info):
        v.name = names.get(v.name, v.name)
    for node in graph.node:
        node.input[:] = [names.get(i, i) for i in node.input]
        node.output[:] = [names.get(o, o) for o in node.output]
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _rename(sub, names)


def _typed(name: str, *tables):
    """A graph output for value `name`: its declared ValueInfo where the graph has one, else a bare one."""
    import onnx

    out = onnx.ValueInfoProto()
    for table in tables:
        if name in table:
            out.CopyFrom(table[name])
            break
    out.name = name
    return out


def promote(model, sites: dict, steps: bool, rename: dict) -> dict:
    """The mapped values made graph outputs of `model` (changed in place); {output name: [kind, layer]}.
    Step graphs: each value an output named as functional.py names it (`L07.q`; an Identity where the
    value has another name), the outputs the map does not name dropped; the KV-cache layout: the
    values themselves made outputs (as mobius.py's capture does), the layout's names made mobius's."""
    import onnx

    g = model.graph
    if rename:
        _rename(g, rename)
    index = Index(g)
    declared, outputs = {v.name: v for v in g.value_info}, {o.name: o for o in g.output}
    taps = {}
    if not steps:
        for (kind, layer), name in sites.items():
            name = rename.get(name, name)
            taps[name] = [kind, layer]
            if name not in outputs:
                g.output.append(_typed(name, declared))
        return taps
    for (kind, layer), name in sites.items():
        out = F.output_name(kind, layer)
        if name != out:
            if out in index.values:
                raise TraceToolError(
                    f"{M.OPTION}: the map names {one_line(name, 80)!r} as {kind}{_at(layer)}, but the graph's own "
                    f"{out!r} is another tensor"
                )
            g.node.append(onnx.helper.make_node("Identity", [name], [out], name=f"gemma4-trace/{out}"))
        taps[out] = [kind, layer]
    kept = [o for o in g.output if o.name == "logits" or o.name.endswith("_cache_out") or o.name in taps]
    new = [_typed(out, outputs, declared) for out in taps if out not in {o.name for o in kept}]
    del g.output[:]
    g.output.extend([*kept, *new])
    return taps


def _build(folder: Path, user: U.UserGraph, sites: dict, rename: dict) -> None:
    import onnx

    from gemma4_trace.traces.inputs import sha256_file

    for graph, model in user.models.items():
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        taps = promote(copy, sites[graph], user.steps, rename)
        onnx.save_model(copy, str(folder / (f"{graph}.onnx" if user.steps else MODEL)))
        if not user.steps:
            (folder / TAPS).write_text(json.dumps(taps, indent=1, sort_keys=True))
    for name in sorted({d for names in user.data.values() for d in names}):
        if name in RESERVED:
            U.fail(user.path, f"its external data is named {name}, a name the copy that runs needs; rename it")
        U.unchanged(user, name)
        shutil.copyfile(user.folder / name, folder / name)
        if sha256_file(folder / name) != user.files[name]:
            U.fail(user.path, f"its external data {one_line(name, 80)} changed since it was read")


def copy_key(user, nmap: M.NameMap, sites: dict, rename: dict, form: int, **versions) -> dict:
    """What the copy of a user's graph depends on (the ONNX and the IR copies alike): its files' sha256,
    the map, the sites it found, the layout's renames, the copy's format and the engine's versions."""
    cells = {g: sorted([k, -1 if layer is None else layer, n] for (k, layer), n in s.items()) for g, s in sites.items()}
    return {"format": form, "files": dict(user.files), "map": nmap.digest, "sites": cells, "rename": rename, **versions}


def copied(user: U.UserGraph, nmap: M.NameMap, sites: dict, rename: dict):
    """The artifact holding the copy that runs (keyed by the files' sha256, the map and the sites)."""
    from importlib.metadata import version

    key = copy_key(user, nmap, sites, rename, FORMAT, onnx=version("onnx"))
    key["code"] = code_digest("runtimes/onnx_user.py", "runtimes/onnx_file.py", "runtimes/onnx_map.py")
    return artifact_folder(
        "onnx-file",
        key,
        lambda folder: _build(folder, user, sites, rename),
        what=f"copying {user.shown()} with the map's tensors as outputs",
    )


# ------------------------------------------------------------------ the runtimes
def describe(label: str, user, nmap: M.NameMap, sites: dict, diffs: list[str], name: str = NAME) -> str:
    kinds = list(dict.fromkeys(k for s in sites.values() for k, _ in s))
    absent = [k for k in M.KINDS if k not in nmap.kinds]
    more = "".join(f"; config differs from REF: {d}" for d in diffs)
    return (
        f"{name} {user.shown()} ({label}, CPU; map {nmap.name}: "
        f"{'every kind' if not absent and len(kinds) == len(M.KINDS) else ', '.join(kinds) or 'no kinds'}"
        f"{'; not mapped: ' + ', '.join(absent) if absent else ''}; files: {user.files_text()}{more})"
    )


class UserStepGraphs(StepGraphRuntime):
    """The user's step graphs (the tool's own export) run as `--runtime onnx` runs its own; an image
    or audio prompt's towers: the tool's own tower graphs of REF's checkpoint."""

    def __init__(self, loaded, max_seq: int, user, nmap, sites: dict, diffs: list[str]):
        import onnxruntime as ort

        from .onnx import tower_exported

        label = f"onnxruntime {ort.__version__}"
        self.name = describe(label, user, nmap, sites, diffs)
        self.vision_artifact = lambda shape: tower_exported(loaded, "vision", shape)
        self.audio_artifact = lambda shape: tower_exported(loaded, "audio", shape)
        art = lambda: copied(user, nmap, sites, {})  # noqa: E731
        self.load_graphs(f"{NAME} ({label})", ORT_ENGINE, loaded, max_seq, art, ".onnx", ORT_SESSION)


class UserKVCache(MobiusRuntime):
    """The user's KV-cache graph, its steps driven as mobius.py drives mobius's graph (prefill with
    empty caches, each decode step fed the present caches back)."""

    def __init__(self, loaded, max_seq: int, user, nmap, sites: dict, diffs: list[str], rename: dict):
        import onnxruntime as ort

        label = f"onnxruntime {ort.__version__}"
        self.name = describe(label, user, nmap, sites, diffs)
        art = copied(user, nmap, sites, rename)
        child = self.start(f"{NAME} ({label})", ORT_ENGINE)
        try:
            taps = json.loads((art.path / TAPS).read_text())
            inputs, self.outputs = child.call("load", {"model": str(art.path / MODEL)}, ORT_SESSION, phase="loading")[
                1
            ]["model"]
        except BaseException:
            self.close()
            raise
        finally:
            art.close()
        self.taps = {n: (k, layer) for n, (k, layer) in taps.items()}
        self.inputs = dict(inputs)
        self.infos = layer_infos_from_config(loaded.text_config)
        self.past = {}


# ------------------------------------------------------------------ the hand-over (onnx_spec.py)
def _map(user: U.UserGraph, choice) -> M.NameMap:
    given = choice.file("onnx_map") if choice is not None else None
    if given is not None:
        nmap = given[0]
    elif user.steps:
        nmap = M.built_in("export")
    elif user.mobius_like():
        nmap = M.built_in("mobius")
    else:
        U.fail(user.path, "no built-in map fits this graph (its node names are not mobius-onnx's): name its "
               "tensors with --onnx-map FILE (docs/runtime-onnx.md, \"Your own file\")")  # fmt: skip
    if (nmap.layout == M.STEPS) != user.steps:
        what = "a folder of step graphs" if user.steps else "one graph"
        U.fail(user.path, f"is {what}; the map {nmap.name} is for the {nmap.layout} layout")
    return nmap


def _rename_of(user: U.UserGraph, nmap: M.NameMap, caches: list) -> dict:
    """{the graph's name: mobius.py's} for the KV-cache layout's names the map gives otherwise."""
    out = {nmap.inputs[k]: STANDARD[k] for k in ("input_ids", "attention_mask", "position_ids")}
    out[nmap.outputs["logits"]] = STANDARD["logits"]
    for i, c in enumerate(caches):
        for j, k in enumerate(("past_key", "past_value", "present_key", "present_value")):
            out[c[j]] = M.fill(STANDARD[k], cache=i)
    out = {a: b for a, b in out.items() if a != b}
    clash = [b for b in out.values() if b in Index(user.models["model"].graph).values and b not in out]
    if clash:
        U.fail(user.path, f"its value {one_line(clash[0], 80)!r} is not the layout's, yet has the name the runner "
               "feeds: rename it or map the layout to it")  # fmt: skip
    return out


def run_file(loaded, max_seq: int, header: U.UserGraph, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --onnx PATH [--onnx-map MAP]`: the user's graph under its map (module docstring)."""
    from .registry import captures

    nmap = _map(header, choice)
    diffs = differences(header, nmap, loaded, max_seq, {}, False)  # the layout and the caches, before the names
    check_config(header, diffs, allow_config_mismatch)
    infos = layer_infos_from_config(loaded.text_config)
    capture = None if choice is None else choice.capture
    sites, more = {}, False
    for graph, model in header.models.items():
        found, beyond = resolve(Index(model.graph), nmap, infos, header.file_name(graph))
        sites[graph] = {s: n for s, n in found.items() if captures(capture, s[0])}
        more = more or beyond
        emb = found.get(("embeddings", None))
    diffs = differences(header, nmap, loaded, max_seq, {("embeddings", None): emb}, more)
    check_config(header, diffs, allow_config_mismatch)
    if header.steps:
        return UserStepGraphs(loaded, max_seq, header, nmap, sites, diffs)
    caches = kv_layout(Index(header.models["model"].graph), nmap, header)
    return UserKVCache(loaded, max_seq, header, nmap, sites, diffs, _rename_of(header, nmap, caches))
