"""Trust where the input is none of the files of the other tests here: a model checkpoint (never
replaced by an output, bounded before it loads), sizes and memory (estimated before anything is
allocated), plug-ins (trusted code that may still fail: every failure is one line), the environment
and options, a sweep's output folder, a full disk, Ctrl-C (one line and exit 130, nothing left half
done), and the fuzzer of the inputs that are not traces (scripts/fuzz_inputs.py: GGUF files,
recipes and prompt files together). docs/robustness.md, "Threat model"."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemma4_trace.hf.model import embedded_model_dir
from gemma4_trace.recorder import golden
from tests.support.cli import invoke, one_line_error, ours, without_progress

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "traces" / "golden" / "short.h5"
TRACE = Path(sys.executable).with_name("trace")


# ---------------------------------------------------------------- a model checkpoint
def _model(tmp_path):
    from gemma4_trace.hf.model import resolve_model_dir

    m = tmp_path / "model"
    shutil.copytree(resolve_model_dir(None)[0], m)
    return m


def test_record_output_onto_a_model_file_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(embedded_model_dir(), model)
    before = (model / "config.json").read_bytes()
    one_line_error(
        invoke("record", "--model", model, "--input-ids", "2,10,11", "-o", model / "config.json", "--force"),
        "is the input",
    )
    assert (model / "config.json").read_bytes() == before


def test_export_gguf_never_replaces_the_checkpoint_it_reads(tmp_path):
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    m = _model(tmp_path)
    before = (m / "model.safetensors").read_bytes()
    r = invoke("export-gguf", "--model", m, "-o", m / "model.safetensors", "--force")
    one_line_error(r, "is the input", "model.safetensors")
    os.symlink(m / "config.json", tmp_path / "link.gguf")  # another name for a checkpoint file
    r = invoke("export-gguf", "--model", m, "-o", tmp_path / "link.gguf", "--force")
    one_line_error(r, "is the input", "config.json")
    assert (m / "model.safetensors").read_bytes() == before


def test_an_export_folder_never_replaces_a_checkpoint_file(tmp_path, monkeypatch):
    """A target that is a hard link to a checkpoint file is that file: refused before the model loads."""
    m = _model(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    os.link(m / "config.json", out / "decode.pt2")

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the output paths were checked")

    monkeypatch.setattr("gemma4_trace.hf.model.load_model", refuse)
    r = invoke("export-pt2", "--model", m, "--max-seq", "8", "-o", out, "--force")
    one_line_error(r, "decode.pt2 is the input", "config.json")


def test_model_config_with_a_million_layers_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(embedded_model_dir(), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 10**6
    cfg["text_config"]["layer_types"] = ["sliding_attention"] * 10**6
    (model / "config.json").write_text(json.dumps(cfg))
    one_line_error(
        invoke("record", "--model", model, "--input-ids", "2,10,11", "-o", tmp_path / "t.h5"),
        "num_hidden_layers is 1000000",
    )
    one_line_error(invoke("replay", GOLDEN, "--model", model, "-o", tmp_path / "r.h5"), "num_hidden_layers is 1000000")
    assert not (tmp_path / "t.h5").exists() and not (tmp_path / "r.h5").exists()


# ---------------------------------------------------------------- sizes and memory: refused before allocating
def test_max_seq_too_large_refused_before_allocating(tmp_path):
    line = one_line_error(
        invoke(
            "replay", GOLDEN, "--max-seq", "1000000", "-o", tmp_path / "run.h5", env={"GEMMA4_TRACE_MEMORY_LIMIT": "8G"}
        ),
        "1000000",
    )
    assert ("needs about" in line and "TiB" in line) or "max_position_embeddings" in line, line
    assert not (tmp_path / "run.h5").exists()


def test_static_runtime_estimate(monkeypatch):
    """The estimate itself (the replay tests above may stop first at the tiny model's 2048 positions)."""
    from gemma4_trace.replayer.ops import memory_estimate
    from gemma4_trace.traces import limits as LIM
    from gemma4_trace.traces.errors import TraceToolError

    cfg = json.loads((embedded_model_dir() / "config.json").read_text())
    monkeypatch.setenv("GEMMA4_TRACE_MEMORY_LIMIT", "4G")
    LIM.check_fits(memory_estimate(cfg, 16, 4), "the static runtime for max_seq 16")
    with pytest.raises(TraceToolError, match=r"max_seq 1000000 needs about \d+\.\d GiB .* more than the 4\.0 GiB"):
        LIM.check_fits(memory_estimate(cfg, 1_000_000, 4), "the static runtime for max_seq 1000000")


@pytest.mark.parametrize(
    "max_seq, needle",
    [("8", "exceeds --max-seq 8"), ("15", "exceeds --max-seq 15"), ("4096", "4096 exceeds the model's 2048 positions")],
)
def test_replay_max_seq(tmp_path, max_seq, needle):
    # the short golden: 13 prompt tokens + 3 new tokens = 16; the embedded model has 2048 positions
    res = invoke("replay", str(golden.golden_path("short")), "--max-seq", max_seq, "-o", str(tmp_path / "run.h5"))
    one_line_error(res, needle)
    assert not (tmp_path / "run.h5").exists()


def test_model_too_big_for_the_memory_refused(tmp_path):
    one_line_error(
        invoke("record", "--input-ids", "2,10,11", "-o", tmp_path / "t.h5", env={"GEMMA4_TRACE_MEMORY_LIMIT": "1M"}),
        "the model in",
        "needs about",
        "1.0 MiB available",
    )


def test_recording_too_long_refused(tmp_path):
    # the tiny model's weights (~2 MB) fit in 3 MB; a KV cache for 2003 positions (~4 MB) does not
    one_line_error(
        invoke(
            "record",
            "--input-ids",
            "2,10,11",
            "--max-new-tokens",
            "2000",
            "-o",
            tmp_path / "t.h5",
            env={"GEMMA4_TRACE_MEMORY_LIMIT": "3M"},
        ),
        "recording 3 prompt tokens + 2000 new tokens",
    )


@pytest.mark.parametrize("option", [["--runtime", "static"], ["--runtime", "llama.cpp"]])
def test_memory_running_out_under_ulimit_v_is_one_line(tmp_path, option):
    """Under `ulimit -v` torch's libraries cannot be mapped (ImportError) or a C extension fails an
    allocation without an exception (SystemError): both were 'internal error'."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (400 << 20, 400 << 20))

    out = tmp_path / "o.h5"
    cmd = [sys.executable, "-m", "gemma4_trace", "replay", str(GOLDEN), *option, "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: out of memory (under an address-space limit of 400 MiB, `ulimit -v`)"
    assert not out.exists()


# ---------------------------------------------------------------- plug-ins: failures are one line
@pytest.mark.parametrize(
    "factory,needles",
    [
        ("make_exit_in_factory", ["failed to start", "SystemExit"]),
        ("make_exit_in_prefill", ["runtime hostile failed in prefill", "SystemExit"]),
        ("make_exit_in_decode", ["runtime hostile failed in decode step 1", "SystemExit"]),
        ("make_complex_logits", ["logits as torch.complex64"]),
        ("make_string_logits", ["logits as a str"]),
        ("make_list_logits", ["logits as a list"]),
        ("make_huge_logits_view", ["logits of shape (1000000000000,)"]),
        ("make_wide_probe", ["'embeddings'", "more than 13 row(s) of embeddings may hold"]),
        ("make_complex_probe", ["'embeddings'", "complex64", "expected real numbers"]),
        ("make_evil_error", ["failed in prefill", "first line", "\\n"]),
    ],
)
def test_misbehaving_plugin_is_one_line(tmp_path, factory, needles):
    out = tmp_path / "run.h5"
    one_line_error(
        invoke("replay", GOLDEN, "--runtime", f"tests.support.hostile_plugins:{factory}", "-o", out), *needles
    )
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plugin_name_with_newlines_and_escapes_is_printed_as_one_line(tmp_path):
    out = tmp_path / "run.h5"
    r = invoke("replay", GOLDEN, "--runtime", "tests.support.hostile_plugins:make_evil_name", "-o", out)
    assert r.exit_code == 0, r.output
    # one line of result on stdout (the plain phase lines go to stderr), nothing raw anywhere
    assert "\x1b" not in r.output and len(ours(r.stdout).splitlines()) == 1 and "evil\\nname" in r.stdout
    for args in (["show", out], ["diff", GOLDEN, out]):
        r = invoke(*args)
        assert r.exit_code in (0, 1) and "\x1b" not in r.output and "\x07" not in r.output, r.output
    assert "evil\\nname" in invoke("show", out).output


# ---------------------------------------------------------------- the environment and options
def test_inputs_that_were_internal_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_TRACE_MEMORY_LIMIT", "1e400")
    r = invoke("record", "--input-ids", "2,17", "--max-new-tokens", "1", "-o", tmp_path / "a.h5")
    one_line_error(r, "GEMMA4_TRACE_MEMORY_LIMIT='1e400': expected bytes", out=tmp_path / "a.h5")
    monkeypatch.delenv("GEMMA4_TRACE_MEMORY_LIMIT")
    # invalid UTF-8 on the command line arrives as lone surrogates
    r = invoke("record", "--prompt", "\udcff\udcfe", "--max-new-tokens", "1", "-o", tmp_path / "b.h5")
    one_line_error(r, "the prompt is not valid Unicode text", out=tmp_path / "b.h5")
    m = _model(tmp_path)
    with open(m / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    r = invoke("record", "--model", m, "--input-ids", "2,17", "--max-new-tokens", "1", "-o", tmp_path / "c.h5")
    one_line_error(r, "cannot load", "incomplete metadata", out=tmp_path / "c.h5")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "prompts").write_text("")
    r = invoke("sweep", prompts, "--runtime", "static", "--max-new-tokens", "1", "-o", tmp_path / "s")
    one_line_error(r, "prompts is not a folder")


def test_a_bad_llama_cpp_ubatch_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.runtimes.llamacpp.runtime import gguf_artifact

    gguf_artifact(load_model(None), "F32").close()  # cached before: its "converting" line is not the run's answer
    monkeypatch.setenv("GEMMA4_TRACE_LLAMACPP_UBATCH", "0")
    out = tmp_path / "o.h5"
    r = invoke("replay", GOLDEN, "--runtime", "llama.cpp", "-o", out)
    one_line_error(r, "GEMMA4_TRACE_LLAMACPP_UBATCH='0': expected a whole number from 1 to 65536", out=out)


def test_a_ray_address_where_nothing_answers_is_one_line_at_once(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[cluster]')")
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    r = invoke("sweep", prompts, "--runtime", "static", "--ray", f"127.0.0.1:{port}", "-o", tmp_path / "s")
    one_line_error(r, f"--ray 127.0.0.1:{port}: no Ray cluster answers there")
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- a sweep's output folder
def test_a_summary_the_sweep_did_not_write_is_replaced_only_with_force(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    out = tmp_path / "s"
    out.mkdir()
    (out / "summary.json").write_text('{"mine": 1}\n')
    args = ("sweep", prompts, "--runtime", "static", "--max-new-tokens", "2", "-o", out)
    one_line_error(invoke(*args), "summary.json exists and is not an earlier sweep's summary (pass --force")
    assert (out / "summary.json").read_text() == '{"mine": 1}\n' and not (out / "prompts").exists()
    assert invoke(*args, "--force").exit_code == 0
    assert invoke(*args).exit_code == 0  # its own summary now: a rerun replaces it without --force
    (out / "summary.html").unlink()
    (out / "summary.html").mkdir()
    one_line_error(invoke(*args, "--force"), "summary.html exists and is not a regular file")


def test_a_sweeps_files_all_get_the_users_usual_mode(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    out = tmp_path / "s"
    assert invoke("sweep", prompts, "--runtime", "static", "--max-new-tokens", "1", "-o", out).exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*out.iterdir(), *(out / "prompts").iterdir()] if p.is_file()}
    assert "line00001.html" in modes and set(modes.values()) == {0o666 & ~umask}, modes


# ---------------------------------------------------------------- disk full
def _unshare_ok() -> bool:
    return (
        shutil.which("unshare") is not None
        and subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(not _unshare_ok(), reason="needs unprivileged user+mount namespaces to mount a tiny tmpfs")
@pytest.mark.parametrize(
    "size,args",
    [
        ("64k", ["replay", GOLDEN, "-o", "{d}/run.h5"]),
        ("4k", ["diff", GOLDEN, GOLDEN, "--report", "{d}/report.html"]),
    ],
)
def test_disk_full_is_one_line(tmp_path, size, args):
    d = tmp_path / "small"
    d.mkdir()
    cmd = " ".join(str(a).format(d=d) for a in args)
    script = f"mount -t tmpfs -o size={size} none {d} && exec {TRACE} {cmd}; "
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    one_line_error(r, "no space left on device writing")


# ---------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize(
    "command",
    [
        [str(TRACE), "show", str(GOLDEN)],
        [str(TRACE), "diff", str(GOLDEN), str(GOLDEN), "--report", "{tmp}-r.html"],
        ["-m", "gemma4_trace", "show", str(GOLDEN)],
    ],
)
def test_ctrl_c_while_starting_is_one_line_and_exit_130(tmp_path, command):
    """SIGINT at several moments after the tool's first instruction (the import of
    gemma4_trace.entry, seen through -X importtime), while click, numpy, h5py are imported:
    every interrupted run exits 130 with one line and no traceback. (Before that instruction
    the interpreter itself is starting, which no program controls.)"""
    interrupted = 0
    for i, delay in enumerate((0.0, 0.01, 0.03, 0.1, 0.2, 0.4)):
        p = subprocess.Popen(
            [sys.executable, "-X", "importtime", *[c.format(tmp=tmp_path / str(i)) for c in command]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for line in p.stderr:  # importtime reports each import as it completes
            if line.rstrip().endswith("gemma4_trace.entry"):
                break
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        err = "".join(ln for ln in err.splitlines(keepends=True) if not ln.startswith("import time:"))
        assert "Traceback" not in err, (delay, err)
        # finished before the signal came (or it came while the interpreter was exiting, after the
        # output was complete: Python restores the default handler at exit); a finished diff also
        # says on stderr where its report went
        said = [ln for ln in ours(err).splitlines() if ln.strip() and not ln.startswith("wrote ")]
        if p.returncode == 0 or (p.returncode == -signal.SIGINT and out.strip() and not said):
            continue
        assert p.returncode == 130, (delay, p.returncode, err)
        # blank lines aside: -X importtime's own report can leave one when the signal cuts it short
        lines = without_progress([ln for ln in ours(err).splitlines() if ln.strip()])
        assert len(lines) == 1 and lines[0].startswith("error: interrupted"), (delay, err)
        left = [f.name for f in tmp_path.iterdir() if f.name.startswith((f"{i}-", "."))]
        assert not left, left  # an interrupted diff leaves no report, not even a partial one
        interrupted += 1
    assert interrupted >= 3


CTRL_C_IN_A_CALLBACK = """
import signal, sys, time, weakref
from gemma4_trace import entry
signal.signal(signal.SIGINT, signal.default_int_handler)
if sys.argv[1] == "hook":
    sys.unraisablehook = entry._interrupt_again
