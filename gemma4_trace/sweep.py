"""`trace sweep`: record, replay and diff every prompt of a prompt set, then aggregate (diff/corpus.py).

For each prompt: REF is recorded once and cached (`<cache>/sweep-ref/<key>.h5`, key: the model's
hash, the prompt, max_new_tokens and the recorder's version), RUN (and BASE) are replayed
teacher-forced with the model already loaded, RUN is diffed against REF (judged against BASE with
--baseline-runtime), and `DIR/prompts/<id>.json` (+ `<id>.html`, + the traces with --keep-traces)
is written, the JSON last and every file atomically: a file there is complete, and a re-run skips
the prompts whose JSON holds the same settings. The model is loaded once per worker.

Workers: in this process (1), a spawn process pool (N; torch threads = cores // N), or Ray tasks
(one per prompt). A Ray task writes its own files when it sees DIR (shared storage: it finds the
token file the driver wrote there); otherwise it returns them and the driver writes them.
Module level imports no torch: the command line checks its input before anything heavy loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.traces.atomic import write_bytes_atomic
from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line

SWEEP_FORMAT = 1
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_PROMPTS = 100_000
MAX_PROMPTS_BYTES = 64 << 20  # a prompts file larger than this is refused before it is read
MAX_IMAGE_BYTES = 64 << 20
EMBEDDED_SET = "@embedded"  # PROMPTS naming the shipped set (hf/tiny_model/sweep_prompts.jsonl)
TOKEN_FILE = ".sweep-token"  # what a Ray task looks for to know DIR is shared storage


# ------------------------------------------------------------------ prompts
def read_prompts(path) -> list[dict]:
    """The prompts of a text file (one a line, blank lines skipped) or of JSON lines (a line starting
    with '{'): {"text": ...} or {"input_ids": [...]}, optional "image" (a path, relative to the file's
    folder), "chat" (false: raw text, no chat template) and "id". A bad line: TraceToolError naming it.
    "@embedded": the prompt set shipped for the embedded model."""
    p = Path(path)
    if str(path) == EMBEDDED_SET:
        from gemma4_trace.hf.model import embedded_model_dir

        p = embedded_model_dir() / "sweep_prompts.jsonl"
    try:
        st = p.stat()
        if p.is_file() and st.st_size > MAX_PROMPTS_BYTES:
            raise TraceToolError(f"prompts file {p} is larger than {MAX_PROMPTS_BYTES >> 20} MiB")
        if not p.is_dir() and not p.is_file():
            raise TraceToolError(f"prompts file {p} is not a regular file")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise TraceToolError(f"prompts file {p} does not exist") from None
    except IsADirectoryError:
        raise TraceToolError(f"prompts file {p} is a folder") from None
    except OSError as e:
        raise TraceToolError(f"prompts file {p} is not readable ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceToolError(f"prompts file {p} is not UTF-8 text") from None
    lines = text.splitlines()
    jsonl = any(ln.lstrip().startswith("{") for ln in lines if ln.strip())
    prompts, seen = [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p} line {n}"
        spec = _json_prompt(line, where, p.parent) if jsonl else {"text": line}
        spec.setdefault("id", f"line{n:05d}")
        if spec["id"] in seen:
            raise TraceToolError(f"{where}: id {spec['id']!r} already used on line {seen[spec['id']]}")
        seen[spec["id"]] = n
        spec["line"] = n
        prompts.append(spec)
        if len(prompts) > MAX_PROMPTS:
            raise TraceToolError(f"{p}: more than {MAX_PROMPTS} prompts")
    if not prompts:
        raise TraceToolError(f"prompts file {p} holds no prompt")
    return prompts


def _json_prompt(line: str, where: str, folder: Path) -> dict:
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        raise TraceToolError(f"{where}: not a JSON object (a JSON-lines file has one object per line)") from None
    if not isinstance(d, dict):
        raise TraceToolError(f"{where}: not a JSON object")
    unknown = sorted(set(d) - {"text", "input_ids", "image", "chat", "id"})
    if unknown:
        raise TraceToolError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))[:200]}")
    spec = {}
    if ("text" in d) == ("input_ids" in d):
        raise TraceToolError(f'{where}: give exactly one of "text" or "input_ids"')
    if "text" in d:
        if not isinstance(d["text"], str) or not d["text"]:
            raise TraceToolError(f'{where}: "text" must be a non-empty string')
        spec["text"] = d["text"]
    else:
        ids = d["input_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids)
        ):
            raise TraceToolError(f'{where}: "input_ids" must be a non-empty list of token ids (integers >= 0)')
        spec["input_ids"] = ids
    if "image" in d:
        if "text" not in d:
            raise TraceToolError(f'{where}: "image" needs "text" (the processor places the image tokens)')
        if not isinstance(d["image"], str) or not d["image"]:
            raise TraceToolError(f'{where}: "image" must be a path')
        spec["image"] = str(_image_in(folder, d["image"], where))
    if "chat" in d:
        if not isinstance(d["chat"], bool):
            raise TraceToolError(f'{where}: "chat" must be true or false')
        spec["chat"] = d["chat"]
    if "id" in d:
        if not isinstance(d["id"], str) or not ID_RE.match(d["id"]):
            raise TraceToolError(f"{where}: \"id\" must be 1-64 letters, digits, '.', '_' or '-' (a file name)")
        spec["id"] = d["id"]
    return spec


def _image_in(folder: Path, name: str, where: str) -> Path:
    """An image a prompts file names: a regular file inside the file's folder (after links are
    followed), of bounded size; anything else is one line."""
    root = folder.resolve()
    image = (folder / name).resolve()
    if not image.is_relative_to(root):
        raise TraceToolError(f"{where}: image {name!r} is outside the prompts file's folder {root}")
    if not image.exists():
        raise TraceToolError(f"{where}: image {folder / name} does not exist")
    if not image.is_file():
        raise TraceToolError(f"{where}: image {folder / name} is not a regular file")
    if image.stat().st_size > MAX_IMAGE_BYTES:
        raise TraceToolError(f"{where}: image {folder / name} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return image


def _sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def prompt_key(spec: dict, chat_default: bool) -> dict:
    """What decides a prompt's REF (besides the model and max_new_tokens): its input, never its id."""
    key = {k: spec[k] for k in ("text", "input_ids") if k in spec}
    if "text" in spec:
        key["chat"] = spec.get("chat", chat_default)
    if "image" in spec:
        key["image_sha256"] = _sha256_file(spec["image"])
    return key


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
    settings: dict = field(default_factory=dict)  # what a finished prompt's JSON must hold to be reused
    sys_path: list = field(default_factory=list)  # the driver's folder: plug-in runtimes found as there


