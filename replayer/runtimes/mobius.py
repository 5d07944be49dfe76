"""`--runtime mobius`: mobius-onnx's own ONNX Gemma 4, run by ONNX Runtime on CPU (extra
`gemma4-trace[mobius]`).

mobius-onnx (a pure-Python package of the ONNX Runtime project) builds a Gemma 4 decoder as an
ONNX graph from the checkpoint's config and weights with its own components, not by tracing
PyTorch: an independent implementation to replay REF against. This adapter builds mobius's text
decoder (its `gemma4_text` registration) in float32 with its default graph optimizations, and
promotes graph values to outputs so the trace gets per-layer tensors (its capture map,
runtimes/captures.py's MOBIUS, holds the names and op types below):

    kind              the mobius graph value (node names: model/...)
    embeddings        model/embed_tokens/Mul (the scaled token embedding)
    per_layer_inputs  model/Mul after model/Add: (projection + per-layer embedding) * 2**-0.5
    q, k, v           inputs 0, 1, 2 of each layer's Attention node (q after q_norm and RoPE);
                      k and v only for the layers that own a cache (a KV-sharing layer's K/V
                      inputs are its source layer's cache)
    attn_out          model/layers.N/self_attn/o_proj/MatMul
    layer_out         the last node of model/layers.N/ (the layer scalar's Mul)
    final_hidden      model/norm/RMSNormalization

`mask` and the RoPE tables are not captured (mobius builds its attention bias and applies RoPE
inside fused nodes): `trace diff` compares the kinds both traces hold and names the others.
Prefill runs the prompt with an empty KV cache; each decode step feeds the returned `present.*`
caches back (teacher-forced by the driver). The built graph is kept in the artifact cache
(replayer/artifacts.py), keyed by the model's content hash, the builder's versions and this code.
A replay that keeps some kinds (`--kinds`: RuntimeChoice.capture) promotes only those (a graph of
its own, keyed by them too); with none, the graph is mobius's as built (logits and caches).

Config shims (ours, for transformers 5.24's Gemma 4 config; mobius 0.1.0 reads older fields):
- transformers 5.24 keeps head_dim per layer (`per_layer_config`); reading the global
  `config.head_dim`, as mobius does, raises AmbiguousGlobalPerLayerAttributeError. We set
  `allow_global_per_layer_attribute_access` on the loaded config: the global value is the
  sliding layers' head_dim, which is what mobius wants there.
- mobius takes the full-attention layers' head_dim from `global_head_dim`, which 5.24 leaves
  None (it is in `per_layer_config[i].head_dim`): we set it from the full-attention layers'
  per-layer value (all equal, else refused).

A prompt with an image is refused: mobius's text decoder takes token ids only (its vision
encoder is another graph this adapter does not run).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.layers import layer_infos_from_config

from ..artifacts import artifact_folder, code_digest, model_hash
from ..child import ChildRuntime
from ..functional import capture_key, capture_note, quiet
from .mobius_spec import MOBIUS
from .onnx_engine import ENGINE as ORT_ENGINE
from .onnx_engine import SESSION as ORT_SESSION

MOBIUS_VERSION = "0.1.0"  # the release tested; the extra [mobius] pins it
FORMAT = 1  # bump when the promoted outputs or the saved files change (the cache key holds it)
TAPS = "taps.json"  # output name -> [kind, layer]
PLE_ADD = "model/Add_node_"  # the per-layer inputs' Mul is fed by one of these


def hf_config(model_dir):
    """The checkpoint's transformers config with the two shims mobius 0.1.0 needs (module docstring)."""
    import transformers

    top = transformers.AutoConfig.from_pretrained(str(model_dir))
    text = top.get_text_config()
    for c in {id(top): top, id(text): text}.values():
        if hasattr(c, "allow_global_per_layer_attribute_access"):
            c.allow_global_per_layer_attribute_access = True
    if getattr(text, "global_head_dim", None) is None:
        per_layer = getattr(text, "per_layer_config", None)
        full = [i for i, t in enumerate(text.layer_types) if t == "full_attention"]
        dims = {getattr(per_layer[i], "head_dim", None) if per_layer is not None else None for i in full}
        dims.discard(None)
        if len(dims) > 1:
            raise TraceToolError(f"--runtime mobius: full-attention layers have different head_dims {sorted(dims)}")
        text.global_head_dim = dims.pop() if dims else text.head_dim
    return top, text


