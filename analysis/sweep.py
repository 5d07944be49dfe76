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
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.replayer import artifacts
from gemma4_trace.replayer.artifacts import cache_dir, key_digest, model_hash
from gemma4_trace.traces.atomic import write_bytes_atomic
from gemma4_trace.traces.errors import TraceToolError, one_line
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
    gguf: str | None = None  # RUN: llama.cpp on this GGUF file as it is (--gguf)
    # BASE: the static runtime on a GGUF's dequantized weights (--baseline-runtime auto for a GGUF
    # port): the file's path, or ":TYPE" for the project's own conversion of the model to TYPE
    baseline_weights_from: str | None = None


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


def resolve_baseline(runtime: str, baseline_runtime: str | None, gguf) -> tuple[str | None, str | None]:
    """(BASE's runtime, or the GGUF whose dequantized weights BASE runs on) for --baseline-runtime:
    a runtime's name as given, or `auto`: the runtime's own baseline from its registry row (llama.cpp
    and --gguf: the static runtime on the file's dequantized weights; mlx-q4: mlx-q4-dq; ...)."""
    if baseline_runtime != AUTO:
        return baseline_runtime, None
    from gemma4_trace.replayer.runtimes.registry import FLOAT_GGUF_TYPES, parse_runtime

    if gguf is not None:
        return None, str(Path(gguf).resolve())
    choice = parse_runtime(runtime)
    spec = choice.spec
    if spec is None or spec.baseline is None:
        raise TraceToolError(
            f"--baseline-runtime auto: --runtime {runtime} has no baseline of its own; name one (--baseline-runtime RT)"
        )
    if choice.gguf:
        if choice.type in FLOAT_GGUF_TYPES:
            raise TraceToolError(f"--baseline-runtime auto: llama.cpp:{choice.type} is not quantized; name a baseline")
        return None, f":{choice.type}"
    return spec.baseline, None


AUTO = "auto"


def check_runtimes(runtime: str | None, baseline_runtime: str | None, gguf) -> str:
    """RUN's runtime (llama.cpp with --gguf), every choice checked before anything runs: the runtimes
    installed, the GGUF's header, `auto` resolvable; one line otherwise."""
    from gemma4_trace.replayer.runtimes.registry import check_available

    if gguf is not None:
        from gemma4_trace.replayer.runtimes.llamacpp.gguf_reader import check_gguf_options, read_header

        runtime = check_gguf_options(runtime or "llama.cpp", gguf, None, False, None)
        read_header(gguf)  # malformed, or not a regular file: refused before anything runs
    elif runtime is None:
        raise TraceToolError("give --runtime RT (or --gguf FILE)")
    for rt in (runtime, baseline_runtime):
        if rt is not None and rt != AUTO:
            check_available(rt)
    if baseline_runtime == AUTO:
        resolve_baseline(runtime, baseline_runtime, gguf)  # a runtime without a baseline of its own: refused
    return runtime


