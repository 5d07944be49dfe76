"""`trace sweep`: record, replay and diff every prompt of a prompt set, then aggregate (analysis/corpus.py).

For each prompt: REF is recorded once and cached (`<cache>/sweep-ref/<key>.h5`, key: the model's
hash, the prompt, max_new_tokens and the recorder's version), RUN (and BASE) are replayed
teacher-forced with the model already loaded (replayer/core.py), RUN is diffed against REF
(judged against BASE with --baseline-runtime), and `DIR/prompts/<id>.json` (+ `<id>.html`, + the
traces with --keep-traces) is written, the JSON last and every file atomically: a file there is
complete, and a re-run skips the prompts whose JSON holds the same settings. The model is loaded
once per worker.

Workers: in this process (1), a spawn process pool (N; torch threads = cores // N), or Ray tasks
(one per prompt). A Ray task writes its own files when it sees DIR (shared storage: it finds the
token file the driver wrote there); otherwise it returns them and the driver writes them.
Module level imports no torch: the command line checks its input before anything heavy loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.replayer import artifacts
from gemma4_trace.replayer.artifacts import cache_dir, key_digest, model_hash
from gemma4_trace.traces.atomic import write_bytes_atomic
from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line
from gemma4_trace.traces.inputs import read_text, sha256_file

from .corpus import SweepSummary, record_ok
from .prompts import prompt_key, prompt_rows

SWEEP_FORMAT = 1
MAX_RECORD_BYTES = 64 << 20  # a prompt's record: its verdict and per-position KL (a few KiB per 100 tokens)
TOKEN_FILE = ".sweep-token"  # what a Ray task looks for to know DIR is shared storage


# ------------------------------------------------------------------ settings
@dataclass
class Config:
    """What every worker needs: picklable, no torch."""

    model_dir: str | None
    runtime: str
    baseline_runtime: str | None
    max_new_tokens: int
    tolerances: str | None
    baseline_factor: float
    chat: bool
    keep_traces: bool
    cache: str  # the artifact cache folder (replayer/artifacts.cache_dir) at the driver
    caching: bool = True  # artifacts cached (not --no-cache), in every worker as at the driver
    settings: dict = field(default_factory=dict)  # what a finished prompt's JSON must hold to be reused
    sys_path: list = field(default_factory=list)  # the driver's folder: plug-in runtimes found as there


def make_settings(model_hash: str, runtime, baseline_runtime, max_new_tokens, tolerances, factor) -> dict:
    from importlib.metadata import version

    tol = None
    if tolerances is not None:
        from gemma4_trace.diff.tolerances import resolve_tolerances

        tol = sha256_file(resolve_tolerances(tolerances))
    return {
        "format": SWEEP_FORMAT,
        "model": model_hash,
        "runtime": runtime,
        "baseline_runtime": baseline_runtime,
        "max_new_tokens": max_new_tokens,
        "tolerances_sha256": tol,
        "baseline_factor": factor if baseline_runtime else None,
        "version": version("gemma4-trace"),
    }


def configure(
    model_dir, runtime: str, baseline_runtime, max_new_tokens: int, chat: bool, tolerances, factor: float, keep: bool
) -> Config:
    """The Config of a sweep over the model in `model_dir` (None: the embedded one); the artifact
    cache as configured now (--cache-dir), plug-in runtimes found from the current folder."""
    from gemma4_trace.hf.model import embedded_model_dir

    settings = make_settings(
        model_hash(model_dir or embedded_model_dir()), runtime, baseline_runtime, max_new_tokens, tolerances, factor
    )
    settings["chat"] = chat
    return Config(
        model_dir=str(Path(model_dir).resolve()) if model_dir else None,
        runtime=runtime,
        baseline_runtime=baseline_runtime,
        max_new_tokens=max_new_tokens,
        tolerances=str(Path(tolerances).resolve()) if tolerances and Path(tolerances).is_file() else tolerances,
        baseline_factor=factor,
        chat=chat,
        keep_traces=keep,
        cache=str(cache_dir().resolve()),
        caching=artifacts.caching(),
        settings=settings,
        sys_path=[os.getcwd()],
    )


def finished(out_dir: Path, spec: dict, cfg: Config) -> dict | None:
    """The prompt's record from an earlier run with the same settings and prompt, else None."""
    path = out_dir / "prompts" / f"{spec['id']}.json"
    if not path.exists():
        return None
    try:  # bounded; a FIFO or a device in its place is not a record (and is not read)
        rec = json.loads(read_text(path, "prompt record", MAX_RECORD_BYTES))
    except (OSError, ValueError, TraceToolError):
        return None
    if not isinstance(rec, dict) or rec.get("settings") != cfg.settings or not record_ok(rec):
        return None
    if rec.get("prompt") != prompt_key(spec, cfg.chat) or rec.get("id") != spec["id"]:
        return None
    return rec


