"""`trace sweep`: the corpus statistics checked against numpy on the logits stored in the kept traces,
resuming, --workers 2 giving the same numbers as --workers 1, and bad prompt files refused in one line."""

from __future__ import annotations

import html
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from gemma4_trace.hf.model import embedded_model_dir
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error

pytestmark = pytest.mark.slow  # a record, replays and a diff per prompt; make test-fast skips it

SUBSET = ("short-00", "long-01", "ids-03", "raw-04")  # chat, past the window, token ids, raw text
PCTS = (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1)


def subset_file(folder: Path, ids=SUBSET) -> Path:
    """The shipped prompts named by ids, as a JSON-lines file in folder (their images copied beside
    it: a prompts file reads images inside its own folder only)."""
    shipped = embedded_model_dir() / "sweep_prompts.jsonl"
    lines = []
    for line in shipped.read_text().splitlines():
        d = json.loads(line)
        if d["id"] in ids:
            if "image" in d:
                shutil.copyfile(embedded_model_dir() / d["image"], folder / d["image"])
            lines.append(json.dumps(d))
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    env = {"GEMMA4_TRACE_CACHE": str(root / "cache")}
    prompts = subset_file(root)
    args = ["sweep", prompts, "--runtime", "static-w4g32", "--max-new-tokens", 5, "--keep-traces"]
    r = invoke(*args, "-o", root / "one", env=env)
    assert r.exit_code in (0, 1), r.output
    return {"root": root, "env": env, "prompts": prompts, "args": args, "first": r}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def test_statistics_match_numpy_on_the_stored_logits(lab):
    out = lab["root"] / "one"
    summary = json.loads((out / "summary.json").read_text())
    kl, top1, pr, pq = [], [], [], []
    for pid in SUBSET:
        with TraceReader(out / "prompts" / f"{pid}.ref.h5") as a, TraceReader(out / "prompts" / f"{pid}.run.h5") as b:
            la, lb = _log_softmax(a.read("logits")), _log_softmax(b.read("logits"))
            t = np.asarray(a.tokens())
        assert la.shape[0] == len(t) and (la.argmax(axis=1) == t).all()  # REF is greedy: its token is its argmax
        kl += list((np.exp(la) * (la - lb)).sum(axis=1))
        top1 += list((lb.argmax(axis=1) == t).astype(float))
        rows = np.arange(len(t))
        pr += list(la[rows, t])
        pq += list(lb[rows, t])
    kl, top1, pr, pq = map(np.array, (kl, top1, pr, pq))
    n = len(kl)
    s = summary["run"]
    assert s["positions"] == n and n > 10
    assert s["kl"]["mean"] == pytest.approx(kl.mean(), rel=1e-9)
    assert s["kl"]["stderr"] == pytest.approx(kl.std(ddof=1) / math.sqrt(n), rel=1e-6)
    assert s["kl"]["max"] == pytest.approx(kl.max(), rel=1e-9)
    dp = np.exp(pq) - np.exp(pr)
    for q in PCTS:
        assert s["kl"]["percentiles"][f"p{q:g}"] == pytest.approx(np.percentile(kl, q), rel=1e-6, abs=1e-15)
        assert s["delta_p"]["percentiles"][f"p{q:g}"] == pytest.approx(np.percentile(dp, q), rel=1e-6, abs=1e-12)
    assert s["delta_p"]["rms"] == pytest.approx(math.sqrt((dp**2).mean()), rel=1e-9)
    r = top1.mean()
    assert s["top1"]["agreement"] == pytest.approx(r) and s["top1"]["stderr"] == pytest.approx(
        math.sqrt(r * (1 - r) / n)
    )
    assert s["perplexity"]["ref"] == pytest.approx(math.exp(-pr.mean()), rel=1e-9)
    assert s["perplexity"]["run"] == pytest.approx(math.exp(-pq.mean()), rel=1e-9)
    assert s["perplexity"]["ratio"] == pytest.approx(math.exp(pr.mean() - pq.mean()), rel=1e-9)
    assert s["kl"]["mean"] > 1e-4  # int4 weights: the statistics are of a real difference, not of zeros
    # the text, the page and the links
    text = lab["first"].stdout
    assert f"RUN vs REF: {n} token positions" in text and "verdict:" in text
    page = (out / "summary.html").read_text()
    for w in summary["worst_first"]:
        assert (out / w["report"]).is_file() and f'href="{w["report"]}"' in page
    kls = [w["kl_mean"] for w in summary["worst_first"] if w["match"]]
    assert kls == sorted(kls, reverse=True)
    assert lab["first"].exit_code == (1 if summary["diverging"] else 0)


