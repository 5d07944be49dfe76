"""Minimal repro: litert-torch 0.10.0 writes Gemma 4's LiteRT-LM vision metadata for a 3 x 3 pooling kernel.

`export_hf --export_vision_encoder` (Gemma 4) bundles the vision graphs into model.litertlm with the
Gemma4 LlmModelType metadata its model_ext/gemma4/metadata_builder.py builds: `max_num_patches` is
hard-coded to 3 * 3 * gemma4_vision_max_soft_tokens ("TODO ... hardcoded") and `pooling_kernel_size`
is never set (0). LiteRT-LM then cuts an image into patches for a 3 x 3 pooling kernel, which is not
the checkpoint's `vision_config.pooling_kernel_size` wherever that is not 3.

    python litert_torch_litertlm_vision_metadata_repro.py [MODEL_DIR]          # the metadata (seconds)
    python litert_torch_litertlm_vision_metadata_repro.py MODEL_DIR --run IMAGE  # + LiteRT-LM on the bundle

MODEL_DIR: a Gemma 4 save_pretrained folder with its processor and tokenizer (default: this
repository's tiny model, hf/tiny_model; pooling kernel 2, 70 soft tokens an image). Needs
transformers 5.24 and litert-torch 0.10.0 (`--run`: litert-lm-api 0.18.1 too, about 2 minutes).
`--run` exports with `--export_vision_encoder` (the adapter's sample width patched where the tower is
not 3 p^2 wide: litert-torch-gemma4-vision-adapter.md), asks LiteRT-LM for the image, then rebuilds the
bundle with the two fields set from the checkpoint and asks again. Exits 1 while the metadata is wrong.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from litert_lm_builder.runtime.proto import llm_metadata_pb2
from litert_torch.generative.export_hf.model_ext.gemma4 import metadata_builder
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]


def metadata(model_dir: Path, soft: int):
    """The Gemma4 metadata litert-torch's package step writes for a vision export."""
    src = SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        image_processor=AutoImageProcessor.from_pretrained(model_dir),
    )
    cfg = SimpleNamespace(extra_kwargs={"gemma4_vision_max_soft_tokens": soft})
    out = SimpleNamespace(vision_encoder_model_path="vision_encoder.tflite", audio_encoder_model_path=None)
    return metadata_builder.build_llm_metadata(src, cfg, out, llm_metadata_pb2.LlmMetadata()).llm_model_type.gemma4


def run(model_dir: Path, image: str, soft: int, k: int) -> None:
    """The real export and LiteRT-LM on it: the bundle as written, then with the fields set."""
    import litert_lm as L
    import litert_lm_builder as B
    import torch
    from litert_torch.generative.export_hf import export as X
    from litert_torch.generative.export_hf.model_ext.gemma4 import vision_exportable as V

    width = int(AutoConfig.from_pretrained(model_dir).vision_config.hidden_size)

    def sample(self, model_config, **kw):  # litert-torch-gemma4-vision-adapter.md's fix
        return {f"vision_adapter_{soft}": ({"soft_tokens": torch.zeros(1, soft, width)}, {})}

    V.LiteRTExportableModuleForGemma4VisionAdapter.get_sample_inputs = sample
    out = Path(tempfile.mkdtemp())
    X.export(
        str(model_dir),
        str(out),
        task="image_text_to_text",
        prefill_lengths=[96],
        cache_length=96,
        quantization_recipe="none",
        externalize_embedder=True,
        keep_temporary_files=True,
        export_vision_encoder=True,
        gemma4_vision_max_soft_tokens=soft,
    )
    md = llm_metadata_pb2.LlmMetadata.FromString((out / "llm_metadata.pb").read_bytes())
    md.llm_model_type.gemma4.pooling_kernel_size, md.llm_model_type.gemma4.max_num_patches = k, k * k * soft
    (out / "llm_metadata_fixed.pb").write_bytes(md.SerializeToString())
    b = B.LitertLmFileBuilder()
    b.add_llm_metadata(str(out / "llm_metadata_fixed.pb"))
    b.add_executor_metadata(str(out / "executor_metadata.pb"))
    b.add_hf_tokenizer(str(out / "tokenizer.json"))
    T = B.TfLiteModelType
    for name, kind in [
        ("model", T.PREFILL_DECODE),
        ("embedder", T.EMBEDDER),
        ("per_layer_embedder", T.PER_LAYER_EMBEDDER),
        ("vision_encoder", T.VISION_ENCODER),
        ("vision_adapter", T.VISION_ADAPTER),
        ("eoi", T.END_OF_VISION),
    ]:
        b.add_tflite_model(str(out / f"{name}.tflite"), kind)
    with open(out / "fixed.litertlm", "wb") as f:
        b.build(f)
    greedy = L.interfaces.SamplerConfig(top_k=1, temperature=0.0)
    msg = {
        "role": "user",
        "content": [{"type": "image", "path": image}, {"type": "text", "text": "Describe the image."}],
    }
    for bundle in ("model.litertlm", "fixed.litertlm"):
        cpu = L.interfaces.Backend.CPU()
        e = L.Engine(str(out / bundle), backend=cpu, max_num_tokens=96, max_num_images=1, vision_backend=cpu)
        try:
            reply = e.create_conversation(sampler_config=greedy).send_message(msg)["content"][0]["text"]
        except RuntimeError as err:  # the reason is on stderr (LiteRT-LM's log): "TensorBuffer host memory ..."
            reply = f"{err} (LiteRT-LM's log above says why)"
        print(f"{bundle}: {reply}", flush=True)
        e.close()


def main() -> int:
    model_dir = Path(sys.argv[1]) if sys.argv[1:] and sys.argv[1] != "--run" else ROOT / "hf" / "tiny_model"
    vision = AutoConfig.from_pretrained(model_dir).vision_config
    soft = int(AutoImageProcessor.from_pretrained(model_dir).max_soft_tokens)
    k = int(vision.pooling_kernel_size)
    g = metadata(model_dir, soft)
    print(
        f"litert-torch's Gemma4 metadata: max_num_patches {g.max_num_patches} (3 * 3 * {soft}), pooling_kernel_size "
        f"{g.pooling_kernel_size}; the checkpoint: pooling_kernel_size {k}, {k} * {k} * {soft} = {k * k * soft} patches"
    )
    if "--run" in sys.argv:
        run(model_dir, sys.argv[sys.argv.index("--run") + 1], soft, k)
    return 1 if (g.pooling_kernel_size, g.max_num_patches) != (k, k * k * soft) else 0


if __name__ == "__main__":
    sys.exit(main())
