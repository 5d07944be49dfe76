"""The `trace` commands, one module each, over gemma4_trace/options.py; what they share is here:
the error contract (a library's TraceToolError is one line and exit 2, never a traceback), --debug,
and the cheap checks that run before anything heavy loads. A command parses its options, calls
one library function and prints what it returns."""

from __future__ import annotations

import functools
import os
import signal
import sys

import click

from gemma4_trace import options as O
from gemma4_trace.traces.errors import TraceToolError, interrupted, one_line

EXIT_DIVERGENCE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_USAGE):
    click.echo(f"error: {one_line(message)}", err=True)
    sys.exit(code)


def echo_lines(text: str) -> None:
    """Print text a line at a time, each made safe (trace text never drives the terminal)."""
    click.echo("\n".join(one_line(line) for line in text.splitlines()))


def _terminate(signum, frame):
    raise KeyboardInterrupt


def debug_enabled() -> bool:
    return O.debug_requested() or os.environ.get("GEMMA4_TRACE_DEBUG", "") not in ("", "0")


def _address_limit() -> str:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return ""
    return f" (under an address-space limit of {soft >> 20} MiB, `ulimit -v`)"


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is memory running out in disguise: ENOMEM from a mapping, a shared library that
    cannot be mapped, or a C extension failing an allocation without saying so under `ulimit -v`."""
    import errno
    import resource

    if isinstance(e, OSError) and e.errno == errno.ENOMEM:
        return True
    text = str(e)
    if isinstance(e, ImportError) and ("failed to map segment" in text or "Cannot allocate memory" in text):
        return True
    limited = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
    return isinstance(e, SystemError) and "without exception set" in text and limited


def user_errors(fn):
    """Map library exceptions to exit codes and one-line messages: never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            return fn(*args, **kwargs)
        except TraceToolError as e:
            # only an explicit chain (`raise ... from e`: a plug-in's exception re-raised by the driver) has a
            # failure to trace; `raise ... from None` (a fault we explained) and a refusal raised while
            # handling another exception (bad UTF-8, say) have none
            if debug_enabled() and e.__cause__ is not None:
                import traceback

                click.echo("".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip(), err=True)
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted; nothing was written", EXIT_INTERRUPTED)
        except MemoryError:
            fail("out of memory" + _address_limit())
        except Exception as e:  # a bug of ours: still one line, the traceback on request
            if interrupted(e):  # Ctrl-C inside C code (h5py) can arrive wrapped in another exception
                fail("interrupted; nothing was written", EXIT_INTERRUPTED)
            if out_of_memory(e):
                fail("out of memory" + _address_limit())
            if debug_enabled():
                raise
            fail(
                f"internal error ({type(e).__name__}: {one_line(e, 200)}); "
                "set GEMMA4_TRACE_DEBUG=1 to see the traceback"
            )
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


def with_progress(label: str, progress, fn, *args, **kwargs):
    """fn(*args, progress=bar, **kwargs) under a progress display (gemma4_trace/progress.py) that
    is closed however fn ends; fn's summary line is printed."""
    from gemma4_trace.progress import Progress

    bar = Progress(label, progress)
    try:
        summary = fn(*args, progress=bar, **kwargs)
        bar.close()
    finally:
        bar.close(completed=False)
    click.echo(one_line(summary))


def beating(label: str, what: str, status=None):
    """A heartbeat line on stderr every 30 s of a long piece of work, off a terminal only
    (gemma4_trace/progress.py heartbeat)."""
    from gemma4_trace.progress import heartbeat

    return heartbeat(label, what, status)


def configure_artifacts(cache_dir, no_cache: bool) -> None:
    """--cache-dir / --no-cache for this command only: the defaults come back when it ends (the
    command may run inside a longer-lived process: a test session, a notebook)."""
    from gemma4_trace.replayer import artifacts

    artifacts.configure(cache_dir, enabled=not no_cache)
    click.get_current_context().call_on_close(artifacts.configure)


def check_model_dir(model_dir) -> None:
    """A --model folder's config.json, read before anything loads (no torch import)."""
    if model_dir is not None:
        from pathlib import Path

        from gemma4_trace.hf.model import read_config_json

        read_config_json(Path(model_dir))


def check_installed(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise TraceToolError(f"{what} needs {module}, which is not installed")


def model_files(model_dir) -> list:
    """The files of a model folder (the embedded one by default): inputs an output must not replace."""
    from gemma4_trace.replayer.artifacts import model_folder_files

    return model_folder_files(model_dir)


def tokenizer_folder(model_dir, model_name: str):
    """Where a trace's tokenizer is: --model, else the embedded model's folder when the trace was
    recorded from it (no torch import), else None."""
    from pathlib import Path

    from gemma4_trace.hf.model import embedded_dir

    if model_dir:
        return Path(model_dir)
    return embedded_dir(model_name)


def selection_of(layers, kinds, steps):
    from gemma4_trace.traces.selection import Selection

    return Selection.parse(layers, kinds, steps)


def load_recipe(path):
    if path is None:
        return None
    from gemma4_trace.analysis.recipe import load_recipe as load

    return load(path)