def make_settings(model_hash: str, runtime, baseline_runtime, max_new_tokens, tolerances, factor) -> dict:
    from importlib.metadata import version

    tol = None
    if tolerances is not None:
        from gemma4_trace.diff.tolerances import resolve_tolerances

        tol = _sha256_file(resolve_tolerances(tolerances))
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


def finished(out_dir: Path, spec: dict, cfg: Config) -> dict | None:
    """The prompt's record from an earlier run with the same settings and prompt, else None."""
    path = out_dir / "prompts" / f"{spec['id']}.json"
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("settings") != cfg.settings:
        return None
    if rec.get("prompt") != prompt_key(spec, cfg.chat):
        return None
    return rec


# ------------------------------------------------------------------ one worker (torch from here on)
_WORKER: dict = {}  # one loaded model per process (per Config's settings)


class Worker:
    def __init__(self, cfg: Config):
        from gemma4_trace.hf.model import load_model
        from gemma4_trace.replayer import artifacts

        for p in cfg.sys_path:
            if p not in sys.path and os.path.isdir(p):
                sys.path.insert(0, p)
        self.cfg = cfg
        self.lm = load_model(cfg.model_dir)
        self.ref_cache = Path(cfg.cache) / "sweep-ref"
        self.artifacts = artifacts
        self.decode = None
        from gemma4_trace.hf.model import decoder_for

        tok = Path(self.lm.model_dir) / "tokenizer.json"
        self.decode = decoder_for(tok if tok.is_file() else None)

    def reference(self, spec: dict, tmp: Path) -> Path:
        """REF from the cache, recorded (and cached) when absent or unreadable."""
        from gemma4_trace.recorder.record import _open_image, prepare_inputs, record_loaded
        from gemma4_trace.replayer.replay import read_reference

        key = {
            "model": self.cfg.settings["model"],
            "prompt": prompt_key(spec, self.cfg.chat),
            "max_new_tokens": self.cfg.max_new_tokens,
            "recorder": self.cfg.settings["version"],
        }
        path = self.ref_cache / f"{self.artifacts.key_digest(key)}.h5"
        if path.is_file():
            try:
                read_reference(path)
                return path
            except TraceToolError:
                pass  # damaged: record it again
        images = [_open_image(spec["image"])] if "image" in spec else []
        inputs = prepare_inputs(
            self.lm, spec.get("text"), spec.get("input_ids"), images, spec.get("chat", self.cfg.chat)
        )
        self.ref_cache.mkdir(parents=True, exist_ok=True)
        part = self.ref_cache / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.h5"
        try:
            record_loaded(self.lm, inputs, part, max_new_tokens=self.cfg.max_new_tokens, force=True)
            os.replace(part, path)  # atomic: a racing worker's identical REF or ours
        finally:
            if part.exists():
                part.unlink()
        return path

    def replay(self, ref_path: Path, runtime: str, out: Path) -> None:
        """`trace replay REF --runtime RT` (teacher-forced) with this worker's model."""
        import contextlib

        from gemma4_trace.hf.model import provenance
        from gemma4_trace.replayer.api import make_runtime, plugin_roots
        from gemma4_trace.replayer.replay import _CheckedRuntime, _run_steps, default_max_seq, read_reference
        from gemma4_trace.replayer.runtime import resolve_prefill_chunk
        from gemma4_trace.traces.header import Provenance, TraceHeader
        from gemma4_trace.traces.layers import layer_infos_from_config
        from gemma4_trace.traces.writer import TraceWriter

        ref = read_reference(ref_path)
        lm = self.lm
        max_seq = default_max_seq(len(ref.prompt_ids), ref.max_new_tokens)
        rt = make_runtime(runtime, lm, max_seq)
        if hasattr(rt, "prefill_chunk"):
            rt.prefill_chunk = resolve_prefill_chunk(None, max_seq)
        runner = _CheckedRuntime(
            rt, plugin=runtime != "static", vocab=lm.text_config.vocab_size, roots=plugin_roots(runtime, rt)
        )
        with contextlib.ExitStack() as stack:
            w = stack.enter_context(TraceWriter(out, force=True, source_dtype=lm.dtype))
            w.write_header(
                TraceHeader(
                    Provenance.from_dict(provenance(lm, runtime=rt.name, mode="teacher-forced")),
                    ref.prompt_ids,
                    layer_infos_from_config(lm.text_config),
                    max_new_tokens=ref.max_new_tokens,
                    eos_token_ids=ref.eos,
                    prompt_text=ref.prompt_text,
                    chat_template_applied=ref.chat,
                    extra_inputs=ref.extra,
                )
            )
            _run_steps(runner, ref, "teacher-forced", w, None)

    def run(self, spec: dict, tmp: Path) -> dict:
        """Every file of one prompt, in `tmp`: {name: path}; the JSON record's dict under "record"."""
        from gemma4_trace.diff import diff_traces, render_html
        from gemma4_trace.diff.corpus import prompt_record

        cfg = self.cfg
        ref = self.reference(spec, tmp)
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
        html.write_text(render_html(result), encoding="utf-8")
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
    try:
        worker = _worker(cfg)
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
    import torch

    torch.set_num_threads(threads)