def _promote(graph, n_layers: int, kinds=None) -> dict[str, tuple[str, int | None]]:
    """Make the values of the capture map's rows (runtimes/captures.py: MOBIUS, the module
    docstring's table) graph outputs (those of `kinds`; None: every kind); return {output name:
    (kind, layer)} of the promoted ones. Every value is looked for, so that a graph whose node
    names are not the known ones is refused whatever `kinds` asks."""
    nodes = list(graph)
    taps: dict[str, tuple[str, int | None]] = {}
    values = {}

    def first(kind, layer=None, pred=lambda n: True):
        """The first node of a kind's row: its name's prefix at `layer`, its op type (`via`)."""
        row = MOBIUS.row(kind)
        op = row.ops[0][0] if row.ops else None
        pre = row.prefix(layer)
        return next((n for n in nodes if n.name.startswith(pre) and op in (None, n.op_type) and pred(n)), None)

    def tap(value, kind, layer=None):
        if value is None or value.name is None:
            return
        taps[value.name], values[value.name] = (kind, layer), value

    emb = first("embeddings")
    tap(emb and emb.outputs[0], "embeddings")
    # the per-layer inputs: the Mul of (projection + per-layer embedding), fed by an Add of the model's own
    ple = first("per_layer_inputs", pred=lambda n: any(_made_by(i, PLE_ADD) for i in n.inputs))
    tap(ple and ple.outputs[0], "per_layer_inputs")
    for i in range(n_layers):
        attn = first("q", i)
        if attn is not None:
            for kind in ("q", "k", "v"):  # k and v where it writes a present cache: K/V of its own
                (_, j), *_ = MOBIUS.row(kind).ops
                if kind == "q" or len(attn.outputs) > 1:
                    tap(attn.inputs[j], kind, i)
        o = first("attn_out", i)
        tap(o and o.outputs[0], "attn_out", i)
        pre = MOBIUS.row("layer_out").prefix(i)
        top = [n for n in nodes if n.name.startswith(pre) and "/" not in n.name[len(pre) :]]
        tap(top[-1].outputs[0] if top else None, "layer_out", i)
    norm = first("final_hidden")
    tap(norm and norm.outputs[0], "final_hidden")
    missing = [f"layer_out L{i}" for i in range(n_layers) if ("layer_out", i) not in taps.values()]
    if missing or ("embeddings", None) not in taps.values():
        raise TraceToolError(
            "--runtime mobius: the mobius graph does not have the expected node names "
            f"(mobius-onnx {MOBIUS_VERSION} is the release this adapter knows); "
            f"missing: {', '.join(missing) or 'embeddings'}"
        )
    if kinds is not None:
        taps = {name: site for name, site in taps.items() if site[0] in kinds}
    outputs = {v.name for v in graph.outputs}
    graph.outputs.extend(v for name, v in values.items() if name in taps and name not in outputs)
    return taps


def _made_by(value, prefix: str) -> bool:
    return value is not None and value.producer() is not None and value.producer().name.startswith(prefix)


def build(model_dir, folder: Path, kinds=None) -> None:
    """mobius's float32 text decoder of the checkpoint, with the promoted outputs (of `kinds`; None:
    every kind), saved in folder (model.onnx, its weights, taps.json)."""
    import onnx_ir as ir
    from mobius._builder import build_from_module
    from mobius._config_resolver import _config_from_hf, _default_task_for_model
    from mobius._registry import registry
    from mobius._weight_loading import _download_weights

    top, text = hf_config(model_dir)
    cls = registry.get("gemma4_text")
    with quiet():
        cfg = _config_from_hf(text, parent_config=top, module_class=cls)
        cfg = dataclasses.replace(cfg, dtype=ir.DataType.FLOAT)
        module = cls(cfg)
        pkg = build_from_module(module, cfg, _default_task_for_model("gemma4_text"))
        state = module.preprocess_weights(_download_weights(str(model_dir)))
        pkg.apply_weights(state, prefix_map=getattr(module, "weight_prefix_map", None))
        taps = _promote(pkg["model"].graph, int(text.num_hidden_layers), kinds)
        pkg.save(str(folder))
    (folder / TAPS).write_text(json.dumps({n: list(kl) for n, kl in taps.items()}, indent=1, sort_keys=True))


