"""Minimal repro: onnxruntime-genai 0.18.0 builds every Gemma4ForConditionalGeneration as a MoE model.

`onnxruntime_genai.models.builder.create_model` picks the Gemma 4 builder by `architectures[0]` only:
`Gemma4ForConditionalGeneration` always gets `Gemma4MoEModel` (the 26B-A4B's builder), whose
`make_mlp` calls `make_moe` on every layer. The dense checkpoints of the same architecture (E2B and
E4B, with per-layer inputs and KV sharing; the 31B, without either) have no experts, so the build
stops at the first layer's missing `post_feedforward_layernorm_1`. (Neither builder has code for
per-layer inputs or KV sharing.) And the MoE graph it does build for a MoE checkpoint sets its
`MoE` op's `activation_type` to "geglu", which onnxruntime 1.32's CPU kernel refuses when the
session is created.

Needs onnxruntime-genai 0.18.0 (its builder, and onnx, which the builder needs), onnxruntime, torch
and transformers 5.24 (nothing else):

    python docs/upstream/onnxruntime_genai_moe_routing_repro.py

It builds three random 4-layer `Gemma4ForConditionalGeneration` checkpoints (text only, hidden 32):
E2B-style (per-layer inputs, the last 2 layers sharing KV), 31B-style (dense, neither) and
26B-A4B-style (4 experts, top 2), runs `python -m onnxruntime_genai.models.builder -i ... -p fp32
-e cpu` on each, and creates an onnxruntime CPU session on the model that builds. Expected: the two
dense checkpoints built by a dense builder (or refused with a message naming what is unsupported),
the MoE model runnable on the CPU provider the builder was asked for. Observed: both dense builds fail
inside `make_moe` with an AttributeError, and the MoE session fails with "Unsupported MoE activation
type: geglu". Exit 1 while the bug holds.

Three things of the builder's are set aside here, all unrelated to the bug: transformers 5.24 keeps
Gemma 4's full-attention head_dim in `per_layer_config`, so the builder's `config.head_dim` raises
AmbiguousGlobalPerLayerAttributeError and its `config.global_head_dim` and
`config.num_global_key_value_heads` are missing; `build` below writes the three into config.json as
older transformers releases had them. And the builder loads a tokenizer: a stand-in word-level one is
saved.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

S, F = "sliding_attention", "full_attention"
TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=[S, F, S, F],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    global_head_dim=16,
    sliding_window=4,
    final_logit_softcapping=30.0,
    initializer_range=0.2,
    max_position_embeddings=64,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
)
KINDS = {
    "E2B-style (per-layer inputs, KV sharing)": dict(
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2
    ),
    "31B-style (dense)": dict(),
    "26B-A4B-style (MoE)": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
}


def build(folder: Path, text: dict) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = Gemma4Config(text_config=TEXT | text, vision_config=None, audio_config=None)
    Gemma4ForConditionalGeneration(config).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())  # transformers 5.24 (see the docstring)
    saved["text_config"]["allow_global_per_layer_attribute_access"] = True
    saved.update(allow_global_per_layer_attribute_access=True, global_head_dim=16, num_global_key_value_heads=1)
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {f"t{i}": i for i in range(4, 128)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    PreTrainedTokenizerFast(tokenizer_object=words, **specials).save_pretrained(folder)
    return folder


def convert(model: Path, out: Path) -> subprocess.CompletedProcess:
    args = ["-i", str(model), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(out.parent / "cache")]
    return subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", *args], capture_output=True, text=True
    )


def builder_picked(r: subprocess.CompletedProcess) -> str:
    """The last two frames of builders/gemma.py the failure went through."""
    frames = [ln.split(", line ")[-1].split(", in ") for ln in r.stderr.splitlines() if "builders/gemma.py" in ln]
    return " -> ".join(f"{name} (line {line})" for line, name in frames[-2:])


def main() -> int:
    import onnx
    import onnxruntime
    import onnxruntime_genai as og
    import transformers

    print(
        f"transformers {transformers.__version__}, onnxruntime-genai {og.__version__}, "
        f"onnxruntime {onnxruntime.__version__}"
    )
    failed_dense, moe_refused = 0, False
    with tempfile.TemporaryDirectory() as tmp:
        for i, (kind, text) in enumerate(KINDS.items()):
            model = build(Path(tmp) / f"hf{i}", text)
            out = Path(tmp) / f"onnx{i}"
            r = convert(model, out)
            print(f"{kind}, architectures {json.loads((model / 'config.json').read_text())['architectures']}:")
            if r.returncode != 0:
                error = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1]
                print(f"  builder: exit {r.returncode}, through gemma.py's {builder_picked(r)}")
                print(f"  {error}")
                failed_dense += "MoE" not in kind and "make_moe" in r.stderr
                continue
            graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
            moe = [n for n in graph.graph.node if n.op_type in ("MoE", "QMoE")]
            activation = {a.name: a.s.decode() for a in moe[0].attribute if a.name == "activation_type"} if moe else {}
            print(f"  builder: exit 0, {len(moe)} MoE nodes, activation_type {activation.get('activation_type')}")
            try:
                onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
                print("  onnxruntime CPU session: created")
            except Exception as e:  # noqa: BLE001 - the refusal is what the repro shows
                message = str(e)
                print(f"  onnxruntime CPU session: {message[message.find('Unsupported') :].strip() or message}")
                moe_refused = "MoE" in kind and "geglu" in message
    bug = failed_dense == 2 or moe_refused
    print(
        f"BUG: {failed_dense} of 2 dense checkpoints routed to the MoE builder; "
        f"the MoE graph {'refused' if moe_refused else 'accepted'} by onnxruntime's CPU kernel"
        if bug
        else "fixed: dense checkpoints get a dense builder and the MoE graph runs on CPU"
    )
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
