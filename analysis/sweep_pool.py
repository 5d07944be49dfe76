"""`trace sweep`'s workers beyond this process: a spawn process pool (`--workers N`) or Ray tasks
(`--ray`); each runs analysis/sweep_worker.py's process_prompt and hands the driver's (analysis/sweep.py)
`done` its outcome."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

from gemma4_trace.traces.atomic import clean_stale_partials
from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line

from .sweep_worker import TOKEN_FILE, PromptFailed, process_prompt, prompt_outcome, write_atomic


def init_pool(threads: int) -> None:
    """A pool worker: Ctrl-C is the driver's (it ends the workers with SIGTERM), and SIGTERM ends the
    prompt at hand through its `finally` blocks, so no temporary folder or partial REF is left."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _terminated)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked while the driver started it
    torch.set_num_threads(threads)


_stopping = False  # this worker was told to stop (SIGTERM)


def _terminated(signum, frame):
    """The first SIGTERM ends the prompt at hand; a later one (the pool's manager terminates every
    worker once one has exited) must not cut that prompt's clean-up short: the driver SIGKILLs a
    worker that outlives its grace, and then removes what it left."""
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise SystemExit(128 + signum)


def pool_task(cfg, spec, out_dir: str):
    """process_prompt in a pool worker. A worker whose prompt ended on SIGTERM would take the next
    prompt already queued to it (the pool catches the SystemExit and goes on): none starts once told
    to stop."""
    if _stopping:
        raise SystemExit(128 + signal.SIGTERM)
    return process_prompt(cfg, spec, out_dir)


# ------------------------------------------------------------------ the driver


def run_pool(todo, cfg, out_dir: Path, workers: int, done) -> None:
    import concurrent.futures as cf
    import multiprocessing

    threads = max(1, (os.cpu_count() or 1) // workers)
    pool = cf.ProcessPoolExecutor(
        max_workers=min(workers, len(todo)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=init_pool,
        initargs=(threads,),
    )
    try:
        # the workers start with Ctrl-C blocked (a mask is inherited): the driver's alone to handle
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            futures = {pool.submit(pool_task, cfg, spec, str(out_dir)): spec for spec in todo}
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fut in cf.as_completed(futures):
            done(futures[fut], prompt_outcome(fut.result))
    except BaseException:
        stop_pool(pool)
        clean_stale_partials(Path(cfg.cache) / "sweep-ref")  # a REF's partial file of a worker killed after its grace
        raise  # the tracker is left to end with this process: stopped now, it warns of what the killed workers held
    pool.shutdown()
    _stop_resource_tracker()


def _stop_resource_tracker() -> None:
    """End multiprocessing's resource tracker, which the pool started: left alone, it exits only
    after this process has (its pipe closed), an orphan that outlives `trace sweep` (found running
    or a zombie right after exit). Its private `_stop` closes that pipe and reaps it; a Python
    without it keeps the old behaviour."""
    from multiprocessing import resource_tracker

    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


def stop_pool(pool, grace: float = 30.0) -> None:
    """End the workers' prompts (SIGTERM: their clean-up runs), then the pool; SIGKILL after `grace` s."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        with contextlib.suppress(OSError, ValueError):
            p.terminate()
    pool.shutdown(wait=False, cancel_futures=True)  # the workers get their stop once their prompts ended
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


RAY_CONNECT_S = 10.0  # how long a --ray HOST:PORT may take to accept a connection


def check_ray(address: str | None = None) -> None:
    """ray installed, and a --ray HOST:PORT (or ray://HOST:PORT) that accepts a TCP connection within
    RAY_CONNECT_S: ray.init waits on an address where nothing answers for minutes, printing warnings.
    "auto" and "local" are left to Ray."""
    import importlib.util
    import socket

    if importlib.util.find_spec("ray") is None:
        raise TraceToolError(f"--ray needs ray, which is not installed: {install_hint('cluster')}")
    host, sep, port = (address or "").removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=RAY_CONNECT_S):
            pass
    except (OSError, OverflowError, ValueError) as e:
        why = getattr(e, "strerror", None) or ("timed out" if isinstance(e, TimeoutError) else type(e).__name__)
        raise TraceToolError(f"--ray {one_line(address, 200)}: no Ray cluster answers there ({why})") from None


def run_ray(todo, cfg, out_dir: Path, address: str, done, shared: bool | None) -> None:
    check_ray()
    import ray

    started = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise TraceToolError(f"--ray {address}: cannot connect to a Ray cluster ({one_line(e, 200)})") from None
        started = True
    token = secrets.token_hex(16)
    write_atomic(out_dir / TOKEN_FILE, token.encode())
    task = ray.remote(num_cpus=1)(process_prompt)
    target = None if shared is False else str(out_dir.resolve())
    token = None if shared else token
    try:
        refs = {task.remote(cfg, spec, target, token, 1): spec for spec in todo}  # 1 torch thread: 1 CPU a task
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for r in ready:
                try:
                    got = ray.get(r)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)  # the task's own exception
                    if not isinstance(cause, TraceToolError):
                        raise
                    if not isinstance(cause, PromptFailed):
                        raise TraceToolError(str(cause)) from None
                    got = cause
                done(refs[r], got)
    except BaseException:
        for r in refs:
            ray.cancel(r, force=True)
        raise
    finally:
        (out_dir / TOKEN_FILE).unlink(missing_ok=True)
        if started:
            ray.shutdown()