# ------------------------------------------------------------------ the driver
@dataclass
class SweepOutcome:
    summary: dict
    done_now: int
    resumed: int
    seconds: float


def run_sweep(
    prompts: list[dict],
    cfg: Config,
    out_dir,
    workers: int = 1,
    ray_address: str | None = None,
    say=None,
    shared: bool | None = None,
) -> SweepOutcome:
    """Every prompt not finished yet, then the aggregates (DIR/summary.json, DIR/summary.html).

    `shared` (Ray only): None decides per task (the token file), False makes every task return its files,
    True makes every task write them (DIR must be the same path on every machine).
    """
    from gemma4_trace.diff.corpus import aggregate
    from gemma4_trace.diff.corpus_report import write_summary

    say = say or (lambda line: None)
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

    def done(spec, got):
        if got["files"] is not None:
            store(out_dir, got["files"], got["record"])
        records[spec["id"]] = json.loads(json.dumps(got["record"]))  # as a resumed one reads back
        rec = got["record"]
        say(
            f"[{len(records)}/{len(prompts)}] {spec['id']}: "
            + ("match" if rec["match"] else "DIVERGES")
            + f", KL mean {rec['kl_mean']:.3g}"
        )

    if todo:
        if ray_address is not None:
            _run_ray(todo, cfg, out_dir, ray_address, done, shared)
        elif workers <= 1:
            for spec in todo:
                done(spec, process_prompt(cfg, spec, str(out_dir)))
        else:
            _run_pool(todo, cfg, out_dir, workers, done)
    ordered = [records[s["id"]] for s in prompts]
    summary = aggregate(ordered, cfg.settings)
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
        futures = {pool.submit(process_prompt, cfg, spec, str(out_dir)): spec for spec in todo}
        for fut in cf.as_completed(futures):
            done(futures[fut], fut.result())
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def check_ray() -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise TraceToolError(f"--ray needs ray, which is not installed: {install_hint('cluster')}")


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
                    if isinstance(cause, TraceToolError):
                        raise TraceToolError(str(cause)) from None
                    raise
                done(refs[r], got)
    except BaseException:
        for r in refs:
            ray.cancel(r, force=True)
        raise
    finally:
        (out_dir / TOKEN_FILE).unlink(missing_ok=True)
        if started:
            ray.shutdown()


def describe(outcome: SweepOutcome) -> str:
    from gemma4_trace.diff.corpus_report import format_summary

    return format_summary(outcome.summary) + (
        f"\n{outcome.done_now} prompt(s) run, {outcome.resumed} resumed, in {outcome.seconds:.1f} s"
    )


def failing_prompt(spec: dict, e: Exception) -> TraceToolError:
    return TraceToolError(f"prompt {spec['id']} (line {spec['line']}): {one_line(e, 300)}")
