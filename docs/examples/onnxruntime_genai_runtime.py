"""A plug-in runtime: replay a trace through onnxruntime-genai 0.18.0 (its model builder, its Generator).

    PYTHONPATH=docs/examples trace replay REF.h5 --runtime onnxruntime_genai_runtime:make -o RUN.h5

Logits only.

onnxruntime-genai builds every `Gemma4ForConditionalGeneration` with its MoE builder, which fails on a
dense checkpoint (docs/upstream/onnxruntime-genai-moe-routing.md); its dense Gemma 4 builder is reached
through `Gemma4UnifiedForConditionalGeneration` only. So `prepare` writes REF's text weights as a
text-only unified checkpoint (`model.language_model.*`, architectures Gemma4UnifiedForConditionalGeneration),
which that builder reads into transformers' Gemma4UnifiedForCausalLM, runs `python -m
onnxruntime_genai.models.builder -p fp32 -e cpu` on it and drives the built model with a Generator:
`prefill` appends the prompt, each `decode` one token. Dense text decoders only (no per-layer inputs,
KV sharing or MoE: refused before anything is built); the same set-asides as the upstream repro
scripts (transformers 5.24's per-layer head dims, a stand-in tokenizer). `make_exact_scale` sets the
graph's embedding scale to sqrt(hidden_size) after the build (docs/upstream/onnxruntime-genai-embed-scale.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


class OnnxruntimeGenaiRuntime:
    name = "onnxruntime-genai"

    def __init__(self, loaded, max_seq: int, exact_scale: bool = False):
        self.loaded, self.max_seq, self.exact_scale = loaded, max_seq, exact_scale
        self.tmp = None
        self.model = self.generator = None

    def _text(self):
        m = self.loaded.model
        config = getattr(m.config, "text_config", m.config)
        if (
            getattr(config, "hidden_size_per_layer_input", 0)
            or getattr(config, "num_kv_shared_layers", 0)
            or getattr(config, "enable_moe_block", False)
        ):
            raise ValueError("this plug-in runs dense Gemma 4 text decoders only (no PLE, KV sharing or MoE)")
        return m, config

    def prepare(self, input_ids, extra_inputs):
        import onnxruntime_genai as og
        from safetensors.torch import save_file
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        m, config = self._text()
        self.tmp = tempfile.TemporaryDirectory()
        hf, out = Path(self.tmp.name) / "hf", Path(self.tmp.name) / "onnx"
        hf.mkdir()
        weights = {k: v for k, v in m.state_dict().items() if k.startswith("model.")}
        if any(k.startswith("model.language_model.") for k in weights):  # Gemma4ForConditionalGeneration
            state = {k: v for k, v in weights.items() if k.startswith("model.language_model.")}
        else:  # Gemma4ForCausalLM
            state = {"model.language_model." + k[len("model.") :]: v for k, v in weights.items()}
        save_file({k: v.contiguous().float() for k, v in state.items()}, str(hf / "model.safetensors"))
        text = json.loads(config.to_json_string())
        text["model_type"] = "gemma4_unified_text"
        text["allow_global_per_layer_attribute_access"] = True  # transformers 5.24: head dims per layer
        full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
        first = (text.get("per_layer_config") or {}).get(str(full[0]), {}) if full else {}
        global_head_dim = first.get("head_dim", text["head_dim"])
        global_kv = first.get("num_key_value_heads", text["num_key_value_heads"])
        unified = dict(
            architectures=["Gemma4UnifiedForConditionalGeneration"],
            model_type="gemma4_unified",
            text_config=text,
            vision_config=None,
            audio_config=None,
            tie_word_embeddings=True,
            allow_global_per_layer_attribute_access=True,
            global_head_dim=global_head_dim,
            num_global_key_value_heads=global_kv,
        )
        (hf / "config.json").write_text(json.dumps(unified, indent=2))
        vocab = {f"t{i}": i for i in range(config.vocab_size)}
        words = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        specials = dict(bos_token="t2", eos_token="t1", pad_token="t0", unk_token="t3")
        PreTrainedTokenizerFast(tokenizer_object=words, **specials).save_pretrained(hf)
        args = ["-i", str(hf), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(Path(self.tmp.name) / "cache")]
        r = subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", *args], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise RuntimeError("the onnxruntime-genai builder failed: " + r.stderr.strip().splitlines()[-1])
        if self.exact_scale:
            set_embed_scale(out / "model.onnx", float(config.hidden_size**0.5))
        self.model = og.Model(str(out))

    def _logits(self) -> torch.Tensor:
        return torch.from_numpy(self.generator.get_output("logits")[0, -1].copy())

    def prefill(self, input_ids, extra_inputs, probe):
        import onnxruntime_genai as og

        if self.model is None:
            self.prepare(input_ids, extra_inputs)
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_seq, do_sample=False)
        self.generator = og.Generator(self.model, params)
        self.generator.append_tokens(input_ids.tolist())
        return self._logits()

    def decode(self, token_id, position, probe):
        self.generator.append_tokens([int(token_id)])
        return self._logits()

    def close(self):
        self.generator = self.model = None
        if self.tmp is not None:
            self.tmp.cleanup()


def set_embed_scale(onnx_file: Path, value: float) -> None:
    """Set the constant the graph multiplies the embeddings by (the builder writes sqrt(hidden) rounded to
    2 decimals: docs/upstream/onnxruntime-genai-embed-scale.md)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_file), load_external_data=False)
    mul = next(n for n in graph.graph.node if n.name == "/model/embed_tokens/Mul")
    const = next(n for n in graph.graph.node if n.op_type == "Constant" and mul.input[1] in n.output)
    tensor = next(a.t for a in const.attribute if a.name == "value")
    tensor.CopyFrom(numpy_helper.from_array(np.array(value, dtype=np.float32), tensor.name))
    onnx.save(graph, str(onnx_file))


def make(loaded, max_seq):
    """The model as onnxruntime-genai builds it."""
    return OnnxruntimeGenaiRuntime(loaded, max_seq)


def make_exact_scale(loaded, max_seq):
    """The same, its embedding scale set to sqrt(hidden_size) after the build."""
    rt = OnnxruntimeGenaiRuntime(loaded, max_seq, exact_scale=True)
    rt.name = "onnxruntime-genai-exact-scale"
    return rt
