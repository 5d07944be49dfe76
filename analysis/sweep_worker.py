"""One prompt of `trace sweep`, in whichever process runs it (this one, a pool worker or a Ray task,
analysis/sweep_pool.py): the model loaded once per process, REF recorded once and cached, RUN (and
BASE) replayed teacher-forced, RUN diffed against REF; the prompt's files written under DIR/prompts
(each atomically, its JSON last) or handed back to the driver (analysis/sweep.py) as bytes.
Module level imports no torch: torch is imported where a worker starts."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from gemma4_trace.replayer import artifacts
from gemma4_trace.replayer.artifacts import key_digest
from gemma4_trace.traces.atomic import write_bytes_atomic
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import read_text, sha256_file

from .prompts import prompt_key, prompt_rows
from .sweep_config import Config

TOKEN_FILE = ".sweep-token"  # what a Ray task looks for to know DIR is shared storage

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
            from gemma4_trace.replayer.runtimes.llamacpp.runtime import run_gguf

            rt = run_gguf(self.lm, max_seq, read_header(gguf))
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


def prompt_outcome(run):
    """run()'s result, or the PromptFailed it raised."""
    try:
        return run()
    except PromptFailed as e:
        return e


class PromptFailed(TraceToolError):
    """One prompt could not run (its one-line reason): the sweep records it and goes on."""


def failing_prompt(spec: dict, e: Exception) -> PromptFailed:
    return PromptFailed(f"prompt {spec['id']} (line {spec['line']}): {one_line(e, 300)}")
