"""`trace diff --node-data FILE.json --graph MODEL`: the diff as a Google Model Explorer node-data
overlay (the `ModelNodeData` JSON of ai-edge-model-explorer's node_data_builder), so the graph
shows where the error enters. It lives beside the runtimes whose graphs it reads (diff/ reads none).

    {GRAPH_ID: {"name": ..., "results": {NODE_KEY: {"value": v, "bgColor": ...}}, "thresholds": [...]}}

Each canonical kind the diff compared gets one value on the node that computes it: its worst
error over the compared rows divided by its tolerance (1 is the tolerance; a mask or token
mismatch counts as 1000), colored by thresholds; the first divergence's node is red whatever its
value. The graph names the nodes:

    .tflite   a LiteRT model (`trace export-litert`, litert-torch's export): one graph per
              signature (`prefill_N`, `decode`), keys are tensor names (Model Explorer matches
              them to a node's output `tensor_name`); the kinds are found by the rules of
              replayer/runtimes/litert/graph.py, K and V on the cache outputs
    .pt2      the static runtime's step graph as torch.export saved it (`trace export-pt2`):
              graph "graph", keys are the node names of the program's outputs, which export-pt2
              names after their sites (`L02_attn_out`; replayer/functional.py named_program)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from gemma4_trace.traces.atomic import atomic_output, check_output_path
from gemma4_trace.traces.errors import TraceToolError, install_hint

MISMATCH = 1000.0  # a mask or token difference, in units of "tolerance"
THRESHOLDS = [
    {"value": 1.0, "bgColor": "#c8e6c9"},  # within tolerance
    {"value": 10.0, "bgColor": "#fff59d"},
    {"value": 100.0, "bgColor": "#ffcc80"},
    {"value": 1e30, "bgColor": "#ef9a9a"},
]
FIRST = "#e53935"


def kind_values(result_json: dict) -> dict[tuple[str, int | None], float]:
    """(kind, layer) -> worst error / tolerance, for every tensor the diff compared."""
    out = {}
    for t in result_json.get("tensors", []):
        key = (t["kind"], t.get("layer"))
        if t.get("max_rel_l2") is not None and t.get("threshold"):
            out[key] = float(t["max_rel_l2"]) / float(t["threshold"])
        elif t.get("rows_compared"):
            out[key] = 0.0 if t.get("status") == "ok" else MISMATCH
    return out


def _tflite_keys(path: Path, ref) -> tuple[dict[str, dict[tuple[str, int | None], str]], int | None]:
    """Per signature its kinds' tensor names, and the positions the graph holds (its mask's keys)."""
    from .runtimes.litert import graph as G

    cfg = ref.model_config
    text = cfg.get("text_config", cfg)
    ple = int(text.get("hidden_size_per_layer_input") or 0)
    infos = list(ref.layers)
    out, positions = {}, None
    for key, sig in G.read(path).items():
        mask = sig.inputs.get("mask")
        if mask is not None and sig.tensors[mask].shape:
            positions = int(sig.tensors[mask].shape[-1])
        names = {}
        for tap in G.taps(sig, infos, int(text["hidden_size"]), (len(infos), ple) if ple else None):
            names[(tap.kind, tap.layer)] = sig.tensors[tap.index].name
        if any(k.startswith("kv_cache_") for k in sig.outputs):
            for j, layer in G.cache_layers(sig, infos).items():
                for kind in ("k", "v"):
                    index = sig.outputs.get(f"kv_cache_{kind}_{j}")  # a cache the graph does not return: not drawn
                    if index is not None:
                        names[(kind, layer)] = sig.tensors[index].name
        if "logits" in sig.outputs:
            names[("logits", None)] = sig.tensors[sig.outputs["logits"]].name
        out[key] = names
    return out, positions


PT2_MAX_ENTRIES = 1 << 16  # a program's archive holds a few hundred files
PT2_MAX_JSON = 256 << 20  # models/model.json: about 1 MiB for the embedded model's step, 40 MiB at E2B


def _not_ours(path: Path, why: str) -> TraceToolError:
    return TraceToolError(f"{path}: not a program `trace export-pt2` wrote ({why})")


def _pt2_json(path: Path, z, entry: str, limit: int):
    """The JSON of the archive's one entry FOLDER/`entry`, read within `limit` bytes."""
    found = [i for i in z.infolist() if i.filename.partition("/")[2] == entry and "/" in i.filename]
    bad = f"no {entry}" if not found else f"{len(found)} entries {entry}" if len(found) > 1 else None
    if bad is None and found[0].file_size > limit:
        bad = f"{entry} of {found[0].file_size} bytes, over {limit}"
    if bad:
        raise _not_ours(path, bad)
    with z.open(found[0]) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _not_ours(path, f"{entry} past {limit} bytes")
    return json.loads(data)


