"""`trace precision`: keep the most sensitive units at a fallback precision until a target holds."""

from __future__ import annotations

import click

from gemma4_trace import options as O
from gemma4_trace.traces.atomic import check_output_path

from . import beating, configure_artifacts, load_recipe, model_files, user_errors


@click.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@O.quantized_runtime
@click.option(
    "--target",
    required=True,
    help="e.g. 'kl_mean<=0.01 and top1>=0.98' (metrics: kl_mean, kl_p99, top1, layer_out; "
    "baseline: trace diff --baseline BASE of the replay passes)",
)
@O.baseline("BASE.h5 for the target's baseline (as in trace diff --baseline)")
@click.option(
    "--fallback",
    default="float",
    show_default=True,
    help="the precision units kept back get: float, static-w8, or for llama.cpp a GGUF type (e.g. Q8_0)",
)
@O.unit
@O.recipe("a recipe TOML to start from [default: every unit at --runtime]")
@O.model("ref")
@O.output("recipe TOML to write")
@O.force()
@O.cache
@O.debug
@user_errors
def precision(reference, runtime, target, baseline, fallback, granularity, recipe, model_dir, output, force, **cache):
    """Keep the most sensitive units at a fallback precision until a target holds; write the recipe."""
    from gemma4_trace.analysis import precision as P

    configure_artifacts(cache["cache_dir"], cache["no_cache"])
    inputs = [reference, *model_files(model_dir), *(p for p in (recipe, baseline) if p)]
    for path in P.output_paths(runtime, output):  # before the work: never onto an input
        check_output_path(path, force, inputs=inputs)
    plan = P.Plan.check(reference, runtime, target, baseline, fallback, output, force)
    start = load_recipe(recipe)
    with beating("trace precision", "searching for the recipe"):
        text = P.run(plan, granularity, start, model_dir)
    click.echo(text)