class A:
    pass
a = A()
def callback(ref):
    raise KeyboardInterrupt  # what a Ctrl-C arriving while the collector runs this callback does
ref = weakref.ref(a, callback)
try:
    del a
    for _ in range(2000):
        time.sleep(0.001)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize("hook", ["hook", "python's own"])
def test_ctrl_c_inside_a_weakref_callback_still_interrupts(hook):
    """Python can only print and ignore an exception raised in a weakref callback or __del__: a
    Ctrl-C landing there printed "Exception ignored ... Traceback" and was lost. The CLI's hook
    (gemma4_trace/entry.py) delivers it again, where it unwinds."""
    p = subprocess.run([sys.executable, "-c", CTRL_C_IN_A_CALLBACK, hook], capture_output=True, text=True, cwd=ROOT)
    if hook == "hook":
        assert (p.stdout, p.stderr) == ("interrupted\n", "")
    else:  # the failure the hook exists for
        assert p.stdout == "not interrupted\n" and "Exception ignored" in p.stderr


@pytest.mark.slow
def test_ctrl_c_with_two_workers_is_one_line_and_leaves_nothing_half_done(tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C) while two workers record: one line,
    exit 130, no worker's temporary folder, no partial REF in the cache."""
    import json
    import signal
    import subprocess
    import sys
    import time

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": [2] + [100 + i] * 30}) + "\n" for i in range(6)))
    tmp, cache = tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "GEMMA4_TRACE_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "gemma4_trace", "sweep", str(prompts), "--runtime", "static"]
    cmd += ["--max-new-tokens", "8", "--workers", "2", "-o", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((cache / "sweep-ref").glob(".*.h5")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)  # until a worker is recording a REF
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = without_progress(err.decode().splitlines())
    assert len(lines) == 1 and lines[0].startswith("error: interrupted; "), lines
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("gemma4-")]
    assert not list((cache / "sweep-ref").glob(".*"))