def _output_name(spec) -> str | None:
    """The graph value an output spec of torch.export's JSON names (`{"user_output": {"arg":
    {"as_tensor": {"name": "mul_3"}}}}`, a mutation's `{"arg": {"name": ...}}`), else None."""
    body = next(iter(spec.values())) if isinstance(spec, dict) and len(spec) == 1 else None
    arg = body.get("arg") if isinstance(body, dict) else None
    if isinstance(arg, dict) and len(arg) == 1 and "as_tensor" in arg:
        arg = arg["as_tensor"]
    name = arg.get("name") if isinstance(arg, dict) else None
    return name if isinstance(name, str) and 0 < len(name) <= 200 else None


def _pt2_positions(graph: dict, signature: dict) -> int | None:
    """The positions the program's K/V cache buffers hold (their third axis), from the JSON graph."""
    values = graph.get("tensor_values")
    for spec in signature.get("input_specs") or []:
        buffer = spec.get("buffer") if isinstance(spec, dict) else None
        if not isinstance(buffer, dict) or not str(buffer.get("buffer_name", "")).endswith("_cache"):
            continue
        arg = buffer.get("arg")
        name = arg.get("name") if isinstance(arg, dict) else None
        sizes = values.get(name, {}).get("sizes") if isinstance(values, dict) and isinstance(name, str) else None
        if isinstance(sizes, list) and len(sizes) == 4 and isinstance(sizes[2], dict):
            n = sizes[2].get("as_int")
            if isinstance(n, int) and 0 < n < 1 << 40:
                return n
    return None


def _pt2_keys(path: Path) -> tuple[dict[str, dict[tuple[str, int | None], str]], int | None]:
    """The program's output nodes by kind, read from the archive's JSON parts alone: its
    serialized graph (models/model.json) and the outputs' names `trace export-pt2` adds; and the
    positions its K/V cache holds. Nothing
    in it is unpickled or run (torch.export.load would unpickle its sample inputs and may
    unpickle constants: a .pt2 is untrusted input like a trace)."""
    import zipfile
    import zlib

    from .functional import PT2_OUTPUTS, output_site

    try:
        with zipfile.ZipFile(path) as z:
            if len(z.infolist()) > PT2_MAX_ENTRIES:
                raise _not_ours(path, f"over {PT2_MAX_ENTRIES} files")
            model = _pt2_json(path, z, "models/model.json", PT2_MAX_JSON)
            names = _pt2_json(path, z, f"extra/{PT2_OUTPUTS}", 1 << 20)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, OSError, EOFError, ValueError, RecursionError) as e:
        raise _not_ours(path, type(e).__name__) from None
    except NotImplementedError:  # a compression method zipfile does not have
        raise _not_ours(path, "an unknown compression") from None
    graph = model.get("graph_module") if isinstance(model, dict) else None
    signature = graph.get("signature") if isinstance(graph, dict) else None
    specs = signature.get("output_specs") if isinstance(signature, dict) else None
    if not isinstance(specs, list) or not isinstance(names, list) or len(names) != len(specs):
        raise _not_ours(path, "no list of its outputs")
    keys = {}
    for name, spec in zip(names, specs):
        if not isinstance(name, str) or name.endswith("_cache"):
            continue
        node = _output_name(spec)
        try:
            site = ("logits", None) if name == "logits" else output_site(name)
        except ValueError:
            node = None
        if node is None:
            what = f"an output named {name[:60]!r}"
            raise _not_ours(path, what)
        keys[site] = node
    inner = graph.get("graph")
    return {"graph": keys}, _pt2_positions(inner if isinstance(inner, dict) else {}, signature)