def test_each_prompts_page_names_the_prompt_and_the_runtime_not_cache_files(lab):
    shipped = {
        d["id"]: d for d in map(json.loads, (embedded_model_dir() / "sweep_prompts.jsonl").read_text().splitlines())
    }
    for pid in ("short-00", "ids-03"):
        page = (lab["root"] / "one" / "prompts" / f"{pid}.html").read_text()
        assert f"recording of prompt {pid}" in page and "RUN: --runtime static-w4g32" in page
        assert "sweep-ref" not in page and "gemma4-sweep-" not in page and str(lab["root"]) not in page
        spec = shipped[pid]
        shown = spec["text"] if "text" in spec else " ".join(map(str, spec["input_ids"]))
        assert html.escape(shown) in page


def test_a_rerun_resumes_and_changed_settings_run_again(lab):
    out = lab["root"] / "one"
    before = (out / "summary.json").read_bytes()
    r = invoke(*lab["args"], "-o", out, env=lab["env"])
    assert f"0 prompt(s) run, {len(SUBSET)} resumed" in r.stdout, r.output
    assert (out / "summary.json").read_bytes() == before
    (out / "prompts" / f"{SUBSET[0]}.json").unlink()  # as if interrupted before this prompt finished
    r = invoke(*lab["args"], "-o", out, env=lab["env"])
    assert f"1 prompt(s) run, {len(SUBSET) - 1} resumed" in r.stdout, r.output
    assert (out / "summary.json").read_bytes() == before  # REF from the cache: the same numbers


def test_a_record_missing_what_the_summary_reads_runs_again(lab, tmp_path):
    """A resume record without kl_mean, kl_max, top1 or its report's name, or whose report is not its
    own page (the summary links it), is not used: the prompt runs again. These passed the check and
    ended the sweep in a KeyError (found by scripts/fuzz_inputs.py --only records)."""
    from gemma4_trace.analysis.corpus import record_ok

    out = tmp_path / "again"
    shutil.copytree(lab["root"] / "one", out)
    path = out / "prompts" / f"{SUBSET[0]}.json"
    good = json.loads(path.read_text())
    assert record_ok(good)
    bad = [{k: v for k, v in good.items() if k != key} for key in ("kl_mean", "kl_max", "top1", "report")]
    bad += [good | {"report": "../../elsewhere.html"}, good | {"report": "javascript:x"}]
    for rec in bad:
        assert not record_ok(rec)
    path.write_text(json.dumps(bad[0]))
    r = invoke(*lab["args"], "-o", out, env=lab["env"])
    assert f"1 prompt(s) run, {len(SUBSET) - 1} resumed" in r.stdout, r.output
    assert json.loads(path.read_text()) == good


def test_two_workers_give_the_numbers_of_one(lab):
    out = lab["root"] / "two"
    r = invoke(*lab["args"], "--workers", 2, "-o", out, env=lab["env"])
    assert r.exit_code == lab["first"].exit_code, r.output
    one = lab["root"] / "one"
    assert json.loads((out / "summary.json").read_text()) == json.loads((one / "summary.json").read_text())
    for pid in SUBSET:
        a = json.loads((one / "prompts" / f"{pid}.json").read_text())
        b = json.loads((out / "prompts" / f"{pid}.json").read_text())
        assert a == b


