"""The `trace` command: a thin click group over one module per command (gemma4_trace/commands/).

Library errors (TraceToolError) become one line on stderr and exit 2; `trace diff` exits 1 when
it finds a divergence; Ctrl-C exits 130 with one line. Heavy imports happen inside each command.
"""

from __future__ import annotations

import click

from gemma4_trace import options as O

from .commands import EXIT_INTERRUPTED, fail
from .commands.diff import calibrate, diff_cmd
from .commands.export import ALIASES, export_cmd, export_pt2_cmd
from .commands.import_dump import import_cmd
from .commands.precision import precision
from .commands.record import record
from .commands.replay import replay
from .commands.repro import repro
from .commands.sensitivity import sensitivity
from .commands.show import show
from .commands.sweep import sweep


class _OneLineErrors(click.Group):
    """click's usage errors as one line (`error: ...`, exit 2) instead of a usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
        except click.ClickException as e:
            hint = f" (see '{e.ctx.command_path} --help')" if getattr(e, "ctx", None) else ""
            fail(e.format_message().replace("\n", " ") + hint, e.exit_code)
        except click.Abort:
            fail("interrupted", EXIT_INTERRUPTED)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gemma4-trace")
@click.option("--debug", is_flag=True, help=O.DEBUG_HELP)
def main(debug):
    """Record, replay and diff layer-by-layer traces of Gemma 4."""
    O.reset_debug(debug)


for command in (
    record,
    show,
    replay,
    export_cmd,
    *ALIASES,
    import_cmd,
    diff_cmd,
    calibrate,
    export_pt2_cmd,
    repro,
    sensitivity,
    precision,
    sweep,
):
    main.add_command(command)