# ---------------------------------------------------------------- GGUF, recipe and prompt files fuzzed together
SCRIPT = ROOT / "scripts" / "fuzz_inputs.py"


def fuzzer(monkeypatch, tmp_path):
    """scripts/fuzz_inputs.py as a module, its cases' artifact cache in tmp_path (the suite's shared
    cache, GEMMA4_TRACE_CACHE before this, is the one its exports come from: `run(builds_cache=)`)."""
    spec = importlib.util.spec_from_file_location("fuzz_inputs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_inputs"] = mod
    spec.loader.exec_module(mod)
    monkeypatch.setenv("GEMMA4_TRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return mod


@pytest.mark.slow  # fuzzing: 160 cases, about 25 s
def test_hostile_gguf_recipe_and_prompt_files_are_one_line_each(monkeypatch, tmp_path):
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    mod = fuzzer(monkeypatch, tmp_path)
    classes = ("gguf", "recipe", "prompts") + (("mmproj",) if importlib.util.find_spec("llama_cpp") else ())
    counts = mod.run(40 * len(classes), 2024, classes, say=lambda line: None)
    failures = [f for c in classes for f in counts[c]["failures"]]
    assert not failures, failures[:5]
    for c in classes:
        assert counts[c]["cases"] == 40
        assert counts[c]["exit"][2] > 10  # the mutations reach the checks
    assert sum(counts[c]["exit"][0] for c in classes) > 3  # and some still run: the base inputs are valid


@pytest.mark.slow  # about 40 s: the configs that pass their check load the model
def test_hostile_model_configs_and_pt2_graphs_are_one_line_each(monkeypatch, tmp_path):
    """16 cases of each (a config case loads the model when its config passes: about 2 s each;
    scripts/fuzz_inputs.py --only config / --only pt2 runs hundreds)."""
    mod = fuzzer(monkeypatch, tmp_path)
    counts = mod.run(32, 7, ("config", "pt2"), say=lambda line: None)
    failures = [f for c in ("config", "pt2") for f in counts[c]["failures"]]
    assert not failures, failures[:5]
    for c in ("config", "pt2"):
        assert counts[c]["cases"] == 16 and counts[c]["exit"][2] > 3 and counts[c]["exit"][0] > 0, (c, counts[c])


@pytest.mark.slow  # a LiteRT export (cached) and a sweep
def test_hostile_tflite_graphs_and_sweep_records_are_one_line_each(monkeypatch, tmp_path):
    """16 cases of each: a .tflite for the overlay (with the [litert] extra), and a sweep's resume
    record, which a sweep takes or runs again, never dies on (scripts/fuzz_inputs.py --only tflite
    / --only records runs hundreds)."""
    mod = fuzzer(monkeypatch, tmp_path)
    classes = ("records",) + (("tflite",) if importlib.util.find_spec("ai_edge_litert") else ())
    counts = mod.run(16 * len(classes), 7, classes, say=lambda line: None)
    failures = [f for c in classes for f in counts[c]["failures"]]
    assert not failures, failures[:5]
    assert counts["records"]["cases"] == 16 and counts["records"]["exit"][2] == 0  # a record never stops a sweep
    if "tflite" in classes:
        assert counts["tflite"]["cases"] == 16 and counts["tflite"]["exit"][2] > 3 and counts["tflite"]["exit"][0] > 0


@pytest.mark.slow  # the LiteRT export (the suite's cache) and the cases whose folders still run
def test_hostile_litert_folders_are_one_line_each(monkeypatch, tmp_path):
    """8 cases: the user's own litert-torch folder (`--tflite`), one of its files mutated from the tool's
    own export (scripts/fuzz_inputs.py --only tflitedir runs hundreds; its `pte` class, the user's
    ExecuTorch programs, lowers the embedded model's programs first, about 2.5 minutes cold, and runs
    from the command line only: docs/robustness.md)."""
    import os

    if importlib.util.find_spec("ai_edge_litert") is None:
        pytest.skip("needs the [litert] extra")
    mod = fuzzer(monkeypatch, tmp_path)
    counts = mod.run(8, 7, ("tflitedir",), say=lambda line: None, builds_cache=os.environ["GEMMA4_TRACE_CACHE"])
    assert not counts["tflitedir"]["failures"], counts["tflitedir"]["failures"][:5]
    assert counts["tflitedir"]["cases"] == 8 and counts["tflitedir"]["exit"][2] > 2, counts["tflitedir"]


@pytest.mark.slow  # the ONNX and OpenVINO exports (the suite's cache) and the cases whose graphs still run
def test_hostile_onnx_graphs_maps_and_openvino_irs_are_one_line_each(monkeypatch, tmp_path):
    """8 cases of each: the user's own ONNX step graphs (`--onnx`), a name map (`--onnx-map`) and an
    OpenVINO IR (`--ir`), each mutated from the tool's own export (scripts/fuzz_inputs.py --only onnx /
    onnxmap / ir runs hundreds)."""
    import os

    needs = {"onnx": ("onnx", "onnxruntime"), "onnxmap": ("onnx", "onnxruntime"), "ir": ("openvino",)}
    classes = tuple(c for c, mods in needs.items() if all(importlib.util.find_spec(m) for m in mods))
    if not classes:
        pytest.skip("needs the [onnx] or [openvino] extra")
    shared = os.environ["GEMMA4_TRACE_CACHE"]
    mod = fuzzer(monkeypatch, tmp_path)
    counts = mod.run(8 * len(classes), 7, classes, say=lambda line: None, builds_cache=shared)
    failures = [f for c in classes for f in counts[c]["failures"]]
    assert not failures, failures[:5]
    for c in classes:
        assert counts[c]["cases"] == 8 and counts[c]["exit"][2] > 2, (c, counts[c])