def test_two_workers_leave_no_process_behind(tmp_path):
    """`trace sweep --workers 2` run under a subreaper (which adopts whatever the sweep orphans):
    once it has exited, nothing of it is left, running or a zombie. multiprocessing's resource
    tracker used to outlive it."""
    import subprocess
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me a story.\nWhat is 2+2?\n")
    reaper = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the sweep's orphans become ours
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
left = []
while True:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid == 0:
        left.append("running")
        break
    left.append("exited after the sweep")
print(rc, left)
"""
    trace = Path(sys.executable).with_name("trace")
    args = [trace, "sweep", prompts, "--runtime", "static", "--workers", "2", "--max-new-tokens", "1"]
    r = subprocess.run([sys.executable, "-c", reaper, *map(str, args), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split(" ", 1)[1].strip() == "[]", r.stdout
    assert r.stdout.split(" ", 1)[0] in ("0", "1"), r.stdout


@pytest.mark.parametrize(
    "content,needles",
    [
        ('{"text": "hi"}\n{"text": "ok"}\n{"txt": "typo"}\n', ["line 3", "txt"]),
        ('{"text": "hi"}\nnot json\n', ["line 2", "JSON"]),
        ('{"input_ids": [1, -2]}\n', ["line 1", "input_ids"]),
        ('{"text": "a", "id": "x"}\n{"text": "b", "id": "x"}\n', ["line 2", "'x'", "line 1"]),
        ('{"text": "a", "image": "nowhere.png"}\n', ["line 1", "nowhere.png"]),
        ('{"text": "a", "id": "../up"}\n', ["line 1", "id"]),
        ("\n\n", ["no prompt"]),
    ],
)
def test_bad_prompt_files_are_refused_in_one_line(tmp_path, content, needles):
    p = tmp_path / "p.jsonl"
    p.write_text(content)
    out = tmp_path / "out"
    one_line_error(invoke("sweep", p, "--runtime", "static", "-o", out), *needles)
    assert not out.exists()


def test_a_prompt_that_fails_is_recorded_and_the_rest_summarised(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "fine", "input_ids": [2, 100]}\n{"id": "huge", "input_ids": [2, 99999]}\n')
    out = tmp_path / "out"
    args = ["sweep", p, "--runtime", "static", "--max-new-tokens", 2, "-o", out]
    r = invoke(*args, env={"GEMMA4_TRACE_CACHE": str(tmp_path / "cache")})
    assert r.exit_code == 1, r.output  # a prompt that did not run is not a pass
    assert "failed to run (1):\n  huge (line 2): " in r.stdout and "99999" in r.stdout, r.output
    assert "verdict: 1 prompts match, 1 failed to run (exit 1)" in r.stdout, r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompts"] == 1 and [f["id"] for f in summary["failed"]] == ["huge"] and summary["skipped"] == []
    assert "99999" in summary["failed"][0]["reason"]
    assert (out / "prompts" / "fine.json").is_file() and not (out / "prompts" / "huge.json").exists()
    page = (out / "summary.html").read_text()
    assert "Failed to run" in page and "99999" in page
    r = invoke(*args, env={"GEMMA4_TRACE_CACHE": str(tmp_path / "cache")})  # a rerun tries it again
    assert r.exit_code == 1 and "1 prompt(s) run, 1 resumed" in r.stdout, r.output


def test_prompts_a_text_decoder_cannot_run_are_refused_up_front_or_skipped(tmp_path):
    shipped = [json.loads(x) for x in (embedded_model_dir() / "sweep_prompts.jsonl").read_text().splitlines()]
    images = [d["id"] for d in shipped if "image" in d]
    assert images, "the shipped set has image prompts"
    p = subset_file(tmp_path, ("short-00", images[0]))
    out = tmp_path / "out"
    env = {"GEMMA4_TRACE_CACHE": str(tmp_path / "cache")}
    r = invoke("sweep", p, "--runtime", "mobius", "--max-new-tokens", 2, "-o", out, env=env)
    one_line_error(r, "1 of 2 prompts cannot run", "runs a text decoder", images[0], "--skip-unsupported")
    assert not out.exists()  # refused before anything ran
    r = invoke("sweep", p, "--runtime", "mobius", "--max-new-tokens", 2, "--skip-unsupported", "-o", out, env=env)
    assert r.exit_code in (0, 1), r.output
    assert f"skipped (--skip-unsupported) (1):\n  {images[0]} (line " in r.stdout, r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompts"] == 1 and [s["id"] for s in summary["skipped"]] == [images[0]]
    assert [w["id"] for w in summary["worst_first"]] == ["short-00"]


def test_usage_refusals(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    one_line_error(invoke("sweep", p, "--runtime", "statc", "-o", tmp_path / "o"), "statc")
    one_line_error(invoke("sweep", p, "--runtime", "static", "--workers", 2, "--ray", "auto", "-o", tmp_path / "o"))
    (tmp_path / "file").write_text("")
    one_line_error(invoke("sweep", p, "--runtime", "static", "-o", tmp_path / "file"), "is a file")


def make_interrupting(loaded, max_seq):
    """A runtime plug-in that is Ctrl-C'd on a long prompt (max_seq over 16), static otherwise."""
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    if max_seq > 16:
        raise KeyboardInterrupt
    return StaticGemma4Runtime(loaded, max_seq)


