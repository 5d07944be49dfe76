"""`trace repro`: one layer at one step as a standalone repro (numpy + torch only)."""

from __future__ import annotations

import click

from gemma4_trace import options as O
from gemma4_trace.traces.errors import one_line

from . import user_errors


@click.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.argument("candidate", metavar="RUN.h5", type=click.Path())
@click.option("--at", "at", default=None, help="STEP,LAYER to extract [default: the first divergence]")
@click.option(
    "--baseline",
    type=click.Path(),
    default=None,
    help="BASE.h5, a trusted run: the site is the first divergence `trace diff --baseline` finds, and "
    "repro.py reports RUN's excess over BASE",
)
@O.model("ref")
@O.output("folder for repro.py and its .npz files", dest="out_dir")
@O.force("an existing repro in the folder")
@click.option("--onnx", is_flag=True, help="also write the layer as an ONNX graph (layer.onnx; the onnx extra)")
@O.debug
@user_errors
def repro(reference, candidate, at, baseline, model_dir, out_dir, force, onnx):
    """Write a standalone repro (numpy + torch only) of one layer at one step."""
    from gemma4_trace.analysis.repro import check_onnx_export, parse_site, write_repro

    if onnx:
        check_onnx_export()
    site = parse_site(at) if at is not None else None
    click.echo(
        one_line(
            write_repro(
                reference, candidate, out_dir, at=site, model_dir=model_dir, force=force, onnx=onnx, base_path=baseline
            )
        )
    )
