"""`--runtime llama.cpp[:TYPE]`: llama.cpp on the project's GGUF conversion of REF's checkpoint, or
on the user's own GGUF (`--gguf FILE`); and the static runtime on a GGUF's dequantized weights
(`--weights-from FILE`), llama.cpp's natural baseline."""

from __future__ import annotations

from ..captures import Capture, CaptureMap
from ..spec import Baseline, Export, FileInput, RuntimeSpec

ORDER = 30
RT = "gemma4_trace.replayer.runtimes.llamacpp"
# llama.cpp's own type names of the GGUF files a replay can run (gguf_writer.py maps them to
# llama_ftype values); F32 is what the project's writer converts to
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M")
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")

# replayer/runtimes/llamacpp/engine.py: ggml graph nodes, by the names the gemma4 graph's
# cb(tensor, name, layer) gives them; attn_out and the mask are read off the node they feed
LLAMACPP = CaptureMap(
    "llama.cpp's ggml graph nodes (their names)",
    (
        Capture("inp_scaled", "embeddings"),
        Capture("inp_per_layer", "per_layer_inputs"),
        Capture(
            "attn_inp_kq_mask*",
            "mask",
            via="FLASH_ATTN_EXT[3] SOFT_MAX[1]",  # the attention node's mask operand (a graph input)
            layer_from=("Qcur_pos-{layer}*", "kq-{layer}*"),  # that node's first operand
        ),
        Capture("Qcur_pos-{layer}", "q"),
        Capture("Kcur_pos-{layer}", "k"),
        Capture("Vcur_normed-{layer}", "v"),
        Capture("blk.{layer}.attn_output.weight", "attn_out", via="MUL_MAT[0]"),  # the product by o_proj's weight
        Capture("l_out-{layer}", "layer_out"),
        Capture("h_nextn", "final_hidden"),
        Capture("llama_get_logits_ith(-1)", "logits"),
        # the vision tower, run by mtmd from the mmproj (llamacpp/mtmd.py): its gemma4v graph's names
        Capture("pos_embd", "vision.patch_embeddings"),
        Capture("Qcur_pos-{layer}", "vision.q"),
        Capture("Kcur_pos-{layer}", "vision.k"),
        Capture("Vcur_normed-{layer}", "vision.v"),
        Capture("attn_out-{layer}", "vision.attn_out"),
        Capture("ffn_out-{layer}", "vision.mlp_out"),
        Capture("layer_out-{layer}", "vision.layer_out"),
        Capture("pooled", "vision.pooled", via="std_scaled instead where the tower standardizes"),
        Capture("projected", "vision.soft_tokens"),
        # the audio tower, run by mtmd from the mmproj (llamacpp/mtmd_audio.py): its gemma4a graph names no
        # node of its own, so each is found by position: `via` is the chain of ops from the node down to
        # the weight named (a clipped linear's output CLAMP over its MUL_MAT looked through)
        Capture("a.input_projection.weight", "audio.subsampled", via="MUL_MAT[0]"),
        Capture("a.blk.{layer}.ffn_post_norm.weight", "audio.ff1_out", via="ADD[1] SCALE[0] MUL[1]"),
        Capture("a.blk.{layer}.attn_out.weight", "audio.attn_out", via="MUL_MAT[0]"),
        Capture("a.blk.{layer}.conv_pw2.weight", "audio.lconv_out", via="ADD[1] MUL_MAT[0]"),
        Capture("a.blk.{layer}.ffn_post_norm_1.weight", "audio.ff2_out", via="ADD[1] SCALE[0] MUL[1]"),
        Capture("a.blk.{layer}.ln2.weight", "audio.layer_out", via="MUL[1]"),
        Capture("a.pre_encode.out.bias", "audio.output_proj", via="ADD[1]"),
        Capture("mm.a.input_projection.weight", "audio.soft_tokens", via="MUL_MAT[0]"),
    ),
)

RUNTIMES = (
    RuntimeSpec(
        "llama.cpp",
        f"{RT}.runtime:create",
        "llama.cpp on the project's GGUF conversion, TYPE `F32` (default) ... `Q3_K_M`",
        "float (F32, F16, BF16) or quantized (llama.cpp's kernels)",
        extra="llamacpp",
        needs=("llama_cpp", "gguf"),
        types=GGUF_TYPES,
        float_types=FLOAT_GGUF_TYPES,
        float32_only=True,
        weightless=True,
        native_audio_features=True,  # mtmd's own log-mel front end, from the waveform (--audio FILE)
        capture_map=LLAMACPP,
        profile="llamacpp-f32",
        export=Export(
            "export-gguf",
            f"{RT}.runtime:export_command",
            "GGUF file to write",
            "converting (and quantizing) the GGUF file",
            file=True,
            max_seq=False,
        ),
        artifacts=".gguf files",
        doc="docs/runtime-llamacpp.md",
        recipe=f"{RT}.gguf_mixed:from_recipe",
        baseline=Baseline("static", weights="--weights-from"),
    ),
)

FILES = (
    FileInput(
        "--gguf",
        "llama.cpp",
        "a GGUF file",
        "run this GGUF file in llama.cpp (extra [llamacpp])",
        f"{RT}.gguf_reader:read_header",
        f"{RT}.runtime:run_gguf",
        extra="llamacpp",
        needs=("gguf", "llama_cpp"),
        float32_only=True,
    ),
    FileInput(
        "--mmproj",
        "llama.cpp",
        "an mmproj GGUF file",
        "the vision tower from this mmproj GGUF, with --runtime llama.cpp or --gguf (extra [llamacpp])",
        f"{RT}.gguf_mmproj:read_header",
        f"{RT}.runtime:check_mmproj",
        extra="llamacpp",
        needs=("gguf", "llama_cpp"),
        float32_only=True,
        companion=True,
    ),
    FileInput(
        "--audio",
        "llama.cpp",
        "an audio file",
        "the clip REF was recorded from, for --audio-features native with --runtime llama.cpp (or --gguf) or litert-lm",
        f"{RT}.audio:read_audio",
        f"{RT}.audio:check_audio",
        extra="llamacpp",
        needs=("gguf", "llama_cpp"),
        float32_only=True,
        companion=True,
    ),
    FileInput(
        "--weights-from",
        "static",
        "a GGUF file",
        "static runtime on this GGUF's weights, dequantized (extra [llamacpp])",
        f"{RT}.gguf_reader:read_header",
        f"{RT}.runtime:static_on_weights",
        extra="llamacpp",
        needs=("gguf",),
        weightless=False,
        float32_only=True,
    ),
)
