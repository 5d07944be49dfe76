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

This module is the driver (the prompts left to run, the resume records, the summary); the sweep's
settings and the checks before it runs are analysis/sweep_config.py, one prompt's work
analysis/sweep_worker.py, the worker processes and Ray analysis/sweep_pool.py, the summary's text and
HTML analysis/sweep_report.py. They import one way: config <- worker <- pool <- this driver.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gemma4_trace.replayer import artifacts
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.inputs import read_text

from .corpus import SweepSummary, record_ok
from .prompts import prompt_key
from .sweep_config import AUTO, Config, check_runtimes, configure, unsupported
from .sweep_worker import PromptFailed, process_prompt, prompt_outcome, store

__all__ = [  # the command's (gemma4_trace/commands/sweep.py) view of the sweep: its settings are sweep_config's
    "AUTO",
    "MAX_RECORD_BYTES",
    "SUMMARY_FILES",
    "Config",
    "SweepOutcome",
    "check_not_written",
    "check_runtimes",
    "check_summary",
    "configure",
    "describe",
    "finished",
    "run_sweep",
    "unsupported",
]

MAX_RECORD_BYTES = 64 << 20  # a prompt's record: its verdict and per-position KL (a few KiB per 100 tokens)


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


@dataclass
class SweepOutcome:
    summary: SweepSummary
    done_now: int
    resumed: int
    seconds: float


def _resume(prompts: list[dict], cfg: Config, out_dir: Path) -> tuple[dict[str, dict], list[dict]]:
    """The records of the prompts already finished in DIR (an earlier run's), and the prompts left to run."""
    records: dict[str, dict] = {}
    todo = []
    for spec in prompts:
        rec = finished(out_dir, spec, cfg)
        if rec is not None:
            records[spec["id"]] = rec
        else:
            todo.append(spec)
    return records, todo


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
    records, todo = _resume(prompts, cfg, out_dir)
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
            from .sweep_pool import run_ray

            run_ray(todo, cfg, out_dir, ray_address, done, shared)
        elif workers <= 1:
            for spec in todo:
                done(spec, prompt_outcome(lambda spec=spec: process_prompt(cfg, spec, str(out_dir))))
        else:
            from .sweep_pool import run_pool

            run_pool(todo, cfg, out_dir, workers, done)
    ran = [records[s["id"]] for s in prompts if s["id"] in records]
    summary = aggregate(ran, cfg.settings, [failed[s["id"]] for s in prompts if s["id"] in failed], skipped)
    write_summary(summary, out_dir)
    return SweepOutcome(summary, len(todo), resumed, time.perf_counter() - t0)


def describe(outcome: SweepOutcome) -> str:
    from .sweep_report import format_summary

    return format_summary(outcome.summary) + (
        f"\n{outcome.done_now} prompt(s) run, {outcome.resumed} resumed, in {outcome.seconds:.1f} s"
    )