# ------------------------------------------------------------------ one worker (torch from here on)
_WORKER: dict = {}  # one loaded model per process (per Config's settings)


class Worker:
    def __init__(self, cfg: Config):
        from gemma4_trace.hf.model import decoder_for, load_model

        for p in cfg.sys_path:
            if p not in sys.path and os.path.isdir(p):
                sys.path.insert(0, p)
        self.cfg = cfg
        artifacts.configure(cfg.cache, enabled=cfg.caching)  # as --cache-dir / --no-cache set it at the driver
        self.lm = load_model(cfg.model_dir)
        self.ref_cache = Path(cfg.cache) / "sweep-ref"
        tok = Path(self.lm.model_dir) / "tokenizer.json"
        self.decode = decoder_for(tok if tok.is_file() else None)

    def reference(self, spec: dict) -> Path:
        """REF from the cache, recorded (and cached) when absent or unreadable."""
        from gemma4_trace.recorder.record import open_image, prepare_inputs, record_loaded

        key = {
            "model": self.cfg.settings["model"],
            "prompt": prompt_key(spec, self.cfg.chat),
            "max_new_tokens": self.cfg.max_new_tokens,
            "recorder": self.cfg.settings["version"],
        }
        path = self.ref_cache / f"{key_digest(key)}.h5"
        stamp = path.with_suffix(".sha256")  # the REF's content hash, written when it was recorded
        images = [open_image(spec["image"])] if "image" in spec else []
        inputs = prepare_inputs(
            self.lm, spec.get("text"), spec.get("input_ids"), images, spec.get("chat", self.cfg.chat)
        )
        if path.is_file() and not path.is_symlink() and _cached_ref_holds(path, stamp, inputs, self.cfg):
            return path
        self.ref_cache.mkdir(parents=True, exist_ok=True)
        part = self.ref_cache / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.h5"
        try:
            record_loaded(self.lm, inputs, part, max_new_tokens=self.cfg.max_new_tokens, force=True)
            _write_atomic(stamp, sha256_file(part).encode())
            os.replace(part, path)  # atomic: a racing worker's identical REF or ours
        finally:
            if part.exists():
                part.unlink()
        return path

    def replay(self, ref_path: Path, runtime: str, out: Path) -> None:
        """`trace replay REF --runtime RT` (teacher-forced) with this worker's model."""
        from gemma4_trace.replayer.core import default_max_seq, make_runtime, read_reference, replay_loaded
        from gemma4_trace.replayer.runtimes.registry import parse_runtime

        ref = read_reference(ref_path)
        max_seq = default_max_seq(len(ref.prompt_ids), ref.max_new_tokens)
        choice = parse_runtime(runtime)
        rt = make_runtime(choice, self.lm, max_seq)
        replay_loaded(
            self.lm, ref, rt, out, reference_path=ref_path, force=True, max_seq=max_seq, plugin=choice.foreign_code
        )

    def run(self, spec: dict, tmp: Path) -> dict:
        """Every file of one prompt, in `tmp`: {name: path}; the JSON record's dict under "record"."""
        from gemma4_trace.diff import diff_traces, render_html

        from .corpus import prompt_record

        cfg = self.cfg
        ref = self.reference(spec)
        run = tmp / f"{spec['id']}.run.h5"
        self.replay(ref, cfg.runtime, run)
        base = None
        if cfg.baseline_runtime:
            base = tmp / f"{spec['id']}.base.h5"
            self.replay(ref, cfg.baseline_runtime, base)
        result = diff_traces(ref, run, cfg.tolerances, base, cfg.baseline_factor)
        if self.decode is not None:
            result.tokens.reference_text = self.decode(result.tokens.reference)
            result.tokens.candidate_text = self.decode(result.tokens.candidate)
        files = {}
        html = tmp / f"{spec['id']}.html"
        # the page names what the user knows (the prompt, the runtimes), not cache keys or temporary files
        result.reference.path = f"REF: HF's recording of prompt {spec['id']}"
        result.candidate.path = f"RUN: --runtime {cfg.runtime}"
        if result.baseline is not None:
            result.baseline.trace.path = f"BASE: --baseline-runtime {cfg.baseline_runtime}"
        html.write_text(render_html(result, prompt_rows(spec)), encoding="utf-8")
        files[html.name] = html
        if cfg.keep_traces:
            kept = tmp / f"{spec['id']}.ref.h5"
            shutil.copyfile(ref, kept)
            files[kept.name] = kept
            files[run.name] = run
            if base is not None:
                files[base.name] = base
        record = prompt_record(ref, run, base, result)
        record.update(id=spec["id"], line=spec["line"], prompt=prompt_key(spec, cfg.chat), settings=cfg.settings)
        record["report"] = html.name
        return {"record": record, "files": files}


