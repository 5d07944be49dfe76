"""Minimal repro: onnxruntime-genai 0.18.0 builds Gemma 4 with a rounded embedding scale.

`onnxruntime_genai.models.builders.gemma.GemmaModel.__init__` writes the scale of the token embeddings
as `np.round(np.sqrt(self.hidden_size), decimals=2)`, and every Gemma builder (Gemma 2, 3 and the
Gemma 4 `Gemma4Model` that `Gemma4UnifiedForConditionalGeneration` checkpoints are built with)
inherits it. transformers multiplies the embeddings by `hidden_size ** 0.5` unrounded. The graph's
scale is off by up to 0.005 / sqrt(hidden) relatively, and so are the logits (by about that much).

Needs onnxruntime-genai 0.18.0 (its builder, and onnx, which the builder needs), onnxruntime, numpy,
torch and transformers 5.24 (nothing else):

    python docs/upstream/onnxruntime_genai_embed_scale_repro.py

It builds a random 2-layer `Gemma4UnifiedForConditionalGeneration` (hidden 32; sliding, full; text
only), runs `python -m onnxruntime_genai.models.builder -i ... -p fp32 -e cpu`, reads the scale the
graph multiplies the embeddings by, and compares the logits of a 6-token prompt and 3 greedy steps
(onnxruntime-genai's Generator) with transformers'; then it sets the graph's constant to
float32(sqrt(32)) and compares again. Expected: the scale sqrt(32) = 5.656854, logits equal to
float32 rounding. Observed: 5.66 and logits off by ~5e-4 (rel-L2), equal to float32 rounding once
the constant is exact. Exit 1 while the bug holds.

Three things of the builder's are set aside here, all unrelated to the bug: transformers 5.24 keeps
Gemma 4's full-attention head_dim in `per_layer_config`, so the builder's `config.head_dim` raises
AmbiguousGlobalPerLayerAttributeError and its `config.global_head_dim` and
`config.num_global_key_value_heads` are missing; `build` below writes the three into config.json as
older transformers releases had them. And the builder loads a tokenizer: a stand-in word-level one is
saved (the repro feeds token ids).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPT = [2, 17, 33, 40, 51, 60]
STEPS = 3
HIDDEN = 32


def build(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration, PreTrainedTokenizerFast

    S, F = "sliding_attention", "full_attention"
    torch.manual_seed(0)
    text = dict(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=[S, F],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        global_head_dim=16,
        sliding_window=4,
        final_logit_softcapping=30.0,
        initializer_range=0.2,
        max_position_embeddings=64,
    )
    config = Gemma4UnifiedConfig(text_config=text, vision_config=None, audio_config=None)
    hf = folder / "hf"
    Gemma4UnifiedForConditionalGeneration(config).save_pretrained(hf)
    saved = json.loads((hf / "config.json").read_text())  # transformers 5.24 (see the docstring)
    saved["text_config"]["allow_global_per_layer_attribute_access"] = True
    saved.update(allow_global_per_layer_attribute_access=True, global_head_dim=16, num_global_key_value_heads=1)
    (hf / "config.json").write_text(json.dumps(saved, indent=2))
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {f"t{i}": i for i in range(4, 128)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    PreTrainedTokenizerFast(tokenizer_object=words, **specials).save_pretrained(hf)
    return hf


def convert(model: Path, out: Path) -> None:
    args = ["-i", str(model), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(out.parent / "cache")]
    r = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", *args], capture_output=True, text=True
    )
    if r.returncode != 0:
        sys.exit(f"the builder failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def embed_scale(onnx_file: Path, value: float | None = None) -> float:
    """The constant /model/embed_tokens/Mul multiplies the embeddings by; set to `value` if given."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_file), load_external_data=False)
    mul = next(n for n in graph.graph.node if n.name == "/model/embed_tokens/Mul")
    const = next(n for n in graph.graph.node if n.op_type == "Constant" and mul.input[1] in n.output)
    tensor = next(a.t for a in const.attribute if a.name == "value")
    if value is not None:
        tensor.CopyFrom(numpy_helper.from_array(np.array(value, dtype=np.float32), tensor.name))
        onnx.save(graph, str(onnx_file))
    return float(numpy_helper.to_array(tensor))


def run(folder: Path, tokens: list[int]) -> np.ndarray:
    """Logits of the prompt (every position) and of each of the given next tokens, fed one by one."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=32, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(PROMPT)
    rows = [generator.get_output("logits")[0]]
    for token in tokens:
        generator.append_tokens([token])
        rows.append(generator.get_output("logits")[0])
    return np.concatenate(rows)


def main() -> int:
    import onnxruntime
    import onnxruntime_genai as og
    import torch
    import transformers
    from transformers import Gemma4UnifiedForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp))
        convert(model, Path(tmp) / "onnx")
        hf = Gemma4UnifiedForConditionalGeneration.from_pretrained(model).eval()
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False)[0]
            want = hf(greedy[None, :-1]).logits[0].numpy()
        tokens = greedy[len(PROMPT) : -1].tolist()
        scale = embed_scale(Path(tmp) / "onnx/model.onnx")
        got = run(Path(tmp) / "onnx", tokens)
        exact = embed_scale(Path(tmp) / "onnx/model.onnx", float(np.sqrt(HIDDEN)))
        fixed = run(Path(tmp) / "onnx", tokens)

    def rel(a: np.ndarray) -> np.ndarray:
        return np.linalg.norm(a - want, axis=-1) / np.linalg.norm(want, axis=-1)

    print(
        f"transformers {transformers.__version__}, onnxruntime-genai {og.__version__}, "
        f"onnxruntime {onnxruntime.__version__}"
    )
    print(f"a Gemma4UnifiedForConditionalGeneration: 2 layers, hidden {HIDDEN}; a prompt of {len(PROMPT)} tokens")
    print(f"embedding scale: transformers sqrt({HIDDEN}) = {np.sqrt(HIDDEN):.7g}; the built graph {scale:.7g}")
    print(f"relative error of the scale: {abs(scale - np.sqrt(HIDDEN)) / np.sqrt(HIDDEN):.2g}")
    print(f"logits vs transformers, rel-L2 by position (prompt, then {STEPS - 1} decode steps):")
    print("  as built:           " + "  ".join(f"{r:.2g}" for r in rel(got)))
    print(f"  scale set to {exact:.7g}: " + "  ".join(f"{r:.2g}" for r in rel(fixed)))
    bug = abs(scale - np.sqrt(HIDDEN)) > 1e-6 * np.sqrt(HIDDEN) and rel(got).min() > 1e-4 and rel(fixed).max() < 1e-5
    print(
        "BUG: the graph scales the embeddings by a rounded sqrt(hidden_size)"
        if bug
        else "fixed: the graph scales the embeddings by sqrt(hidden_size)"
    )
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
