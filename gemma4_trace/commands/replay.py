"""`trace replay`: run a static-shape runtime on REF's inputs and write a candidate trace."""

from __future__ import annotations

import click

from gemma4_trace import options as O
from gemma4_trace.traces.atomic import check_output_path

from . import check_model_dir, configure_artifacts, load_recipe, model_files, selection_of, user_errors, with_progress


def file_options(fn):
    """An option per file input of the registry (--gguf, --weights-from, --litertlm, ...)."""
    from gemma4_trace.replayer.runtimes.registry import FILES

    for f in reversed(FILES):
        fn = click.option(f.option, f.dest, type=click.Path(), default=None, help=f.help)(fn)
    return fn


@click.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@O.model("ref")
@O.runtime()
@O.max_seq()
@click.option(
    "--teacher-forcing/--free-running", default=True, show_default=True, help="feed REF's tokens, or the runtime's own"
)
@click.option(
    "--isolate", is_flag=True, help="feed every layer REF's input: each layer's error is its own (teacher-forced)"
)
@O.device("where the model and the static runtime run")
@O.prefill_chunk("static and executorch runtimes: prefill in chunks of N rows, shapes (N, max_seq)")
@O.output("trace file to write")
@O.force()
@O.debug
@O.recipe("precision recipe TOML (trace precision) for a quantized static runtime or llama.cpp:TYPE")
@file_options
@click.option(
    "--audio-features",
    type=click.Choice(["hf", "native"]),
    default="hf",
    show_default=True,
    help="an audio REF: feed HF's log-mel features (REF's), or let the engine compute its own from --audio FILE "
    "(llama.cpp, litert-lm)",
)
@click.option(
    "--allow-config-mismatch",
    is_flag=True,
    help="replay a file of yours whose metadata differs from REF's model config",
)
@O.cache
@O.progress()
@O.selection
@user_errors
def replay(
    reference, model_dir, runtime, teacher_forcing, isolate, output, force, layers, kinds, steps, progress, **kw
):
    """Run a static-shape runtime on REF's inputs and write a candidate trace."""
    from gemma4_trace.replayer.runtimes.registry import FILE_BY_DEST, check_available, parse_runtime

    choice = check_available(parse_runtime(runtime), isolate)  # a typo is refused before torch or the model loads
    configure_artifacts(kw.pop("cache_dir"), kw.pop("no_cache"))  # before any runtime builds an artifact
    recipe, files = kw.pop("recipe"), {dest: kw.pop(dest) for dest in FILE_BY_DEST}
    inputs = [reference, *model_files(model_dir), *[p for p in (recipe, *files.values()) if p]]
    check_output_path(output, force, inputs=inputs)
    check_model_dir(model_dir)
    make = None
    if recipe is not None:
        from gemma4_trace.analysis.recipe import recipe_factory

        make = recipe_factory(runtime, load_recipe(recipe))
    from gemma4_trace.replayer.replay import ReplayOptions, replay_trace  # torch: after the checks

    with_progress(  # the summary names the runtime, which a plug-in chose: printed as one safe line
        "replaying",
        progress,
        lambda progress=None: replay_trace(
            reference,
            output,
            ReplayOptions(
                model_dir=model_dir,
                runtime=choice,
                mode="teacher-forced" if teacher_forcing else "free-running",
                force=force,
                isolate=isolate,
                selection=selection_of(layers, kinds, steps),
                make=make,
                files=files,
                progress=progress,
                **kw,
            ),
        ),
    )