def cache_key(loaded, kinds=None) -> dict:
    """What the built graph depends on; a narrowed capture's kinds too (None: every kind, not in the key)."""
    from importlib.metadata import version

    return {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "mobius": version("mobius-onnx"),
        "onnx_ir": version("onnx-ir"),
        "onnxscript": version("onnxscript"),
        "transformers": version("transformers"),
        "code": code_digest("runtimes/mobius.py"),
        **capture_key(kinds),
    }


class MobiusRuntime(ChildRuntime):
    """mobius's graph run by onnxruntime on CPU (in the child process); the host keeps the present.* caches."""

    def __init__(self, loaded, max_seq: int, kinds=None):
        from importlib.metadata import version

        import onnxruntime as ort

        self.name = f"mobius (mobius-onnx {version('mobius-onnx')}, onnxruntime {ort.__version__}, CPU)"
        art = artifact_folder(
            "mobius",
            cache_key(loaded, kinds),
            lambda folder: build(loaded.model_dir, folder, kinds),
            what=f"building mobius's ONNX Gemma 4 for {loaded.name}{capture_note(kinds)}",
        )
        child = self.start(f"mobius (onnxruntime {ort.__version__})", ORT_ENGINE)
        try:
            taps = json.loads((art.path / TAPS).read_text())
            inputs, self.outputs = child.call(
                "load", {"model": str(art.path / "model.onnx")}, ORT_SESSION, phase="loading"
            )[1]["model"]
        except BaseException:
            self.close()
            raise
        finally:
            art.close()
        self.taps = {n: (k, layer) for n, (k, layer) in taps.items()}
        self.inputs = dict(inputs)  # name -> shape
        self.infos = layer_infos_from_config(loaded.text_config)
        self.past: dict[str, np.ndarray] = {}

    def _empty_past(self) -> dict[str, np.ndarray]:
        past = {}
        for name, shape in self.inputs.items():
            if name.startswith("past_key_values."):
                heads, dim = shape[1], shape[3]
                past[name] = np.zeros((1, heads, 0, dim), dtype=np.float32)
        return past

    def _run(self, ids: list[int], first_pos: int, probe) -> torch.Tensor:
        T = len(ids)
        feeds = {
            "input_ids": np.array([ids], dtype=np.int64),
            "attention_mask": np.ones((1, first_pos + T), dtype=np.int64),
            "position_ids": np.arange(first_pos, first_pos + T, dtype=np.int64)[None],
            **self.past,
        }
        outs = dict(zip(self.outputs, self.child.call("run", "model", feeds, phase=self.phase(first_pos == 0))[1]))
        self.past = {
            n.replace("present.", "past_key_values.", 1): v for n, v in outs.items() if n.startswith("present.")
        }
        self.report(probe, (((k, layer), self._rows(k, layer, outs[n], T)) for n, (k, layer) in self.taps.items()))
        return torch.from_numpy(outs["logits"][0, -1])

    def _rows(self, kind: str, layer, x: np.ndarray, T: int) -> np.ndarray:
        """A promoted value as (T, ...) rows in our layout: q/k/v (T, heads * head_dim) split into heads."""
        x = x[0]  # batch 1
        if kind in ("q", "k", "v"):
            info = self.infos[layer]
            x = x.reshape(T, info.num_heads if kind == "q" else info.num_kv_heads, info.head_dim)
        return np.ascontiguousarray(x)

    def prefill(self, input_ids, extra_inputs, probe):
        self.past = self._empty_past()
        return self._run([int(t) for t in input_ids], 0, probe)

    def decode(self, token_id, position, probe):
        return self._run([int(token_id)], int(position), probe)


def create(loaded, max_seq: int, choice=None):
    return MobiusRuntime(loaded, max_seq, None if choice is None else choice.capture)
