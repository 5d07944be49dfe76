"""`trace export --runtime NAME -o OUT`: the artifacts a runtime runs (its registry row's `export`
facet), written where the user wants them, from the artifact cache. Each family's own command
(`export-onnx`, `export-pte`, `export-gguf`, `export-litert`, `export-openvino`) is an alias of it
with the options it always had; `export-pt2` saves the step graphs for Model Explorer."""

from __future__ import annotations

import click

from gemma4_trace import options as O
from gemma4_trace.replayer.runtimes.registry import ExportRequest, check_export, exporter, exporters, run_export
from gemma4_trace.traces.errors import TraceToolError

from . import beating, check_model_dir, configure_artifacts, user_errors


def export_artifacts(command: str, model_dir, runtime, output, force, cache_dir, no_cache, **given) -> None:
    """What every export command does: the checks before torch loads (the runtime builds artifacts,
    its extra is installed, it takes the options given),
    then its builder, and the summary line. `given`: max_seq, prefill_chunk, calibrate."""
    configure_artifacts(cache_dir, no_cache)
    check_model_dir(model_dir)
    choice = check_export(runtime, command)
    facet, name = choice.spec.export, choice.spec.name
    takes = {"max_seq": facet.max_seq, "prefill_chunk": facet.prefill_chunk, "calibrate": facet.calibrate}
    for key, value in given.items():
        if value is not None and not takes[key]:
            raise TraceToolError(f"trace {command}: --runtime {name} takes no --{key.replace('_', '-')}")
    if facet.max_seq and given.get("max_seq") is None:
        raise TraceToolError(f"trace {command}: --runtime {name} needs --max-seq N (the static length of its graphs)")
    prompt = None
    if given.get("calibrate") is not None:
        from gemma4_trace.replayer.core import read_reference

        ref = read_reference(given["calibrate"])
        prompt = (ref.prompt_ids, ref.extra)
    request = ExportRequest(
        model_dir,
        choice.text,
        choice.type,
        str(output),
        force=force,
        max_seq=given.get("max_seq"),
        prefill_chunk=given.get("prefill_chunk"),
        calibration_prompt=prompt,
    )
    with beating(f"trace {command}", facet.doing):
        text = run_export(choice, request)
    click.echo(text)


EXPORTERS = ", ".join(s.name + ("[:TYPE]" if s.types else "") for s in exporters())


@click.command("export")
@O.model()
@click.option("--runtime", required=True, help=f"the runtime whose artifacts to write: {EXPORTERS}")
@click.option("--max-seq", type=click.IntRange(2, 1_000_000), default=None, help="static sequence length of its graphs")
@click.option(
    "--calibrate", type=click.Path(), help="REF.h5 whose prompt calibrates a quantized build (executorch-int8)"
)
@O.prefill_chunk("a prefill graph over N rows, as replay's --prefill-chunk (where the runtime takes one)")
@O.output("folder (or file, for a GGUF) to write the artifacts into")
@O.force("existing artifacts")
@O.cache
@O.debug
@user_errors
def export_cmd(model_dir, runtime, output, force, cache_dir, no_cache, **given):
    """Write the artifacts a runtime runs (its graphs, programs or files), built into the artifact
    cache first when absent: what `trace replay --runtime NAME` would run."""
    export_artifacts("export", model_dir, runtime, output, force, cache_dir, no_cache, **given)


def alias(name: str) -> click.Command:
    """A family's own export command (`trace export-onnx`, ...): `trace export` with the options its
    rows take, `--runtime` among its rows (`--type` for a runtime with types)."""
    rows = exporter(name)
    first, facet = rows[0], rows[0].export

    def command(model_dir, output, force, cache_dir, no_cache, runtime=first.name, type=None, **given):
        runtime = f"{first.name}:{type}" if type is not None else runtime
        export_artifacts(name, model_dir, runtime, output, force, cache_dir, no_cache, **given)

    options = [O.model()]
    if first.types:
        what = f"{', '.join(first.types)} (all but {first.types[0]} need the {first.extra} extra)"
        options.append(click.option("--type", default=first.types[0], show_default=True, help=what))
    elif len(rows) > 1:
        names = [r.name for r in rows]
        options.append(O.runtime(", ".join(names), choices=names, default=names[0]))
    if facet.max_seq:
        options.append(O.max_seq(required=True, help="static sequence length of its graphs"))
    if facet.calibrate:
        options.append(click.option("--calibrate", type=click.Path(), help="REF.h5 whose prompt calibrates int8"))
    if facet.prefill_chunk:
        options.append(O.prefill_chunk("prefill over N rows, as replay's --prefill-chunk"))
    options += [O.output(facet.output, file=facet.file, folder=not facet.file), O.force(), O.cache, O.debug]
    command.__doc__ = (
        f"Write what --runtime {' / '.join(r.name for r in rows)} runs ({facet.output}), from the artifact cache: "
        f"an alias of `trace export --runtime {first.name}{'[:TYPE]' if first.types else ''}`."
    )
    command = user_errors(command)
    for option in reversed(options):
        command = option(command)
    return click.command(name)(command)


ALIASES = [alias(a) for a in dict.fromkeys(s.export.alias for s in exporters())]


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