def _worker(cfg: Config) -> Worker:
    key = json.dumps([cfg.settings, cfg.model_dir, cfg.tolerances, cfg.keep_traces, cfg.chat], sort_keys=True)
    w = _WORKER.get(key)
    if w is None:
        _WORKER.clear()
        w = _WORKER[key] = Worker(cfg)
    return w


def _cached_ref_holds(path: Path, stamp: Path, inputs, cfg) -> bool:
    """A cached REF is used only when its bytes hash to the stamp written when it was recorded and
    it holds this prompt (token ids and processor inputs) and this run's max_new_tokens: a damaged,
    swapped or replaced REF is recorded again, never read for another prompt's numbers."""
    import numpy as np

    from gemma4_trace.replayer.core import read_reference

    try:
        want = read_text(stamp, "REF stamp", 128).strip()
        if sha256_file(path) != want:
            return False
        ref = read_reference(path)
    except (OSError, TraceToolError):
        return False
    extra = {k: np.asarray(v) for k, v in (inputs.extra or {}).items()}
    return (
        ref.prompt_ids == list(inputs.input_ids)
        and ref.max_new_tokens == cfg.max_new_tokens
        and set(ref.extra) == set(extra)
        and all(np.array_equal(np.asarray(ref.extra[k]), extra[k]) for k in extra)
    )


def check_not_written(prompts_path: Path, out: Path) -> None:
    """Refuse an output folder where the sweep would replace its own prompts file: DIR/summary.json,
    DIR/summary.html or a file under DIR/prompts (names compared after links, and by inode)."""
    from gemma4_trace.replayer.artifacts import same_file

    hit = any(same_file(prompts_path, out / n) for n in ("summary.json", "summary.html"))
    with contextlib.suppress(OSError, ValueError):
        hit = hit or prompts_path.resolve().is_relative_to((out / "prompts").resolve())
    if hit:
        raise TraceToolError(
            f"output folder {out} would replace the prompts file {prompts_path}; write the sweep to another folder"
        )


SUMMARY_FILES = ("summary.json", "summary.html")


def check_summary(out: Path, force: bool) -> None:
    """DIR/summary.json and summary.html are replaced when they are an earlier sweep's (a summary.json
    this command wrote, beside it) or with --force; anything else in their place is refused in one line,
    and a link, folder or special file even with --force."""
    present = [out / n for n in SUMMARY_FILES if os.path.lexists(out / n)]
    for p in present:
        if p.is_symlink() or not p.is_file():
            raise TraceToolError(f"{p} exists and is not a regular file; the sweep does not replace it")
    if not present or force:
        return
    try:
        d = json.loads(read_text(out / "summary.json", "sweep summary", MAX_RECORD_BYTES))
        ours = isinstance(d, dict) and {"settings", "worst_first", "prompts"} <= d.keys()
    except (OSError, ValueError, TraceToolError):
        ours = False
    if not ours:
        raise TraceToolError(f"{present[0]} exists and is not an earlier sweep's summary (pass --force to replace it)")