def configure(
    model_dir,
    runtime: str,
    baseline_runtime,
    max_new_tokens: int,
    chat: bool,
    tolerances,
    factor: float,
    keep: bool,
    gguf=None,
) -> Config:
    """The Config of a sweep over the model in `model_dir` (None: the embedded one); the artifact
    cache as configured now (--cache-dir), plug-in runtimes found from the current folder. `gguf`:
    RUN is llama.cpp on that file; `baseline_runtime` "auto": the runtime's own baseline."""
    from gemma4_trace.hf.model import embedded_model_dir

    baseline_runtime, weights_from = resolve_baseline(runtime, baseline_runtime, gguf)
    shown_run = runtime if gguf is None else f"llama.cpp --gguf {Path(gguf).name}"
    shown_base = baseline_runtime
    if weights_from is not None:
        source = f"the {weights_from[1:]} conversion" if weights_from.startswith(":") else Path(weights_from).name
        shown_base = f"static --weights-from {source}"
    settings = make_settings(
        model_hash(model_dir or embedded_model_dir()), shown_run, shown_base, max_new_tokens, tolerances, factor
    )
    settings["chat"] = chat
    for name, path in (("gguf_sha256", gguf), ("baseline_gguf_sha256", weights_from)):
        if path is not None and not path.startswith(":"):  # a file's records are reused only for that file
            settings[name] = sha256_file(path)
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
        gguf=str(Path(gguf).resolve()) if gguf is not None else None,
        baseline_weights_from=weights_from,
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
        if cfg.gguf is not None:  # a file made for another model: refused once, before any prompt
            from gemma4_trace.replayer.runtimes.llamacpp.gguf_reader import check_config, read_header

            check_config(read_header(cfg.gguf), self.lm, False)
        self.dequantized = None  # (a second copy of the model with a GGUF's weights, its label): BASE's
        self.conversion = None  # the project's own GGUF conversion BASE reads, when it is

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
            write_atomic(stamp, sha256_file(part).encode())
            os.replace(part, path)  # atomic: a racing worker's identical REF or ours
        finally:
            if part.exists():
                part.unlink()
        return path

    def replay(self, ref_path: Path, runtime: str | None, out: Path, gguf=None, weights_from=None) -> None:
        """`trace replay REF --runtime RT` (teacher-forced) with this worker's model; or `--gguf FILE`
        (llama.cpp on the user's file), or the static runtime on a GGUF's dequantized weights."""
        from gemma4_trace.replayer.core import default_max_seq, make_runtime, read_reference, replay_loaded
        from gemma4_trace.replayer.runtimes.registry import parse_runtime

        ref = read_reference(ref_path)
        max_seq = default_max_seq(len(ref.prompt_ids), ref.max_new_tokens)
        lm, foreign = self.lm, None
        if gguf is not None:
            from gemma4_trace.replayer.runtimes.llamacpp.gguf_reader import read_header
            from gemma4_trace.replayer.runtimes.llamacpp.runtime import gguf_runtime

            rt = gguf_runtime(self.lm, max_seq, read_header(gguf), False, False, None)
        elif weights_from is not None:
            lm, rt = self._dequantized_runtime(weights_from, max_seq)
        else:
            choice = parse_runtime(runtime)
            rt, foreign = make_runtime(choice, self.lm, max_seq), choice.foreign_code
        replay_loaded(lm, ref, rt, out, reference_path=ref_path, force=True, max_seq=max_seq, plugin=foreign)

    def _dequantized_runtime(self, source: str, max_seq: int):
        """The static runtime on a GGUF's dequantized weights (`source`: a file, or ":TYPE" for the
        project's conversion to TYPE), on a second copy of the model loaded once per worker: the first
        stays HF's, for recording REF."""
        from gemma4_trace.hf.model import load_model
        from gemma4_trace.replayer.runtime import StaticGemma4Runtime
        from gemma4_trace.replayer.runtimes.llamacpp import gguf_reader as GR

        if self.dequantized is None:
            path = source
            if source.startswith(":"):
                from gemma4_trace.replayer.runtimes.llamacpp.runtime import GGUF_NAME, gguf_artifact

                self.conversion = gguf_artifact(self.lm, source[1:])
                path = str(self.conversion.path / GGUF_NAME)
            header = GR.read_header(path)
            lm = load_model(self.cfg.model_dir)
            GR.check_config(header, lm, False)
            GR.load_weights(header, lm)
            self.dequantized = (lm, f"weights from {Path(path).name}, {header.type_name()}, dequantized")
        lm, label = self.dequantized
        rt = StaticGemma4Runtime(lm, max_seq)
        rt.name = f"{rt.name} ({label})"
        return lm, rt

    def run(self, spec: dict, tmp: Path) -> dict:
        """Every file of one prompt, in `tmp`: {name: path}; the JSON record's dict under "record"."""
        from gemma4_trace.diff import diff_traces, render_html

        from .corpus import prompt_record

        cfg = self.cfg
        ref = self.reference(spec)
        run = tmp / f"{spec['id']}.run.h5"
        self.replay(ref, cfg.runtime, run, gguf=cfg.gguf)
        base = None
        if cfg.baseline_runtime or cfg.baseline_weights_from:
            base = tmp / f"{spec['id']}.base.h5"
            self.replay(ref, cfg.baseline_runtime, base, weights_from=cfg.baseline_weights_from)
        result = diff_traces(ref, run, cfg.tolerances, base, cfg.baseline_factor)
        if self.decode is not None:
            result.tokens.reference_text = self.decode(result.tokens.reference)
            result.tokens.candidate_text = self.decode(result.tokens.candidate)
        files = {}
        html = tmp / f"{spec['id']}.html"
        # the page names what the user knows (the prompt, the runtimes), not cache keys or temporary files
        result.reference.path = f"REF: HF's recording of prompt {spec['id']}"
        result.candidate.path = "RUN: " + (f"--runtime {cfg.runtime}" if cfg.gguf is None else cfg.settings["runtime"])
        if result.baseline is not None:
            named = cfg.baseline_weights_from is None
            result.baseline.trace.path = "BASE: " + (
                f"--baseline-runtime {cfg.baseline_runtime}" if named else cfg.settings["baseline_runtime"]
            )
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


def write_atomic(path: Path, data: bytes) -> None:
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
            write_atomic(folder / name, data)
    write_atomic(folder / f"{record['id']}.json", (json.dumps(record, indent=1) + "\n").encode())


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


def prompt_outcome(run):
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
