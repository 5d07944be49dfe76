"""`trace sweep`: record, replay and diff every prompt of a set, with statistics over all."""

from __future__ import annotations

import sys

import click

from gemma4_trace import options as O
from gemma4_trace.traces.errors import TraceToolError, one_line

from . import (
    EXIT_DIVERGENCE,
    EXIT_INTERRUPTED,
    beating,
    check_model_dir,
    configure_artifacts,
    echo_lines,
    fail,
    user_errors,
)


@click.command()
@click.argument("prompts_path", metavar="PROMPTS", type=click.Path())
@click.option("--runtime", default=None, help="the runtime to judge (as `trace replay --runtime`); or give --gguf")
@click.option(
    "--gguf",
    type=click.Path(),
    default=None,
    help="judge llama.cpp on this GGUF file as it is (your own conversion; as `trace replay --gguf`)",
)
@click.option(
    "--baseline-runtime",
    default=None,
    help="a trusted runtime also replayed on every prompt; RUN diverges only outside its error envelope; "
    "'auto': the runtime's own baseline (llama.cpp and --gguf: the static runtime on the file's "
    "dequantized weights; mlx-q4: mlx-q4-dq; ...)",
)
@O.model()
@O.max_new_tokens
@O.no_chat("text prompts as raw text, without the chat template")
@click.option("--workers", type=click.IntRange(1, 1024), default=1, show_default=True, help="processes on this machine")
@click.option(
    "--ray",
    "ray_address",
    default=None,
    help="one Ray task per prompt: 'auto' (the running cluster) or its ADDRESS (extra [cluster])",
)
@click.option(
    "--shared-dir/--no-shared-dir",
    "shared_dir",
    default=None,
    help="with --ray: tasks write DIR themselves, or return their files to be written here "
    "[default: each task checks whether it sees DIR]",
)
@click.option(
    "--keep-traces", is_flag=True, help="also keep each prompt's REF, RUN (and BASE) traces under DIR/prompts"
)
@click.option(
    "--skip-unsupported",
    is_flag=True,
    help="leave out the prompts the runtime cannot run (an image for a text decoder), listed as skipped "
    "[default: refuse the sweep, naming them]",
)
@O.tolerances
@O.baseline_factor
@O.output("folder for the results", dest="out_dir")
@O.force("a summary.json / summary.html in DIR that is not an earlier sweep's")
@O.progress("a line on stderr per finished prompt [default: only on a terminal]")
@O.cache
@O.debug
@user_errors
def sweep(prompts_path, runtime, baseline_runtime, model_dir, no_chat, workers, ray_address, out_dir, progress, **kw):
    """Record, replay and diff every prompt of a set; KL, top-1 and perplexity statistics over all (exit 1 if any
    prompt diverges)."""
    from pathlib import Path

    from gemma4_trace.analysis import sweep as S
    from gemma4_trace.analysis.prompts import read_prompts
    from gemma4_trace.analysis.sweep_pool import check_ray
    from gemma4_trace.analysis.sweep_report import exit_code
    from gemma4_trace.diff.baseline import check_factor
    from gemma4_trace.diff.tolerances import load_tolerances

    configure_artifacts(kw.pop("cache_dir"), kw.pop("no_cache"))
    prompts = read_prompts(prompts_path)  # cheap checks first: nothing heavy loads before they pass
    gguf = kw.pop("gguf")
    runtime = S.check_runtimes(runtime, baseline_runtime, gguf)
    if ray_address is not None:
        if workers != 1:
            raise TraceToolError("give --workers or --ray, not both")
        check_ray(ray_address)
    skipped = S.unsupported(prompts, (runtime, None if baseline_runtime == S.AUTO else baseline_runtime))
    prompts = runnable(prompts, skipped, kw["skip_unsupported"], prompts_path)
    check_model_dir(model_dir)
    load_tolerances(kw["tolerances"])
    if baseline_runtime is not None:
        check_factor(kw["baseline_factor"])
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TraceToolError(f"output {out} is a file; give a folder")
    S.check_not_written(Path(prompts_path), out)
    S.check_summary(out, kw["force"])
    if (out / "prompts").exists() and not (out / "prompts").is_dir():
        raise TraceToolError(f"{out / 'prompts'} is not a folder; the sweep keeps each prompt's files there")
    cfg = S.configure(
        model_dir,
        runtime,
        baseline_runtime,
        kw["max_new_tokens"],
        not no_chat,
        kw["tolerances"],
        kw["baseline_factor"],
        kw["keep_traces"],
        gguf=gguf,
    )
    loud = progress if progress is not None else sys.stderr.isatty()
    say = (lambda line: click.echo(one_line(line), err=True)) if loud else None

    def finished() -> int:  # prompts with their JSON written (resumed ones too)
        return len(list((out / "prompts").glob("*.json"))) if (out / "prompts").is_dir() else 0

    def done_count() -> str:  # the heartbeat's status
        return f"{finished()} of {len(prompts)} prompts done"

    try:
        with beating("trace sweep", "running the prompts", done_count if not loud else None):
            outcome = S.run_sweep(
                prompts,
                cfg,
                out,
                workers=workers,
                ray_address=ray_address,
                say=say,
                shared=kw["shared_dir"],
                skipped=skipped,
            )
    except KeyboardInterrupt:
        done = finished()
        fail(f"interrupted; {done} finished prompt(s) kept in {out}/prompts (run again to resume)", EXIT_INTERRUPTED)
    echo_lines(S.describe(outcome))
    sys.exit(EXIT_DIVERGENCE if exit_code(outcome.summary) else 0)


def runnable(prompts: list[dict], skipped: list[dict], skip_unsupported: bool, prompts_path) -> list[dict]:
    """The prompts the runtime can run: the rest (`skipped`) refused unless --skip-unsupported."""
    if skipped and not skip_unsupported:
        ids = ", ".join(s["id"] for s in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        raise TraceToolError(
            f"{len(skipped)} of {len(prompts)} prompts cannot run ({skipped[0]['reason']}): {ids}; "
            "pass --skip-unsupported to sweep the rest"
        )
    if len(skipped) == len(prompts):
        raise TraceToolError(f"no prompt of {prompts_path} can run: {skipped[0]['reason']}")
    left_out = {s["id"] for s in skipped}
    return [p for p in prompts if p["id"] not in left_out]