def _write_atomic(path: Path, data: bytes) -> None:
    write_bytes_atomic(path, data, prefix=".sweep-partial-")


def store(out_dir: Path, files: dict, record: dict) -> None:
    """Write one prompt's files into DIR/prompts, each atomically, its JSON last (the 'done' mark)."""
    folder = out_dir / "prompts"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if isinstance(data, (str, Path)):
            fd, tmp = tempfile.mkstemp(prefix=".sweep-partial-", dir=folder)
            os.close(fd)
            try:
                shutil.copyfile(data, tmp)
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private: the mode of every other file
                os.replace(tmp, folder / name)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        else:
            _write_atomic(folder / name, data)
    _write_atomic(folder / f"{record['id']}.json", (json.dumps(record, indent=1) + "\n").encode())


def process_prompt(cfg: Config, spec: dict, out_dir: str | None, token: str | None = None, threads: int = 0) -> dict:
    """One prompt, in whichever process runs it. With `out_dir` (and, for Ray, the token file found there:
    shared storage) the files are written there and only the record comes back; otherwise the files come
    back as bytes for the driver to write."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    shared = out_dir is not None and (
        token is None or _read_token(Path(out_dir)) == token
    )  # a Ray task on another machine does not see the driver's DIR
    worker = _worker(cfg)  # a model that does not load ends the sweep: no prompt could run
    try:
        with tempfile.TemporaryDirectory(prefix="gemma4-sweep-") as tmp:
            got = worker.run(spec, Path(tmp))
            return _deliver(got, out_dir, shared)
    except TraceToolError as e:
        raise failing_prompt(spec, e) from None


def _deliver(got: dict, out_dir, shared: bool) -> dict:
    if shared:
        store(Path(out_dir), got["files"], got["record"])
        return {"record": got["record"], "files": None}
    return {"record": got["record"], "files": {n: Path(p).read_bytes() for n, p in got["files"].items()}}


def _read_token(out_dir: Path) -> str | None:
    try:
        return (out_dir / TOKEN_FILE).read_text().strip()
    except OSError:
        return None


def _init_pool(threads: int) -> None:
    """A pool worker: Ctrl-C is the driver's (it ends the workers with SIGTERM), and SIGTERM ends the
    prompt at hand through its `finally` blocks, so no temporary folder or partial REF is left."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _terminated)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked while the driver started it
    torch.set_num_threads(threads)


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process outright
    raise SystemExit(128 + signum)


# ------------------------------------------------------------------ the driver
@dataclass
class SweepOutcome:
    summary: SweepSummary
    done_now: int
    resumed: int
    seconds: float


def unsupported(prompts: list[dict], runtimes) -> list[dict]:
    """The prompts a runtime of the sweep cannot run, known from its registry row before anything
    runs (an image for a text decoder): [{id, line, reason}]. A plug-in's limits are not known: its
    failures are recorded as the prompts run."""
    from gemma4_trace.replayer.runtimes.registry import parse_runtime

    text_only = [rt for rt in runtimes if rt is not None and getattr(parse_runtime(rt).spec, "text_only", False)]
    if not text_only:
        return []
    why = f"--runtime {text_only[0]} runs a text decoder; the prompt has an image"
    return [{"id": s["id"], "line": s["line"], "reason": why} for s in prompts if "image" in s]


