"""The diff's reading and row sums in worker processes: each worker opens REF and RUN itself,
decodes a block of rows (h5py serialises threads; processes decode side by side) and sends back
only the block's figures (blocks.figures_of: a few numbers per row), never the rows.

The main process walks the tensors in data-flow order as before and takes each block's figures
in that order; the pool keeps a window of blocks ahead of it in flight. A block is submitted
only if it can still matter (the diff's row limit at submission; the limit only shrinks), so
after the first divergence the workers stop reading what the default mode leaves unread. The
figures are the ones the main process would compute itself, so the result is the same.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader

from .blocks import Task, block_figures
from .logits import step_metrics

ENV_WORKERS = "GEMMA4_TRACE_DIFF_WORKERS"
MIN_BYTES = 256 << 20  # both traces together: smaller pairs are diffed in-process (no start-up)
MAX_WORKERS = 3  # ~70 MB each at their peak: the whole diff stays under 500 MB
WINDOW = 3  # blocks in flight per worker


def workers_wanted(ref_path, run_path) -> int:
    """How many worker processes to diff with (0: in this process). GEMMA4_TRACE_DIFF_WORKERS
    sets it (0 or 1: in-process); by default a pair under MIN_BYTES, or a single core, stays
    in-process, and a larger one gets one worker per core up to MAX_WORKERS."""
    text = os.environ.get(ENV_WORKERS, "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = -1
        if not 0 <= n <= 64:
            raise TraceToolError(f"{ENV_WORKERS}={text!r} is not a number of worker processes (0 to 64)")
        return n if n >= 2 else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        size = os.stat(ref_path).st_size + os.stat(run_path).st_size
    except OSError:  # the readers say what is wrong with the paths
        return 0
    return 0 if cores < 2 or size < MIN_BYTES else min(cores, MAX_WORKERS)


def start_method() -> str:
    """fork while this process runs one thread (the workers start at once, with the modules this
    process imported; before any trace is open here); else a fork server, which imports what a
    worker needs once (fork beside other threads can inherit a lock one of them holds)."""
    methods = multiprocessing.get_all_start_methods()
    if threading.active_count() == 1 and "fork" in methods:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


# ------------------------------------------------------------------ worker side
_PATHS: list[str] = []
_READERS: list[TraceReader] = []


def _start(paths: tuple[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _PATHS[:] = paths


def _readers(identities: tuple | None) -> list[TraceReader]:
    """REF and RUN, opened on first use and checked (with `identities`) to be the very files the
    main process opened; an error reaches the main process with the block that met it."""
    if not _READERS:
        _READERS.extend(TraceReader(path) for path in _PATHS)
    if identities is not None:
        for reader, identity in zip(_READERS, identities):
            if reader.identity != identity:
                raise TraceToolError(f"{reader.path} changed while it was being compared; run trace diff again")
    return _READERS


def _open() -> None:
    """A worker's first job: open the traces while the main process opens and plans them."""
    with contextlib.suppress(TraceToolError):  # the main process reports a trace it cannot open
        _readers(None)


def _figures(task: Task, identities: tuple):
    """The block's figures (blocks.block_figures); for a logits block also its logit metrics,
    from the same read: (figures, metrics)."""
    ref, run = _readers(identities)
    rows = slice(task.r0, task.r1)
    a, b = ref.read(task.kind, task.layer, rows), run.read(task.kind, task.layer, rows)
    figures = block_figures(ref, run, task.kind, task.layer, rows, task.n_rows, a, b)
    return (figures, step_metrics(a, b)) if task.logits else figures


# ------------------------------------------------------------------ main side
class BlockPool:
    """Figures of the planned blocks, computed ahead by worker processes, taken in plan order.

    Started before the main process opens the traces (the workers open them meanwhile), then
    given the plan: `plan` yields every block the diff may take, in the order it takes them;
    `wanted(task)` says whether a block can still matter (asked at submission). take() of a block
    the plan skipped computes it then (it cannot happen while `wanted` only ever narrows)."""

    def __init__(self, ref_path, run_path, workers: int):
        method = start_method()
        context = multiprocessing.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload([__name__])
        self._pool = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start, initargs=((str(ref_path), str(run_path)),)
        )
        self._window = WINDOW * workers
        self._futures: OrderedDict[Task, Future] = OrderedDict()
        self._plan: Iterator[Task] = iter(())
        self._wanted: Callable = bool
        self._identities: tuple = ()
        for _ in range(workers):
            self._pool.submit(_open)

    def plan(self, ref: TraceReader, run: TraceReader, plan: Iterator[Task], wanted: Callable) -> None:
        self._plan, self._wanted = plan, wanted
        self._identities = (ref.identity, run.identity)
        self._fill()

    def _submit(self, task: Task) -> None:
        self._futures[task] = self._pool.submit(_figures, task, self._identities)

    def _fill(self) -> None:
        while len(self._futures) < self._window:
            task = next(self._plan, None)
            if task is None:
                return
            if self._wanted(task):
                self._submit(task)

    def take(self, task: Task):
        """The figures of `task`, waiting for its worker; planned blocks before it that were not
        taken are dropped (the diff no longer needs them)."""
        self._fill()
        while task not in self._futures:
            if not self._futures:
                self._submit(task)
                break
            self._drop_first()
            self._fill()
        while next(iter(self._futures)) != task:
            self._drop_first()
        future = self._futures.pop(task)
        self._fill()
        try:
            return future.result()
        except BrokenProcessPool:
            for process in list((self._pool._processes or {}).values()):  # the rest would hold the exit
                process.kill()
            raise TraceToolError(
                f"a diff worker process ended unexpectedly (out of memory?); {ENV_WORKERS}=0 diffs in one process"
            ) from None

    def _drop_first(self) -> None:
        _, future = self._futures.popitem(last=False)
        future.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
