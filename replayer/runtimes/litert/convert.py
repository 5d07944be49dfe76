"""`--runtime litert-convert`: transformers' own Gemma 4 forward converted by `litert_torch.convert`
(the generic PyTorch -> LiteRT converter, not the Gemma 4 export path) and run by ai-edge-litert.

The converted program is HF's model over a whole static sequence of max_seq token ids (eager
attention, no cache), with every canonical kind it computes as an extra output: the wrapper below
hooks the places the recorder does, both named by hf/sites.py (the attention function for q, K,
V and the mask, the rotary embedding, each layer's input and output, o_proj's output, the final
norm), so the converted graph returns what HF's forward computes there; with `--kinds` only the
asked kinds become outputs (the rest is pruned from the graph: nothing asked, only the logits). A
step runs the whole sequence (the prompt and the tokens fed so far, padded to max_seq; causal
attention keeps the pad rows out of every real row) and reports the step's rows. Nothing of the
project's runtime is in it: a difference is the converter's (or LiteRT's) alone.

The conversion runs in a child process (it imports TensorFlow) and is kept in the artifact cache:

    python -m gemma4_trace.replayer.runtimes.litert.convert MODEL_DIR MAX_SEQ OUT_DIR [KINDS]
    -> OUT_DIR/hf.tflite, OUT_DIR/outputs.json (the (kind, layer) of each output, in order)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.hf import sites as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.schema import rope_kinds

from ... import functional as F
from ...artifacts import artifact_folder, code_digest, model_hash
from ...child import ChildRuntime
from ..registry import captures
from . import export as E

ENGINE = "gemma4_trace.replayer.runtimes.litert.engine:LiteRTEngine"
FORMAT = 1
EVERY = "*"  # the conversion's KINDS for every kind (else a comma list, empty for none)


class HFSteps(torch.nn.Module):
    """HF's model over (1, S) token ids -> (logits (1, S, vocab), then each captured kind's rows);
    `capture` as RuntimeChoice.capture (None: every kind)."""

    def __init__(self, lm, capture: frozenset[str] | None = None):
        super().__init__()
        self.model, self.buf, self.capture = lm.model, {}, capture
        self.n_layers = S.layer_count(lm.model)
        self.layer_types = list(lm.text_config.layer_types)
        S.install(lm.model, self._put)  # at every module hf/sites.py names
        self.names: list[tuple[str, int | None]] = []

    def _put(self, site, layer, t):
        """A hooked module's tensor: batch 1's rows, by (kind, layer) (per_layer_inputs: one slice per layer)."""
        self.buf[(site.kind, layer)] = t[0]

    def attention(self, original):
        def wrapped(module, query, key, value, attention_mask, **kwargs):
            # the text layers' attention (hf/sites.py), by its attributes: torch.export traces submodules
            # through proxies, so the module is not the object the model holds
            shared = getattr(module, "is_kv_shared_layer", None)
            if shared is not None:
                i = int(module.layer_idx)
                t = S.attention_tensors(query, key, value, attention_mask)
                self.buf[("q", i)] = t["q"][0].transpose(0, 1)
                if not shared:  # a layer that reuses K/V reports none (as the recorder)
                    self.buf[("k", i)] = t["k"][0].transpose(0, 1)
                    self.buf[("v", i)] = t["v"][0].transpose(0, 1)
                if t["mask"] is not None:
                    m = t["mask"][0, 0]
                    self.buf[("mask", i)] = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
            return original(module, query, key, value, attention_mask, **kwargs)

        return wrapped

    def forward(self, ids):
        self.buf = {}
        out = self.model(input_ids=ids, use_cache=False)
        n = self.n_layers
        if ("per_layer_inputs", 0) in self.buf:
            ple = [self.buf.pop(("per_layer_inputs", i)) for i in range(n)]
            self.buf[("per_layer_inputs", None)] = torch.stack(ple, dim=1)
        order = ["embeddings", "per_layer_inputs", *(k for lt in sorted(set(self.layer_types)) for k in rope_kinds(lt))]
        names = [(k, None) for k in order if (k, None) in self.buf]
        for i in range(n):
            names += [(k, i) for k in ("mask", "q", "k", "v", "attn_out", "layer_out") if (k, i) in self.buf]
        names.append(("final_hidden", None))
        self.names = names = [(k, layer) for k, layer in names if captures(self.capture, k)]
        return (S.output_of(S.LOGITS, out), *(self.buf[k].to(torch.float32) for k in names))  # the mask as 0/1


def _convert(model_dir: str, max_seq: int, out_dir: str, kinds: str = EVERY) -> None:
    """The child's work: load the checkpoint, wrap it (KINDS: EVERY, or the kinds to expose as a
    comma list), convert with litert_torch.convert, write the files."""
    import contextlib

    import litert_torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gemma4 import modeling_gemma4

    from gemma4_trace.hf.model import load_model

    lm = load_model(model_dir)
    for c in (lm.model.config, lm.text_config):
        c._attn_implementation = "eager"  # HF's reference attention (repeat_kv, matmul, softmax)
    steps = HFSteps(lm, None if kinds == EVERY else frozenset(k for k in kinds.split(",") if k)).eval()
    ids = torch.full((1, int(max_seq)), int(lm.text_config.pad_token_id or 0), dtype=torch.long)
    ALL_ATTENTION_FUNCTIONS["eager"] = steps.attention(modeling_gemma4.eager_attention_forward)
    with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
        steps(ids)  # learn the outputs' order
        litert_torch.convert(steps, (ids,)).export(str(Path(out_dir) / "hf.tflite"))
    (Path(out_dir) / "outputs.json").write_text(json.dumps([["logits", None], *steps.names]))


def converted(loaded, max_seq: int, capture: frozenset[str] | None = None):
    """The artifact holding HF's forward converted for max_seq rows with `capture`'s kinds as
    outputs (hf.tflite, outputs.json)."""
    kinds = EVERY if capture is None else ",".join(sorted(capture))
    key = {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "max_seq": int(max_seq),
        **F.capture_key(capture),
        "code": code_digest("runtimes/litert/convert.py", "../hf/sites.py"),  # what it hooks: hf/sites.py
        **E.versions(),
    }

    def build(folder: Path) -> None:
        model = str(Path(loaded.model_dir).resolve())
        E.run_tool(
            [sys.executable, "-m", __name__, model, str(int(max_seq)), str(folder), kinds],
            "litert_torch.convert of transformers' Gemma 4 forward",
        )

    return artifact_folder(
        "litert",
        key,
        build,
        what=f"converting {loaded.name}'s HF forward with litert_torch.convert "
        f"(max_seq {max_seq}{F.capture_note(capture)})",
    )


class ConvertedHF(ChildRuntime):
    """The converted HF forward, run over the whole sequence at every step (no cache)."""

    def __init__(self, loaded, max_seq: int, capture: frozenset[str] | None = None):
        vers = E.versions()
        self.start(f"litert-convert (ai-edge-litert {vers['ai-edge-litert']})", ENGINE)
        try:
            art = converted(loaded, max_seq, capture)
            try:
                names = json.loads((art.path / "outputs.json").read_text())
                meta = self.child.call("load", {"hf": str(art.path / "hf.tflite")}, [], phase="loading")[1]
            finally:
                art.close()
        except BaseException:
            self.close()
            raise
        (self.sig,) = meta["hf"]
        (self.input,) = meta["hf"][self.sig][0]
        self.outputs = sorted(meta["hf"][self.sig][1], key=lambda o: int(o.rsplit("_", 1)[-1]))
        self.names = [(k, layer) for k, layer in names]
        if len(self.outputs) != len(self.names):
            raise TraceToolError(f"the converted program has {len(self.outputs)} outputs; expected {len(self.names)}")
        self.S, self.vocab = int(max_seq), int(loaded.text_config.vocab_size)
        self.pad = int(loaded.text_config.pad_token_id or 0)
        self.name = (
            f"litert-convert (litert_torch.convert {vers['litert-torch']} of transformers' Gemma 4 forward, eager "
            f"attention, whole sequence per step; ai-edge-litert {vers['ai-edge-litert']}, XNNPACK CPU, float32)"
        )
        self.ids: list[int] = []

    def _run(self, rows: slice, probe, phase: str) -> torch.Tensor:
        ids = np.full((1, self.S), self.pad, np.int32)
        ids[0, : len(self.ids)] = self.ids
        outs = self.child.call("run", "hf", self.sig, {self.input: ids}, [], phase=phase)[1]
        values = dict(zip(self.names, (outs[o] for o in self.outputs)))
        logits = values.pop(("logits", None))
        values = {k: v > 0.5 if k[0] == "mask" else v for k, v in values.items()}  # the mask travels as 0/1
        self.report(probe, values.items(), rows)
        return torch.from_numpy(np.ascontiguousarray(logits[0, rows.stop - 1], dtype=np.float32))

    def prefill(self, input_ids, extra_inputs, probe):
        self.ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        return self._run(slice(0, len(self.ids)), probe, self.phase(True))

    def decode(self, token_id, position, probe):
        self.ids = self.ids[:position] + [int(token_id)]
        return self._run(slice(position, position + 1), probe, self.phase(False))


def create(loaded, max_seq: int, choice=None):
    return ConvertedHF(loaded, max_seq, None if choice is None else choice.capture)


if __name__ == "__main__":
    _convert(*sys.argv[1:])
