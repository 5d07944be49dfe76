"""`trace repro REF RUN [--at STEP,LAYER] -o DIR`: one layer at one step, standalone.

Writes, for one site (step, layer) of RUN against REF (`trace repro` takes the diff's first
divergence by default):

- inputs.npz: REF's input to the layer (`hidden`: the previous layer's layer_out, or the
  embeddings for layer 0), its per-layer-input slice, the absolute `positions`, REF's mask
  rows over keys 0..last position, REF's RoPE cos/sin rows, and the K/V rows it attends over
  (REF's k/v of the layer that stores them: for a KV-sharing layer its source layer);
- weights.npz: that layer's weights only, float32, from the model folder REF names (or --model);
- outputs.npz: REF's and RUN's layer_out (and REF's attn_out) at that step;
- repro.py: needs only numpy and torch; recomputes the layer in plain float32 and prints its
  error against REF's and RUN's outputs (exit 0 when it matches REF within its tolerance);
- with --onnx, layer.onnx: repro.py's own float recompute of the layer exported by torch's
  ONNX exporter, the weights inside, its inputs named as in inputs.npz (outputs layer_out and
  attn_out); repro.py also runs it with onnxruntime, when that is installed, against REF.

Everything that goes from a trace into repro.py is serialised as JSON inside a Python string
literal (repr), never pasted as code.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gemma4_trace.replayer.artifacts import check_output_folder, copy_all_or_none
from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.schema import rope_kinds

FILES = ("repro.py", "inputs.npz", "weights.npz", "outputs.npz")
ONNX_FILE = "layer.onnx"
ONNX_INPUTS = ("hidden", "positions", "mask", "k_rows", "v_rows", "cos", "sin", "per_layer_input")
ONNX_OPSET = 18
TOL_FLOAT32 = 1e-5  # the recompute's tolerance against a float32 REF (rel-L2)
TOL_LOW = 2e-2  # against a REF recorded in a 16-bit dtype (the recompute runs in float32)
TEMPLATE = Path(__file__).with_name("repro_template.py")


def first_divergence_site(ref_path, run_path, base_path=None) -> tuple[int, int]:
    """(step, layer) of the first divergence `trace diff REF RUN [--baseline BASE]` finds, for
    `trace repro` without --at."""
    from gemma4_trace.diff import compare  # the site alone: no sentence, hint or BASE-against-REF judgement

    d = compare(ref_path, run_path, baseline_path=base_path).first_divergence
    if d is None:
        judged = " judged against BASE" if base_path is not None else ""
        raise TraceToolError(f"RUN matches REF{judged} (no divergence): pass --at STEP,LAYER to choose a layer")
    if d.tower not in (None, "text"):  # an encoder tower's divergence (schema version 2)
        raise TraceToolError(
            f"the first divergence is in the {d.tower} tower ({d.kind}, layer {d.layer}): a repro covers the text "
            "decoder's layers; pass --at STEP,LAYER to choose one"
        )
    if d.layer is None:
        if d.kind in GLOBAL_SITES:
            return int(d.step), d.kind
        raise TraceToolError(
            f"the first divergence is in {d.kind} at step {d.step}, not in a decoder layer nor in the "
            "embeddings or per_layer_inputs: pass --at STEP,LAYER to choose one"
        )
    return int(d.step), int(d.layer)


GLOBAL_SITES = ("embeddings", "per_layer_inputs")  # the tensors before the layers a repro covers


def parse_site(text: str) -> tuple[int, int | str]:
    """--at STEP,LAYER, or STEP,embeddings / STEP,per_layer_inputs."""
    parts = text.replace(" ", "").split(",")
    if len(parts) == 2 and parts[0].isdigit() and parts[1] in GLOBAL_SITES:
        return int(parts[0]), parts[1]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise TraceToolError(
            f"--at expects STEP,LAYER (two integers >= 0) or STEP,embeddings or STEP,per_layer_inputs, got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def _rows(r: TraceReader, kind: str, layer, rows: slice, what: str) -> np.ndarray:
    if not r.has(kind, layer):
        name = kind + (f" of layer {layer}" if layer is not None else "")
        raise TraceToolError(f"{what} stores no {name}; the repro needs it")
    a = np.asarray(r.read(kind, layer, rows))
    present = r.rows_present(kind, layer)
    if present is not None and not np.all(present[rows]):
        raise TraceToolError(
            f"{what}'s {kind} of layer {layer} lacks rows {rows.start}..{rows.stop - 1} (recorded absent)"
        )
    if a.dtype != np.bool_ and not np.all(np.isfinite(a)):
        raise TraceToolError(f"{what}'s {kind} of layer {layer} holds NaN/Inf in rows {rows.start}..{rows.stop - 1}")
    return a


def _layer_weights(prov: dict, model_dir, layer: int) -> tuple[dict, dict]:
    """The layer's weights (float32 numpy) and the facts the recompute needs, from the model."""
    import torch

    from gemma4_trace.hf.model import load_for_reference
    from gemma4_trace.replayer.ops import ACTIVATIONS
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    loaded = load_for_reference(prov, model_dir, device="cpu")
    rt = StaticGemma4Runtime(loaded, max_seq=1)
    L = rt.layers[layer]
    if L.moe:
        raise TraceToolError(f"layer {layer} is a MoE layer: trace repro does not cover MoE layers yet")
    act = rt.cfg.hidden_activation
    if act not in ACTIVATIONS:
        raise TraceToolError(f"hidden_activation {act!r} is not supported")
    weights = {
        n: t.detach().to(torch.float32).cpu().numpy() for n, t in L._buffers.items() if n not in ("k_cache", "v_cache")
    }
    facts = {
        "eps": float(rt.eps),
        "activation": str(act),
        "owns_kv": bool(L.owns_kv),
        "k_eq_v": bool(L.k_eq_v),
        "ple": bool(L.ple),
    }
    return weights, facts


