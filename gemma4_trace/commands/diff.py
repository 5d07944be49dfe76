"""`trace diff` (the first divergence between two traces) and `trace calibrate` (tolerances from
known-good runs)."""

from __future__ import annotations

import sys

import click

from gemma4_trace import options as O
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError, one_line

from . import EXIT_DIVERGENCE, echo_lines, tokenizer_folder, user_errors


@click.command("diff")
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.argument("candidate", metavar="RUN.h5", type=click.Path())
@O.tolerances
@O.as_json("print the JSON report instead of text")
@O.report
@O.force("an existing --report file")
@O.model("tokenizer")
@O.baseline()
@O.baseline_factor
@click.option(
    "--full",
    is_flag=True,
    help="compare every row of every tensor, also after the first divergence (the whole error map)",
)
@click.option(
    "--node-data",
    type=click.Path(),
    help="write a Model Explorer node-data overlay (JSON) of the error per kind on --graph's nodes",
)
@click.option(
    "--graph",
    "graph_path",
    type=click.Path(),
    help="the graph --node-data is for: a LiteRT .tflite (trace export-litert) or a .pt2 (trace export-pt2)",
)
@O.debug
@user_errors
def diff_cmd(
    reference,
    candidate,
    tolerances,
    as_json,
    report,
    force,
    model_dir,
    baseline,
    baseline_factor,
    full,
    node_data,
    graph_path,
):
    """Find the first divergence between two traces (exit 1 if they diverge)."""
    import json
    from pathlib import Path

    from gemma4_trace.diff import diff_traces, format_text, write_html
    from gemma4_trace.hf.model import decoder_for

    if (node_data is None) != (graph_path is None):
        raise TraceToolError("--node-data FILE.json and --graph MODEL go together")
    if node_data:
        check_output_path(node_data, force, inputs=[reference, candidate, graph_path])
    if report:  # before the work: never onto an input, a device or a FIFO
        check_output_path(
            report, force, inputs=[reference, candidate, tolerances, model_dir and Path(model_dir) / "tokenizer.json"]
        )
    result = diff_traces(reference, candidate, tolerances, baseline, baseline_factor, full=full)
    if baseline is None and not result.match:
        note = quantized_run_note(result.candidate.runtime)
        if note:
            result.notes.append(note)
    folder = tokenizer_folder(model_dir, result.reference.model_name)
    decode = decoder_for(folder / "tokenizer.json" if folder else None)
    if decode is not None:
        result.tokens.reference_text = decode(result.tokens.reference)
        result.tokens.candidate_text = decode(result.tokens.candidate)
    written = []  # said on stderr after the report itself: stdout stays the text or the JSON
    if report:
        write_html(result, report, force=force)
        written.append(f"wrote {report} (the HTML report)")
    if node_data:
        from gemma4_trace.replayer.node_data import write_node_data

        positions = write_node_data(result, graph_path, node_data, force=force)
        built = f", a graph of {positions} positions" if positions is not None else ""
        written.append(f"wrote {node_data} (Model Explorer node data over {Path(graph_path).name}{built})")
    echo_lines(json.dumps(result.to_json(), indent=2) if as_json else format_text(result))
    for line in written:
        click.echo(one_line(line), err=True)
    sys.exit(0 if result.match else EXIT_DIVERGENCE)


@click.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.argument("bases", metavar="BASE.h5...", nargs=-1, required=True, type=click.Path())
@O.output("tolerances TOML file to write")
@O.margin
@O.force()
@O.debug
@user_errors
def calibrate(reference, bases, output, margin, force):
    """Write tolerances from known-good runs: `trace diff REF BASE --tolerances` then matches."""
    from gemma4_trace.diff.calibrate import write_calibration

    click.echo(one_line(write_calibration(reference, list(bases), output, margin=margin, force=force)))  # names OUT


def quantized_run_note(runtime: str) -> str | None:
    """A RUN of a quantized runtime diffed without --baseline: one line on judging it by a baseline."""
    from gemma4_trace.replayer.runtimes.registry import quantized_runtime

    spec = quantized_runtime(runtime)
    if spec is None:
        return None
    how = (spec.baseline or "").replace("--weights-from", "--weights-from FILE.gguf")
    base = f" (BASE: trace replay REF --runtime {how})" if how else ""
    return (
        f"RUN ran {runtime}, a quantized runtime: against REF alone every difference its quantization makes "
        f"diverges; judge it by a trusted run of the same quantization with --baseline BASE{base}, or by "
        "tolerances calibrated on one (trace calibrate); see docs/quantized.md"
    )