def test_ctrl_c_keeps_every_finished_prompt_and_a_rerun_resumes(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "input_ids": [2, 100, 101]}\n{"id": "b", "input_ids": [2' + ", 300" * 20 + "]}\n")
    env = {"GEMMA4_TRACE_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "out"
    args = ["sweep", p, "--max-new-tokens", 2, "-o", out]
    r = invoke(*args, "--runtime", "tests.test_sweep:make_interrupting", env=env)
    assert r.exit_code == 130, r.output
    assert r.stderr.strip() == f"error: interrupted; 1 finished prompt(s) kept in {out}/prompts (run again to resume)"
    assert sorted(x.name for x in (out / "prompts").iterdir()) == ["a.html", "a.json"]  # nothing half-written
    assert not (out / "summary.json").exists()
    r = invoke(*args, "--runtime", "tests.test_sweep:make_interrupting", env=env)
    assert r.exit_code == 130  # the same settings: a is not run again, b is interrupted again
    r = invoke(*args, "--runtime", "static", env=env)  # other settings: both run
    assert r.exit_code == 0 and "2 prompt(s) run, 0 resumed" in r.stdout, r.output


def test_ray_missing_is_refused_with_the_extra_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    one_line_error(invoke("sweep", p, "--runtime", "static", "--ray", "auto", "-o", tmp_path / "o"), "[cluster]", "ray")
    assert not (tmp_path / "o").exists()


def test_a_pool_worker_told_to_stop_starts_no_further_prompt_and_finishes_its_clean_up(monkeypatch):
    """A worker whose prompt ended on SIGTERM goes on to the prompts already queued to it (the pool
    catches the SystemExit): none starts. A second SIGTERM (the pool's manager terminates every
    worker once one has exited) does not cut the first prompt's clean-up short: it is ignored."""
    import signal

    from gemma4_trace.analysis import sweep_pool

    ran = []
    monkeypatch.setattr(sweep_pool, "_stopping", False)
    monkeypatch.setattr(sweep_pool, "process_prompt", lambda cfg, spec, out: ran.append(spec) or "outcome")
    assert sweep_pool.pool_task(None, "p1", "out") == "outcome"
    with pytest.raises(SystemExit) as e:
        sweep_pool._terminated(signal.SIGTERM, None)  # the prompt at hand ends
    assert e.value.code == 128 + signal.SIGTERM
    assert sweep_pool._terminated(signal.SIGTERM, None) is None  # a second one: its clean-up goes on
    with pytest.raises(SystemExit):
        sweep_pool.pool_task(None, "p2", "out")
    assert ran == ["p1"]
