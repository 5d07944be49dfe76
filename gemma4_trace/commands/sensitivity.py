"""`trace sensitivity`: rank quantized units by their effect on REF's replay."""

from __future__ import annotations

import click

from gemma4_trace import options as O
from gemma4_trace.traces.atomic import check_output_path

from . import beating, configure_artifacts, echo_lines, load_recipe, model_files, user_errors


@click.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@O.quantized_runtime
@O.unit
@O.recipe("a recipe TOML: the quantized configuration to start from [default: every unit at --runtime]")
@click.option(
    "--replays",
    type=click.IntRange(0, 10_000),
    default=4,
    show_default=True,
    help="full replays (only quantized, only float) for this many units, the isolated ranking's first",
)
@O.model("ref")
@O.as_json()
@O.report
@O.force("an existing --report file")
@O.cache
@O.debug
@user_errors
def sensitivity(reference, runtime, granularity, recipe, replays, model_dir, as_json, report, force, **cache):
    """Rank quantized units by their effect: only one unit quantized, or only one kept in float."""
    import json
    from pathlib import Path

    from gemma4_trace.analysis.runner import make_runner
    from gemma4_trace.analysis.sensitivity import format_sensitivity
    from gemma4_trace.analysis.sensitivity import sensitivity as run_sensitivity
    from gemma4_trace.analysis.sensitivity_report import write_sensitivity_html

    configure_artifacts(cache["cache_dir"], cache["no_cache"])
    if report:  # before the work: never onto an input
        check_output_path(report, force, inputs=[reference, *model_files(model_dir), *([recipe] if recipe else [])])
    runner = make_runner(reference, runtime, model_dir, load_recipe(recipe))
    try:
        with beating("trace sensitivity", "replaying with one unit changed at a time"):
            result = run_sensitivity(runner, granularity, replays)
    finally:
        runner.close()
    summary = format_sensitivity(result, Path(reference).name)
    if report:
        write_sensitivity_html(result, summary, Path(reference).name, report, force)
    echo_lines(json.dumps(result.to_json(), indent=2) if as_json else summary)
