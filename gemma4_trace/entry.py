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
import sys


def _interrupted_while_starting(signum, frame):
    os.write(2, b"error: interrupted\n")
    os._exit(130)  # nothing was started yet: nothing to clean up


signal.signal(signal.SIGINT, _interrupted_while_starting)


def _interrupt_again(unraisable):
    """A Ctrl-C that lands inside a callback whose exceptions Python can only print and ignore (a
    weakref callback run by the garbage collector, a __del__) is delivered again, to the code
    running next, where it unwinds as usual: one line, exit 130, no "Exception ignored" page.
    (Raised from here it would be ignored too: the signal comes again a moment later, when this
    hook and the callback are done.)"""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        import threading

        threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    sys.__unraisablehook__(unraisable)


def main():
    from gemma4_trace.cli import main as cli

    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.unraisablehook = _interrupt_again
    return cli()
