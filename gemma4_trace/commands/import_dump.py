"""`trace import`: a candidate trace from a folder of dumped tensors and a TOML map."""

from __future__ import annotations

import click

from gemma4_trace import options as O

from . import user_errors


@click.command("import")
@click.argument("dump_dir", metavar="DUMP_DIR", type=click.Path())
@click.option(
    "--reference",
    required=True,
    type=click.Path(),
    help="REF.h5: inputs, model metadata (and tokens when the dump has none)",
)
@click.option(
    "--map",
    "map_path",
    required=True,
    type=click.Path(),
    help="TOML map: which file holds which kind, and its layout (docs/import.md)",
)
@O.output("trace file to write")
@O.force()
@O.debug
@user_errors
def import_cmd(dump_dir, reference, map_path, output, force):
    """Build a candidate trace from a folder of dumped tensors (.npy, .safetensors, raw)."""
    from gemma4_trace.importer import import_dump

    click.echo(import_dump(dump_dir, reference, map_path, output, force=force))
