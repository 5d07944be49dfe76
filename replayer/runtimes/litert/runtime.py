"""`--runtime litert`, `litert-int8`, `litert-wi8`, `litert-int4` and their `-dq` baselines:
REF's checkpoint exported by litert-torch's Gemma 4 path and run by ai-edge-litert's interpreter
(XNNPACK, CPU) in a child process (extra `gemma4-trace[litert]`).

The export (replayer/runtimes/litert/export.py) has three graphs: embedder.tflite and
per_layer_embedder.tflite (token ids -> embeddings, per-layer embeddings) and model.tflite with a
`prefill_P` signature (P rows from the cache, no logits) and a `decode` one (one row, logits).
Inputs are the embeddings, the per-layer embeddings, input_pos, an additive mask (1, 1, n, S) for
the full-attention layers (the sliding ones build theirs from input_pos) and the K/V caches of the
layers that write K/V, which the host keeps between steps. A step is driven as LiteRT-LM drives it:

    prefill step   the prompt's first T-1 tokens through prefill_P in chunks of P rows (the pad
                   rows of the last chunk: the last token again at the next positions, masked
                   out), then the last prompt token through decode at position T-1: its logits
                   and row T-1
    decode step    one token through decode

The interpreter keeps every op's output (experimental_preserve_all_tensors), and graph.py names
the tensors that are canonical kinds. Asked for some kinds only (RuntimeChoice.capture, `--kinds`),
it keeps none: their tensors are extra outputs of a rewritten model.tflite (outputs.py), so
XNNPACK fuses the rest; asked for none, it runs the export as it is. The prefill graph holds only
the layers whose outputs it returns (the caches): the layers that reuse another's K/V are pruned
from it, and so is the final norm. Their prefill rows come from a second pass that feeds the T-1
tokens through decode one at a time from empty caches (the provenance says which kinds); the
caches carried on are the prefill graph's. K and V rows are read from the cache outputs (V
stored transposed).

An image prompt's vision tower runs on litert-torch's vision graphs (vision.py, LiteRTImages), an
audio prompt's audio tower on its audio graphs (audio.py, LiteRTAudio): their soft tokens replace the
image and audio tokens' embeddings.
"""

from __future__ import annotations

import numpy as np
import torch

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.layers import layer_infos_from_config
from gemma4_trace.traces.schema import KIND_NAMES

from ...child import ChildRuntime
from ...ops import resolve_prefill_chunk
from ..registry import captures
from . import export as E
from . import graph as G
from . import outputs as O
from .audio import LiteRTAudio
from .spec import LITERT
from .vision import LiteRTImages

ENGINE = "gemma4_trace.replayer.runtimes.litert.engine:LiteRTEngine"
K_CACHE, V_CACHE = (LITERT.row(k).prefix() for k in ("k", "v"))  # the cache outputs the K and V rows are read from
NEG = -1e30  # the additive mask's blocked value
ALLOWED_ABOVE = -1.0  # a mask value above this lets the key through
QUANT_WORDS = {
    "dynamic_wi8_afp32": "int8 weights per channel, dynamic int8 activations",
    "weight_only_wi8_afp32": "int8 weights per channel, float activations",
    "dynamic_wi4_afp32": "int4 weights per channel, dynamic int8 activations",
}


