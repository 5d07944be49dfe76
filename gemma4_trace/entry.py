"""The `trace` command's entry point: Ctrl-C is one line and exit 130 from the first instruction.

Importing click, numpy and h5py takes a noticeable moment, and a Ctrl-C during an import
used to print a traceback. The handler is installed when this module is imported (it
imports nothing slow, and neither does the package's __init__), before the CLI is loaded;
once the CLI is loaded, Ctrl-C becomes KeyboardInterrupt again, which the CLI turns into
one line after removing partial outputs. Only the console script and `python -m
gemma4_trace` import this module.
"""

import os
import signal


def _interrupted_while_starting(signum, frame):
    os.write(2, b"error: interrupted\n")
    os._exit(130)  # nothing was started yet: nothing to clean up


signal.signal(signal.SIGINT, _interrupted_while_starting)


def main():
    from gemma4_trace.cli import main as cli

    signal.signal(signal.SIGINT, signal.default_int_handler)
    return cli()
