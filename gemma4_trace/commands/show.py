"""`trace show`: a readable summary of a trace, or its content hash."""

from __future__ import annotations

import click

from gemma4_trace import options as O

from . import tokenizer_folder, user_errors


@click.command()
@click.argument("trace_path", metavar="TRACE.h5", type=click.Path())
@click.option("--hash", "show_hash", is_flag=True, help="print the content hash only")
@O.model("tokenizer")
@O.debug
@user_errors
def show(trace_path, show_hash, model_dir):
    """Print a readable summary of a trace."""
    from gemma4_trace.hf.model import decoder_for
    from gemma4_trace.show import summarize
    from gemma4_trace.traces.reader import TraceReader

    with TraceReader(trace_path) as r:
        if show_hash:
            click.echo(r.content_hash())
            return
        folder = tokenizer_folder(model_dir, r.provenance["model_name"])
        click.echo(summarize(r, decoder_for(folder / "tokenizer.json" if folder else None)))