def check_onnx_export() -> None:
    """Refuse --onnx (one line) before any work when torch's ONNX exporter cannot run."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401  (torch's ONNX exporter needs it)
    except ImportError as e:
        raise TraceToolError(f"trace repro --onnx needs onnx and onnxscript: {install_hint('onnx')} ({e})") from None


def onnx_feeds(inputs: dict) -> dict:
    """inputs.npz's arrays as layer.onnx takes them: positions int64, mask bool, the rest float32."""
    dtypes = {"positions": np.int64, "mask": np.bool_}
    return {k: np.asarray(inputs[k], dtype=dtypes.get(k, np.float32)) for k in ONNX_INPUTS if k in inputs}


def _export_layer_onnx(folder: Path, inputs: dict, weights: dict) -> None:
    """Export repro.py's `layer` (the written file, loaded as a module) as folder/layer.onnx."""
    import importlib.util

    import torch

    from gemma4_trace.replayer.functional import quiet

    spec = importlib.util.spec_from_file_location("_trace_repro_layer", folder / "repro.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    feeds = onnx_feeds(inputs)
    names = list(feeds)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in weights.items():
                self.register_buffer("w_" + k, torch.from_numpy(np.asarray(v, dtype=np.float32)))

        def forward(self, *args):
            w = {k: getattr(self, "w_" + k) for k in weights}
            return module.layer(dict(zip(names, args)), w, module.CONFIG)

    example = tuple(torch.from_numpy(v) for v in feeds.values())
    try:
        with torch.no_grad(), quiet():
            torch.onnx.export(
                Layer().eval(),
                example,
                str(folder / ONNX_FILE),
                input_names=names,
                output_names=["layer_out", "attn_out"],
                opset_version=ONNX_OPSET,
                dynamo=True,
                external_data=False,
                verbose=False,
            )
    except Exception as e:  # noqa: BLE001 - the exporter fails in many ways; one line for the user
        raise TraceToolError(
            f"ONNX export of the layer failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ) from None


def write_repro(
    ref_path,
    run_path,
    out_dir,
    *,
    at: tuple[int, int] | None = None,
    model_dir=None,
    force: bool = False,
    onnx: bool = False,
    base_path=None,
) -> str:
    """Write the repro folder for layer `at` = (step, layer) (None: the first divergence's site, as
    `trace diff` finds it, with `base_path` as `trace diff --baseline` does); return a summary line.
    With `base_path`, BASE's layer_out goes beside RUN's and repro.py reports RUN's excess over BASE."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TraceToolError(f"{out} exists and is not a folder")
    if onnx:
        check_onnx_export()
    step, layer = first_divergence_site(ref_path, run_path, base_path) if at is None else at
    if isinstance(layer, str) and onnx:
        raise TraceToolError(f"--onnx exports a decoder layer; the site is {layer}")
    read = _read_global_site if isinstance(layer, str) else _read_site
    site = read(ref_path, run_path, step, layer, model_dir)
    if base_path is not None:
        _add_baseline(site, ref_path, base_path, step, layer)
    # every target absent or (--force) a regular file, and none of them REF, RUN or BASE, whatever its name
    inputs = [ref_path, run_path, *([base_path] if base_path is not None else [])]
    check_output_folder(out, [*FILES, ONNX_FILE], force, "repro", inputs=inputs)
    _place(out, site, onnx)
    files = (*FILES, ONNX_FILE) if onnx else FILES
    size = sum((out / f).stat().st_size for f in files)
    c = site.config
    if isinstance(layer, str):
        start, last = c["positions"]
        return (
            f"wrote {out}: {layer} at step {step}, positions {start}..{last}; {size} bytes in {len(files)} files; "
            f"run: cd {out} && python repro.py"
        )
    kind = (
        f"{c['layer_type']}, {c['kv_role']}"
        + (f" (K/V of layer {c['kv_source']})" if c["kv_source"] != layer else "")
        + (", PLE" if c["ple"] else "")
    )
    start, last = c["positions"]
    return (
        f"wrote {out}: layer {layer} ({kind}) at step {step}, positions {start}..{last}; "
        f"{size} bytes in {len(files)} files; run: cd {out} && python repro.py"
    )


@dataclass
class _Site:
    inputs: dict
    weights: dict
    outputs: dict
    config: dict


def _read_site(ref_path, run_path, step: int, layer: int, model_dir) -> _Site:
    """The layer's inputs, weights and outputs at the step, and repro.py's CONFIG, from the traces."""
    with TraceReader(ref_path) as ref, TraceReader(run_path) as run:
        prov = dict(ref.provenance)
        if run.provenance.get("model_config_sha256") != prov.get("model_config_sha256"):
            raise TraceToolError("REF and RUN come from different models")
        if not 0 <= step < min(ref.n_steps, run.n_steps):
            raise TraceToolError(f"step {step} is outside the traces' steps 0..{min(ref.n_steps, run.n_steps) - 1}")
        if ref.step_positions[step] != run.step_positions[step]:
            raise TraceToolError(f"REF and RUN cover different positions at step {step}")
        infos = list(ref.layers)
        if not 0 <= layer < len(infos):
            raise TraceToolError(f"layer {layer} is outside the model's layers 0..{len(infos) - 1}")
        info = infos[layer]
        start, stop = (int(v) for v in ref.step_positions[step])
        inputs = _layer_inputs(ref, step, layer, info, slice(start, stop))
        outputs = {"ref_layer_out": _rows(ref, "layer_out", layer, slice(start, stop), "REF")}
        if ref.has("attn_out", layer):
            outputs["ref_attn_out"] = _rows(ref, "attn_out", layer, slice(start, stop), "REF")
        if run.has("layer_out", layer):
            outputs["run_layer_out"] = _rows(run, "layer_out", layer, slice(start, stop), "RUN")
        weights, facts = _layer_weights(prov, model_dir, layer)
        if facts["ple"]:
            inputs["per_layer_input"] = _rows(ref, "per_layer_inputs", None, slice(start, stop), "REF")[:, layer, :]
        low = ref.source_dtype("layer_out", layer) not in ("float32", "float64")
        config = {
            "step": step,
            "layer": layer,
            "layer_type": str(info.layer_type),
            "kv_role": str(info.kv_role),
            "kv_source": int(info.kv_source),
            "num_heads": int(info.num_heads),
            "num_kv_heads": int(info.num_kv_heads),
            "head_dim": int(info.head_dim),
            "positions": [start, stop - 1],
            "tolerance": TOL_LOW if low else TOL_FLOAT32,
            "ref_runtime": one_line(str(prov.get("runtime", "")), 200),  # trace text: printed by repro.py, escaped
            "run_runtime": one_line(str(run.provenance.get("runtime", "")), 200),
            **facts,
        }
    return _Site(inputs, weights, outputs, config)


def _add_baseline(site: _Site, ref_path, base_path, step: int, layer: int) -> None:
    """BASE's layer_out at the site, beside RUN's (BASE from the same model, over the same positions)."""
    with TraceReader(ref_path) as ref, TraceReader(base_path) as base:
        if base.provenance.get("model_config_sha256") != ref.provenance.get("model_config_sha256"):
            raise TraceToolError("REF and BASE come from different models")
        if not step < base.n_steps or base.step_positions[step] != ref.step_positions[step]:
            raise TraceToolError(f"BASE does not cover REF's positions at step {step}")
        start, stop = (int(v) for v in ref.step_positions[step])
        kind, at = (layer, None) if isinstance(layer, str) else ("layer_out", layer)
        site.outputs[f"base_{kind}"] = _rows(base, kind, at, slice(start, stop), "BASE")
        site.config["base_runtime"] = one_line(str(base.provenance.get("runtime", "")), 200)


def _read_global_site(ref_path, run_path, step: int, kind: str, model_dir) -> _Site:
    """The embeddings or per_layer_inputs at one step: the token ids fed there, the rows of the
    embedding tables they pick (and for per_layer_inputs REF's embeddings and the projection), REF's
    and RUN's rows; repro.py recomputes them as Gemma 4 does (text positions only)."""
    import torch

    from gemma4_trace.hf.model import load_for_reference
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    with TraceReader(ref_path) as ref, TraceReader(run_path) as run:
        prov = dict(ref.provenance)
        if run.provenance.get("model_config_sha256") != prov.get("model_config_sha256"):
            raise TraceToolError("REF and RUN come from different models")
        if not 0 <= step < min(ref.n_steps, run.n_steps) or ref.step_positions[step] != run.step_positions[step]:
            raise TraceToolError(f"step {step} is not a step both traces cover at the same positions")
        if ref.extra_shapes():
            raise TraceToolError(f"REF's prompt has an image: the {kind} repro covers text prompts")
        start, stop = (int(v) for v in ref.step_positions[step])
        fed = np.concatenate([np.asarray(ref.prompt_ids, np.int64), np.asarray(ref.tokens(), np.int64)])
        ids = fed[start:stop]
        rows = slice(start, stop)
        outputs = {f"ref_{kind}": _rows(ref, kind, None, rows, "REF")}
        if run.has(kind, None):
            outputs[f"run_{kind}"] = _rows(run, kind, None, rows, "RUN")
        embeddings = _rows(ref, "embeddings", None, rows, "REF") if kind == "per_layer_inputs" else None
        low = ref.source_dtype(kind, None) not in ("float32", "float64")
        run_name = one_line(str(run.provenance.get("runtime", "")), 200)
    rt = StaticGemma4Runtime(load_for_reference(prov, model_dir, device="cpu"), max_seq=1)
    f32 = lambda t: t.detach().to(torch.float32).cpu().numpy()  # noqa: E731
    pick = torch.as_tensor(ids)
    config = {"site": kind, "step": step, "positions": [start, stop - 1], "token_ids": ids.tolist()}
    if kind == "embeddings":
        weights = {"embed_rows": f32(rt.embed[pick])}
        config["embed_scale"] = float(rt.embed_scale)
    else:
        if not rt.ple_dim:
            raise TraceToolError("the model has no per-layer inputs")
        weights = {
            "ple_rows": f32(rt.ple_embed[pick]),
            "ple_model_proj": f32(rt.ple_model_proj),
            "ple_proj_norm": f32(rt.ple_proj_norm),
        }
        config.update(
            ple_scale=float(rt.ple_scale), hidden=int(rt.hidden), n_layers=int(rt.n_layers), ple_dim=int(rt.ple_dim)
        )
    config.update(
        eps=float(rt.eps),
        tolerance=TOL_LOW if low else TOL_FLOAT32,
        ref_runtime=one_line(str(prov.get("runtime", "")), 200),
        run_runtime=run_name,
    )
    inputs = {"positions": np.arange(start, stop, dtype=np.int64), "token_ids": ids}
    if embeddings is not None:
        inputs["embeddings"] = embeddings
    return _Site(inputs, weights, outputs, config)


def _layer_inputs(ref: TraceReader, step: int, layer: int, info, rows: slice) -> dict:
    """REF's input to the layer at these rows: the hidden state, positions, mask, the K/V it
    attends over (its source layer's) and the RoPE rows."""
    keys = slice(0, rows.stop)
    src = int(info.kv_source)
    full_mask = _rows(ref, "mask", layer, rows, "REF")
    if full_mask[:, rows.stop :].any():
        raise TraceToolError(f"REF's mask of layer {layer} at step {step} allows keys after position {rows.stop - 1}")
    cos_kind, sin_kind = rope_kinds(info.layer_type)
    return {
        "hidden": _rows(ref, "layer_out", layer - 1, rows, "REF")
        if layer
        else _rows(ref, "embeddings", None, rows, "REF"),
        "positions": np.arange(rows.start, rows.stop, dtype=np.int64),
        "mask": full_mask[:, : rows.stop].astype(np.bool_),
        "k_rows": _rows(ref, "k", src, keys, "REF"),
        "v_rows": _rows(ref, "v", src, keys, "REF"),
        "cos": _rows(ref, cos_kind, None, rows, "REF"),
        "sin": _rows(ref, sin_kind, None, rows, "REF"),
    }


CONFIG_LINE = "json.loads(__CONFIG__)  # noqa: F821 - the writer replaces __CONFIG__ with a JSON string literal"


def _place(out: Path, site: _Site, onnx: bool) -> None:
    """Write every file into a private folder inside `out`, then rename them into place."""
    files = (*FILES, ONNX_FILE) if onnx else FILES
    source = TEMPLATE.read_text(encoding="utf-8").replace(
        CONFIG_LINE, f"json.loads({json.dumps(site.config)!r})  # the site, its tolerance and the runtimes", 1
    )
    if CONFIG_LINE in source or "__CONFIG__" in source:
        raise TraceToolError("the repro template's configuration line is not where trace repro expects it")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".repro-", dir=out))
    try:  # every file complete before any lands in DIR, then all of them placed or none
        (tmp / "repro.py").write_text(source, encoding="utf-8")
        np.savez(tmp / "inputs.npz", **site.inputs)
        np.savez(tmp / "weights.npz", **site.weights)
        np.savez(tmp / "outputs.npz", **site.outputs)
        if onnx:
            _export_layer_onnx(tmp, site.inputs, site.weights)
        copy_all_or_none([tmp / f for f in files], out, "repro")
        if not onnx and (out / ONNX_FILE).is_file():  # --force without --onnx: no stale graph of another site
            (out / ONNX_FILE).unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
