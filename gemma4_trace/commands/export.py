"""`trace export-onnx`, `export-pte`, `export-gguf`, `export-litert`, `export-openvino` and
`export-pt2`: the artifacts a runtime runs (the registry's `export` column), written where the
user wants them, from the artifact cache."""

from __future__ import annotations

import click

from gemma4_trace import options as O
from gemma4_trace.replayer.runtimes.registry import RUNTIMES, check_available, check_export, exporter, parse_runtime

from . import beating, check_model_dir, configure_artifacts, user_errors

PTE = [s.name for s in RUNTIMES if s.export == "export-pte" and not s.name.endswith("-reference")]
LITERT = [s.name for s in RUNTIMES if s.export == "export-litert"]
OPENVINO = [s.name for s in RUNTIMES if s.export == "export-openvino"]


@click.command("export-onnx")
@O.model()
@O.max_seq(required=True, help="static sequence length of the graphs")
@O.output("folder for prefill.onnx and decode.onnx", dest="out_dir", folder=True)
@O.force("existing .onnx files")
@O.cache
@O.debug
@user_errors
def export_onnx_cmd(model_dir, max_seq, out_dir, force, cache_dir, no_cache):
    """Export the static runtime's prefill and decode steps to ONNX (what --runtime onnx runs)."""
    configure_artifacts(cache_dir, no_cache)
    check_model_dir(model_dir)
    check_export("export-onnx")
    from gemma4_trace.replayer.runtimes.onnx import export_command  # torch: after the checks

    with beating("trace export-onnx", "exporting the ONNX graphs"):
        text = export_command(model_dir, max_seq, out_dir, force=force)
    click.echo(text)


@click.command("export-pte")
@O.model()
@O.runtime("float32, or PT2E int8 (XNNPACKQuantizer) calibrated on --calibrate's prompt", choices=PTE, default=PTE[0])
@O.max_seq(required=True, help="static sequence length of the programs")
@click.option("--calibrate", "calibrate", type=click.Path(), help="REF.h5 whose prompt calibrates executorch-int8")
@O.prefill_chunk("a prefill program over N rows (run once per chunk), as replay's --prefill-chunk")
@O.output("folder for the .pte files", dest="out_dir", folder=True)
@O.force("existing .pte files")
@O.cache
@O.debug
@user_errors
def export_pte_cmd(model_dir, runtime, max_seq, calibrate, prefill_chunk, out_dir, force, cache_dir, no_cache):
    """Lower the static runtime's prefill and decode steps to ExecuTorch XNNPACK .pte programs (what
    --runtime executorch runs): prefill.pte and decode.pte, both or neither."""
    configure_artifacts(cache_dir, no_cache)
    check_model_dir(model_dir)
    check_available(runtime)  # the extra installed
    prompt = None
    if calibrate is not None:
        from gemma4_trace.replayer.core import read_reference

        ref = read_reference(calibrate)
        prompt = (ref.prompt_ids, ref.extra)
    from gemma4_trace.replayer.runtimes.executorch import export_command  # torch: after the checks

    with beating("trace export-pte", "lowering the programs"):
        text = export_command(
            model_dir, runtime, max_seq, out_dir, force=force, calibration_prompt=prompt, prefill_chunk=prefill_chunk
        )
    click.echo(text)


@click.command("export-gguf")
@O.model()
@click.option(
    "--type",
    "gguf_type",
    default="F32",
    show_default=True,
    help=f"{', '.join(exporter('export-gguf').types)} (all but F32 need the llamacpp extra)",
)
@O.output("GGUF file to write", file=True)
@O.force()
@O.cache
@O.debug
@user_errors
def export_gguf_cmd(model_dir, gguf_type, output, force, cache_dir, no_cache):
    """Convert the checkpoint to GGUF (what --runtime llama.cpp:TYPE runs), cached by content."""
    configure_artifacts(cache_dir, no_cache)
    check_model_dir(model_dir)
    choice = parse_runtime(f"{exporter('export-gguf').name}:{gguf_type}")  # an unknown type is one line
    check_export("export-gguf")
    from gemma4_trace.replayer.runtimes.llamacpp.runtime import export_command

    with beating("trace export-gguf", "converting (and quantizing) the GGUF file"):
        text = export_command(model_dir, choice.type, output, force=force)
    click.echo(text)


@click.command("export-litert")
@O.model()
@O.runtime("float32, a litert-quantizer recipe, or its dequantized baseline", choices=LITERT, default=LITERT[0])
@O.max_seq(required=True, help="the longest prompt + generation served (the cache length, in whole prefill chunks)")
@O.prefill_chunk("rows of the prefill signature (prefill_N), as replay's --prefill-chunk")
@O.output("folder for the .tflite files (and model.litertlm)", dest="out_dir", folder=True)
@O.force("existing .tflite files")
@O.cache
@O.debug
@user_errors
def export_litert_cmd(model_dir, runtime, max_seq, prefill_chunk, out_dir, force, cache_dir, no_cache):
    """Export the checkpoint with litert-torch's Gemma 4 path (what --runtime litert* runs):
    embedder.tflite, per_layer_embedder.tflite, model.tflite (and model.litertlm for litert)."""
    configure_artifacts(cache_dir, no_cache)
    check_model_dir(model_dir)
    check_available(runtime)
    from gemma4_trace.replayer.runtimes.litert.export import export_command

    with beating("trace export-litert", "converting the LiteRT models"):
        text = export_command(model_dir, runtime, max_seq, out_dir, force=force, prefill_chunk=prefill_chunk)
    click.echo(text)


@click.command("export-openvino")
@O.model()
@O.runtime("float32, NNCF weight compression, or its dequantized baseline", choices=OPENVINO, default=OPENVINO[0])
@O.max_seq(required=True, help="static sequence length of the graphs")
@O.output("folder for prefill.xml/.bin and decode.xml/.bin", dest="out_dir", folder=True)
@O.force("existing .xml/.bin files")
@O.cache
@O.debug
@user_errors
def export_openvino_cmd(model_dir, runtime, max_seq, out_dir, force, cache_dir, no_cache):
    """Convert the static runtime's prefill and decode steps to OpenVINO IR (what --runtime openvino*
    runs): prefill.xml/.bin and decode.xml/.bin, all or none."""
    configure_artifacts(cache_dir, no_cache)
    check_model_dir(model_dir)
    check_available(runtime)
    from gemma4_trace.replayer.runtimes.openvino import export_command

    with beating("trace export-openvino", "converting the OpenVINO IR"):
        text = export_command(model_dir, runtime, max_seq, out_dir, force=force)
    click.echo(text)


@click.command("export-pt2")
@O.model()
@O.max_seq(required=True, help="static sequence length of the programs")
@O.output("folder for prefill.pt2 and decode.pt2", dest="out_dir", folder=True)
@O.force("existing .pt2 files")
@O.debug
@user_errors
def export_pt2_cmd(model_dir, max_seq, out_dir, force):
    """Save the static runtime's prefill and decode steps as torch.export programs (.pt2): the graphs
    Model Explorer opens and `trace diff --node-data FILE --graph decode.pt2` colors."""
    check_model_dir(model_dir)
    from gemma4_trace.replayer.functional import export_pt2_command

    with beating("trace export-pt2", "exporting the programs"):
        text = export_pt2_command(model_dir, max_seq, out_dir, force=force)
    click.echo(text)