def node_data(result_json: dict, ref, graph_path, run_max_seq: int | None = None) -> tuple[dict, int | None]:
    """The ModelNodeData JSON (a dict) of a diff over the graph at graph_path, and the positions the
    graph holds (None where it does not say). A graph of other positions than RUN's runtime held
    (`run_max_seq`, where RUN's trace says) is refused, and one too short for the traces always."""
    path = Path(graph_path)
    if not path.is_file():
        raise TraceToolError(f"--graph {path}: no such file")
    if path.suffix == ".tflite":
        import importlib.util

        if importlib.util.find_spec("ai_edge_litert") is None:  # its flatbuffer schema reads the file
            hint = install_hint("litert")
            raise TraceToolError(f"--graph {path.name}: reading a .tflite needs ai-edge-litert: {hint}")
        graphs, positions = _tflite_keys(path, ref)
    elif path.suffix == ".pt2":
        graphs, positions = _pt2_keys(path)
    else:
        raise TraceToolError(f"--graph {path}: expected a .tflite (LiteRT) or a .pt2 (trace export-pt2) file")
    held = _held(graphs, run_max_seq) if run_max_seq is not None else None
    if positions is not None and held is not None and positions != held:
        how = f" (--max-seq {run_max_seq})" if held != run_max_seq else ""
        raise TraceToolError(
            f"--graph {path.name} holds {positions} positions (its K/V cache) and RUN's runtime held {held}{how}: "
            f"it is not the graph RUN ran (export it for this run: --max-seq {run_max_seq})"
        )
    if positions is not None and positions < ref.n_positions:
        raise TraceToolError(
            f"--graph {path.name} holds {positions} positions (its K/V cache) and the traces {ref.n_positions}: "
            f"it is not the graph RUN ran (export it for this trace: --max-seq {ref.n_positions} or more)"
        )
    values = kind_values(result_json)
    first = result_json.get("first_divergence") or {}
    first_key = (first.get("kind"), first.get("layer")) if first else None
    out = {}
    for graph_id, keys in graphs.items():
        results = {}
        for site, node in keys.items():
            if site in values:
                r = {"value": values[site]}
                if site == first_key:
                    r["bgColor"] = FIRST
                results[node] = r
        if results:
            out[graph_id] = {
                "name": "gemma4-trace: worst error / tolerance",
                "results": results,
                "thresholds": THRESHOLDS,
            }
    if not out:
        raise TraceToolError(f"--graph {path}: none of its nodes is a kind the diff compared")
    return out, positions


def _held(graphs: dict, max_seq: int) -> int:
    """The positions a graph of RUN's runtime holds at `max_seq`: max_seq, rounded up to whole prefill
    chunks for a LiteRT export (its `prefill_N` signature; litert/export.py cache_length)."""
    from .runtimes.litert.export import cache_length

    chunks = [int(m.group(1)) for key in graphs if (m := re.fullmatch(r"prefill_(\d+)", str(key)))]
    return cache_length(max_seq, max(chunks)) if chunks else max_seq


def write_node_data(result, graph_path, out_path, force: bool = False) -> int | None:
    """Write the overlay with the traces' atomic writer (complete or absent); the positions the graph
    holds, where it says."""
    from gemma4_trace.traces.reader import TraceReader

    check_output_path(out_path, force, inputs=(result.reference.path, result.candidate.path, graph_path))
    with TraceReader(result.candidate.path) as run:
        run_max_seq = run.max_seq
    with TraceReader(result.reference.path) as ref:
        data, positions = node_data(result.to_json(), ref, graph_path, run_max_seq)
    with atomic_output(out_path, force) as tmp:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    return positions