def run_sweep(
    prompts: list[dict],
    cfg: Config,
    out_dir,
    workers: int = 1,
    ray_address: str | None = None,
    say=None,
    shared: bool | None = None,
    skipped: list[dict] | None = None,
) -> SweepOutcome:
    """Every prompt not finished yet, then the aggregates (DIR/summary.json, DIR/summary.html).

    A prompt that fails (a one-line error: the runtime cannot run it, an image that does not open)
    is recorded as failed with its reason and the sweep goes on; nothing of it is written under
    DIR/prompts, so a re-run tries it again. `skipped` ({id, line, reason}): prompts left out before
    the sweep (--skip-unsupported), listed in the summary. `shared` (Ray only): None decides per task
    (the token file), False makes every task return its files, True makes every task write them (DIR
    must be the same path on every machine).
    """
    from .corpus import aggregate
    from .sweep_report import write_summary

    say = say or (lambda line: None)
    artifacts.cache_write(Path(cfg.cache) / "sweep-ref")  # a cache that cannot be written: one line, before work
    out_dir = Path(out_dir)
    (out_dir / "prompts").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    records: dict[str, dict] = {}
    todo = []
    for spec in prompts:
        rec = finished(out_dir, spec, cfg)
        if rec is not None:
            records[spec["id"]] = rec
        else:
            todo.append(spec)
    resumed = len(records)
    if resumed:
        say(f"resuming: {resumed} of {len(prompts)} prompts already done in {out_dir}")

    failed: dict[str, dict] = {}

    def done(spec, got):
        if isinstance(got, PromptFailed):
            reason = str(got).removeprefix(f"prompt {spec['id']} (line {spec['line']}): ")
            failed[spec["id"]] = {"id": spec["id"], "line": spec["line"], "reason": reason}
            say(f"[{len(records) + len(failed)}/{len(prompts)}] {spec['id']}: FAILED: {reason}")
            return
        if got["files"] is not None:
            store(out_dir, got["files"], got["record"])
        records[spec["id"]] = json.loads(json.dumps(got["record"]))  # as a resumed one reads back
        rec = got["record"]
        say(
            f"[{len(records) + len(failed)}/{len(prompts)}] {spec['id']}: "
            + ("match" if rec["match"] else "DIVERGES")
            + f", KL mean {rec['kl_mean']:.3g}"
        )

    if todo:
        if ray_address is not None:
            _run_ray(todo, cfg, out_dir, ray_address, done, shared)
        elif workers <= 1:
            for spec in todo:
                done(spec, _outcome(lambda spec=spec: process_prompt(cfg, spec, str(out_dir))))
        else:
            _run_pool(todo, cfg, out_dir, workers, done)
    ran = [records[s["id"]] for s in prompts if s["id"] in records]
    summary = aggregate(ran, cfg.settings, [failed[s["id"]] for s in prompts if s["id"] in failed], skipped)
    write_summary(summary, out_dir)
    return SweepOutcome(summary, len(todo), resumed, time.perf_counter() - t0)


def _run_pool(todo, cfg, out_dir: Path, workers: int, done) -> None:
    import concurrent.futures as cf
    import multiprocessing

    threads = max(1, (os.cpu_count() or 1) // workers)
    pool = cf.ProcessPoolExecutor(
        max_workers=min(workers, len(todo)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_pool,
        initargs=(threads,),
    )
    try:
        # the workers start with Ctrl-C blocked (a mask is inherited): the driver's alone to handle
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            futures = {pool.submit(process_prompt, cfg, spec, str(out_dir)): spec for spec in todo}
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fut in cf.as_completed(futures):
            done(futures[fut], _outcome(fut.result))
    except BaseException:
        _stop_pool(pool)
        raise
    pool.shutdown()


def _stop_pool(pool, grace: float = 30.0) -> None:
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


def _run_ray(todo, cfg, out_dir: Path, address: str, done, shared: bool | None) -> None:
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
    _write_atomic(out_dir / TOKEN_FILE, token.encode())
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


def _outcome(run):
    """run()'s result, or the PromptFailed it raised."""
    try:
        return run()
    except PromptFailed as e:
        return e


def describe(outcome: SweepOutcome) -> str:
    from .sweep_report import format_summary

    return format_summary(outcome.summary) + (
        f"\n{outcome.done_now} prompt(s) run, {outcome.resumed} resumed, in {outcome.seconds:.1f} s"
    )


class PromptFailed(TraceToolError):
    """One prompt could not run (its one-line reason): the sweep records it and goes on."""


def failing_prompt(spec: dict, e: Exception) -> PromptFailed:
    return PromptFailed(f"prompt {spec['id']} (line {spec['line']}): {one_line(e, 300)}")