class LiteRTRuntime(ChildRuntime):
    """The files are exported (or taken from the artifact cache) when the runtime is first asked its
    name or to prefill: after the driver has set `prefill_chunk` (--prefill-chunk), the export's P."""

    supports_prefill_chunk = True

    def __init__(self, loaded, max_seq: int, mode: str, capture: frozenset | None = None):
        self.vers = E.versions()
        self.capture = capture  # the kinds the replay keeps (RuntimeChoice.capture); None: every kind
        self.label = f"{mode} (ai-edge-litert {self.vers['ai-edge-litert']})"
        self.start(self.label, ENGINE)
        cfg = loaded.text_config
        self.loaded, self.max_seq, self.mode = loaded, int(max_seq), mode
        self.infos = layer_infos_from_config(cfg)
        self.hidden, self.vocab = int(cfg.hidden_size), int(cfg.vocab_size)
        ple = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        self.ple = (len(self.infos), ple) if ple else None
        self.graph, self._name = None, None
        self.prefill_chunk = resolve_prefill_chunk(None, max_seq)
        self.images = LiteRTImages(self)  # an image prompt's vision tower (vision.py)
        self.audio = LiteRTAudio(self)  # an audio prompt's audio tower (audio.py)

    @property
    def prefill_chunk(self) -> int | None:
        return None if self.P == self.max_seq else self.P

    @prefill_chunk.setter
    def prefill_chunk(self, rows: int | None) -> None:
        P = rows or self.max_seq
        if self.graph is not None and P != self.P:
            raise TraceToolError("the LiteRT files are loaded; set prefill_chunk before the replay starts")
        self.P, self.S = P, E.cache_length(self.max_seq, P)

    @property
    def name(self) -> str:
        """What runs, and what its graph lacks once prepared (before: the mode and the engine)."""
        return self._name or self.label

    def prepare(self, input_ids=None, extra_inputs=None) -> None:
        """Export (or take from the artifact cache) and load the files, once, after the driver has
        set prefill_chunk (the export's prefill length); an audio prompt's audio graphs too (their
        provenance is then in the runtime's name, which the trace records)."""
        self._load()
        self.audio.prepare(extra_inputs or {})

    def _load(self) -> None:
        if self.graph is not None:
            return
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        arts = []
        try:
            paths = self._files(arts)
            self.embedders = [n for n in ("embedder", "per_layer_embedder") if n in paths]
            graph = G.read(paths["model"])
            self.taps = self._taps(graph)
            self.keep = self.capture is None  # every kind: the interpreter keeps every op's output
            wanted = {sig: [t.index for t in taps] for sig, taps in self.taps.items() if taps}
            if not self.keep and wanted:  # some kinds: their tensors as extra outputs of the graph
                arts.append(O.tapped(arts[-1], {t.kind for ts in self.taps.values() for t in ts}, wanted))
                paths["model"] = str(arts[-1].path / "model.tflite")
            _, meta, self.kept = self.child.call("load", paths, ["model"] if self.keep else [], phase="loading")
        finally:
            for a in arts:
                a.close()
        self.note, self.model_file = arts[-1].note, paths["model"]
        self._check(meta, graph)
        pre = {(t.kind, t.layer) for t in self.taps[self.prefill_sig]}
        self.stepped = sorted({(t.kind, t.layer) for t in self.taps["decode"]} - pre, key=str)
        self.owners = G.cache_layers(graph["decode"], self.infos)
        self.caches = self._zero_caches()
        self._name = self._describe()
        self.graph = graph

    def _files(self, arts: list) -> dict:
        """The .tflite files' paths by name (model, embedder, per_layer_embedder); the artifacts that
        hold them appended to `arts` (held while they load; the last holds model.tflite)."""
        loaded, max_seq, mode = self.loaded, self.max_seq, self.mode
        arts.append(E.exported(loaded, max_seq, self.P))
        if mode != "litert":
            arts.append(E.quantized(loaded, max_seq, self.P, mode))
        paths = {n: str(arts[0].path / f"{n}.tflite") for n in ("embedder", "per_layer_embedder")}
        paths["model"] = str(arts[-1].path / "model.tflite")
        return paths

    def _taps(self, graph: dict) -> dict:
        """Each signature's taps of the kinds the replay keeps (graph.py)."""
        for sig in (self.prefill_sig, "decode"):
            if sig not in graph:
                raise TraceToolError(f"the LiteRT model has no {sig!r} signature (it has {', '.join(graph)})")
        every = {sig: G.taps(graph[sig], self.infos, self.hidden, self.ple) for sig in (self.prefill_sig, "decode")}
        got = G.layers_present(every["decode"])
        if got != set(range(len(self.infos))):
            found = {t.kind for taps in every.values() for t in taps}
            text = [r.kind for r in LITERT.rows if "." not in r.kind]  # the text model's kinds
            kinds = [k for k in dict.fromkeys(text) if k not in ("embeddings", "k", "v", "logits")]
            raise TraceToolError(
                f"the LiteRT decode graph names layer outputs {sorted(got)}; REF's model has {len(self.infos)} "
                "layers (another litert-torch release names its tensors otherwise); kinds found: "
                f"{', '.join(k for k in kinds if k in found) or 'none'}; not found: "
                f"{', '.join(k for k in kinds if k not in found) or 'none'}"
            )
        return {sig: [t for t in taps if self.captures(t.kind)] for sig, taps in every.items()}

    def captures(self, kind: str) -> bool:
        return captures(self.capture, kind)

    @property
    def prefill_sig(self) -> str:
        return f"prefill_{self.P}"

    def _check(self, meta: dict, graph: dict) -> None:
        """Refuse, in one line, files that are not this model's export for this max_seq."""
        model = meta["model"]
        for sig in (self.prefill_sig, "decode"):
            if sig not in model or sig not in graph:
                raise TraceToolError(f"the LiteRT model has no {sig!r} signature (it has {', '.join(model)})")
        ins = model["decode"][0]
        emb = ins.get("embeddings", ((),))[0]
        if tuple(emb[-1:]) != (self.hidden,):
            raise TraceToolError(f"the LiteRT model takes embeddings of shape {emb}; REF's model is {self.hidden} wide")
        mask = ins.get("mask", ((),))[0]
        if tuple(mask[-1:]) != (self.S,):
            raise TraceToolError(f"the LiteRT model's mask is {mask}; expected {self.S} keys")
        if "logits" not in model["decode"][1]:
            raise TraceToolError("the LiteRT model's decode signature returns no logits")
        self.inputs = {sig: model[sig][0] for sig in model}
        for sig, taps in ({} if self.keep else self.taps).items():
            missing = [O.output_name(t.index) for t in taps if O.output_name(t.index) not in model[sig][1]]
            if missing:
                raise TraceToolError(f"the rewritten LiteRT model's {sig} signature does not return {missing[0]}")

    def _describe(self) -> str:
        vers = self.vers
        what = "float32"
        if self.mode != "litert":
            recipe = E.RECIPES[self.mode.removesuffix("-dq")]
            what = f"{recipe}: {QUANT_WORDS[recipe]}"
            if self.mode.endswith("-dq"):
                what = f"float32 graph with {recipe}'s weights dequantized into it"
        return (
            f"{self.mode} (litert-torch {vers['litert-torch']}, ai-edge-litert {vers['ai-edge-litert']}, "
            f"XNNPACK CPU, {what}; prefill {self.P}, cache {self.S}{self._notes()})"
        )

    def _notes(self) -> str:
        """What the graph lacks (the rows from decode steps) and the kinds asked for, as the name says them."""
        note = ""
        if self.stepped:
            layers = sorted({layer for _, layer in self.stepped if layer is not None})
            parts = [f"layers {', '.join(map(str, layers))}"] if layers else []
            parts += [k for k, layer in self.stepped if layer is None]
            note = f"; prefill rows of {' and '.join(parts)} from decode steps (pruned from the prefill graph)"
        if self.capture is not None:
            tapped = {t.kind for taps in self.taps.values() for t in taps}
            kinds = [k for k in KIND_NAMES if k in tapped or (k in ("embeddings", "k", "v") and self.captures(k))]
            note += f"; --kinds {', '.join(kinds)}: no tensor kept" if kinds else "; tokens and logits only"
            if tapped:
                note += f", {', '.join(k for k in kinds if k in tapped)} as extra graph outputs"
        return note

    # ---------------------------------------------------------------- steps
    def _zero_caches(self) -> dict:
        ins = self.inputs["decode"]
        return {k: np.zeros(shape, np.float32) for k, (shape, _) in ins.items() if k.startswith("kv_cache_")}

    def _embed(self, tokens: list[int], sig_rows: int | None, phase: str):
        """Embeddings and per-layer embeddings of tokens (one row: the decode embedders)."""
        ids = {"token_ids": np.asarray([tokens], np.int32)}
        out = []
        for name in ("embedder", "per_layer_embedder")[: len(self.embedders)]:
            sig = f"prefill_{name}_{sig_rows}" if sig_rows else f"decode_{name}"
            got = self.child.call("run", name, sig, ids, [], phase=phase)[1]
            out.append(next(iter(got.values())))
        return (out + [None])[:2]  # no per_layer_embedder (a model without per-layer inputs): None

    def _mask(self, positions: list[int | None]) -> np.ndarray:
        """The full-attention layers' additive mask: causal, and an image's tokens see each other
        (bidirectional vision attention) as far as this call writes them."""
        m = np.full((1, 1, len(positions), self.S), NEG, np.float32)
        end = max((p for p in positions if p is not None), default=-1) + 1
        for r, p in enumerate(positions):
            if p is not None:
                m[0, 0, r, : p + 1] = 0.0
                blocks = self.images.blocks
                b = blocks[p] if blocks is not None and p < len(blocks) else -1
                if b >= 0:
                    m[0, 0, r, np.flatnonzero(blocks[:end] == b)] = 0.0
        return m

    def _run(self, sig: str, tokens: list[int], start: int, n: int, caches: dict, phase: str, want=None):
        """tokens (n real, padded to the signature's rows) at positions start.. through `sig`;
        return (outputs, rows {(kind, layer): (n, ...) array}, new caches). `want`: the kinds to
        tap (None: all of the signature's)."""
        rows_in = self.P if sig != "decode" else 1
        toks = tokens + [tokens[-1]] * (rows_in - n)
        emb, ple = self._embed(toks, self.P if sig != "decode" else None, phase)
        for r in range(n):  # an image or audio token's embedding: its soft token
            soft = self.images.soft.get(start + r, self.audio.soft.get(start + r))
            if soft is not None:
                emb[0, r] = soft
        pos = np.arange(start, start + rows_in, dtype=np.int32)
        inputs = {
            "embeddings": emb,
            "input_pos": pos,
            "mask": self._mask([start + r if r < n else None for r in range(rows_in)]),
        }
        if "per_layer_embeddings" in self.inputs[sig]:
            inputs["per_layer_embeddings"] = ple
        inputs.update(caches)
        taps = [t for t in self.taps[sig] if want is None or (t.kind, t.layer) in want]
        kept = [(t.index, t.kind, t.layer) for t in taps] if self.keep else []  # read after the run
        got = {}
        outs = self.child.call(
            "run", "model", sig, inputs, kept, phase=phase, tensor=lambda k, l, a: got.__setitem__((k, l), a)
        )[1]
        if not self.keep:  # the rewritten graph returns them
            got = {(t.kind, t.layer): outs[O.output_name(t.index)] for t in taps}
        rows = {}
        for (kind, layer), a in got.items():
            rows[(kind, layer)] = (a[0, 0, :n, : self.max_seq] > ALLOWED_ABOVE) if kind == "mask" else a[0, :n]
        if self.captures("embeddings") if want is None else ("embeddings", None) in want:
            rows[("embeddings", None)] = emb[0, :n]
        new = {k: outs[k] for k in caches}
        for j, layer in self.owners.items() if want is None else ():
            k, v = new[f"{K_CACHE}{j}"][0], new[f"{V_CACHE}{j}"][0]  # (KV, S, D), (KV, D, S)
            if self.captures("k"):
                rows[("k", layer)] = k[:, start : start + n].transpose(1, 0, 2)
            if self.captures("v"):
                rows[("v", layer)] = v[:, :, start : start + n].transpose(2, 0, 1)
        return outs, rows, new

    def _logits(self, outs: dict) -> torch.Tensor:
        x = outs["logits"].reshape(-1)
        if x.shape[0] != self.vocab:
            raise TraceToolError(f"the LiteRT model's logits have {x.shape[0]} entries; REF's vocabulary {self.vocab}")
        return torch.from_numpy(x.astype(np.float32))

    def prefill(self, input_ids, extra_inputs, probe):
        self._load()
        ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        T, phase = len(ids), self.phase(True)
        self.audio.prompt(ids, extra_inputs or {}, probe)
        ids = self.images.prompt(ids, extra_inputs or {}, probe)
        caches, parts = self._zero_caches(), {}
        for c0 in range(0, T - 1, self.P):
            n = min(self.P, T - 1 - c0)
            _, rows, caches = self._run(self.prefill_sig, ids[c0 : c0 + n], c0, n, caches, phase)
            for key, a in rows.items():
                parts.setdefault(key, []).append(a)
        if self.stepped and T > 1 and probe is not None:  # the rows the prefill graph does not hold
            want, aside = set(self.stepped), self._zero_caches()
            for p in range(T - 1):
                _, rows, aside = self._run("decode", [ids[p]], p, 1, aside, phase, want)
                for key, a in rows.items():
                    parts.setdefault(key, []).append(a)
        outs, rows, self.caches = self._run("decode", [ids[-1]], T - 1, 1, caches, phase)
        for key, a in rows.items():
            parts.setdefault(key, []).append(a)
        self.report(probe, ((key, np.concatenate(p) if len(p) > 1 else p[0]) for key, p in parts.items()))
        return self._logits(outs)

    def decode(self, token_id, position, probe):
        outs, rows, self.caches = self._run("decode", [int(token_id)], int(position), 1, self.caches, self.phase(False))
        self.report(probe, rows.items())
        return self._logits(outs)


def create(loaded, max_seq: int, choice):
    return LiteRTRuntime(loaded, max_seq, choice.name, choice.capture)
