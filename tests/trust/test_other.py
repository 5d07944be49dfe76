"""A trace is untrusted input, plug-ins are trusted code that may still fail (docs/robustness.md,
"Threat model"): outputs never replace inputs, memory is estimated before it is allocated,
plug-in failures and odd inputs are one line, Ctrl-C at start-up is one line and exit 130.
Each test here failed before the change it covers (issue 10)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemma4_trace.hf.model import embedded_model_dir
from tests.support import invoke, one_line_error, ours

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "traces" / "golden" / "short.h5"
TRACE = Path(sys.executable).with_name("trace")


# ---------------------------------------------------------------- inputs are never destroyed
@pytest.fixture
def ref(tmp_path):
    p = tmp_path / "a.h5"
    shutil.copyfile(GOLDEN, p)
    return p


def test_replay_output_onto_its_reference_refused(ref, tmp_path):
    before = ref.read_bytes()
    (tmp_path / "hard.h5").hardlink_to(ref)
    (tmp_path / "sym.h5").symlink_to(ref)
    for out in (ref, tmp_path / "hard.h5", tmp_path / "sym.h5", tmp_path / "." / "a.h5"):
        one_line_error(invoke("replay", ref, "-o", out, "--force"), "is the input")
    assert ref.read_bytes() == before


def test_calibrate_output_onto_a_trace_it_reads_refused(ref, tmp_path):
    base = tmp_path / "b.h5"
    shutil.copyfile(ref, base)
    before = base.read_bytes()
    for out in (base, ref):
        one_line_error(invoke("calibrate", ref, base, "-o", out, "--force"), "is the input")
    assert base.read_bytes() == before


def test_diff_report_onto_a_trace_or_a_device_refused(ref, tmp_path):
    before = ref.read_bytes()
    one_line_error(invoke("diff", ref, ref, "--report", ref, "--force"), "is the input")
    assert ref.read_bytes() == before
    tol = tmp_path / "tol.toml"
    tol.write_text("[tokens]\nnear_tie_margin = 0.5\n")
    one_line_error(invoke("diff", ref, ref, "--tolerances", tol, "--report", tol, "--force"), "is the input")
    assert tol.read_text().startswith("[tokens]")
    one_line_error(invoke("diff", ref, ref, "--report", "/dev/null", "--force"), "not a regular file")
    assert Path("/dev/null").is_char_device()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line_error(invoke("diff", ref, ref, "--report", fifo, "--force"), "not a regular file")


def test_record_output_onto_a_model_file_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(embedded_model_dir(), model)
    before = (model / "config.json").read_bytes()
    one_line_error(
        invoke("record", "--model", model, "--input-ids", "2,10,11", "-o", model / "config.json", "--force"),
        "is the input",
    )
    assert (model / "config.json").read_bytes() == before


def test_show_quotes_a_long_prompt_in_part(tmp_path):
    """A 4 MB prompt text (under the attribute cap): `trace show` prints a summary, not the text."""
    import h5py

    p = tmp_path / "long-prompt.h5"
    shutil.copyfile(GOLDEN, p)
    with h5py.File(p, "r+") as f:
        f["inputs"].attrs["prompt_text"] = "z" * (4 << 20)
    r = invoke("show", p)
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("prompt"))
    assert len(r.output) < 10_000 and "(4194304 characters)" in line, line[:300]


# ---------------------------------------------------------------- not regular files
def test_fifo_socket_and_device_refused_as_traces(tmp_path):
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.h5"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        for path, word in ((fifo, "FIFO"), (sock_path, "socket"), (Path("/dev/zero"), "character device")):
            for args in (
                ["show", path],
                ["show", "--hash", path],
                ["diff", GOLDEN, path],
                ["diff", path, GOLDEN],
                ["replay", path, "-o", tmp_path / "out.h5"],
            ):
                one_line_error(invoke(*args), str(path), word, "not a regular file")
    finally:
        sock.close()
    assert not (tmp_path / "out.h5").exists()


# ---------------------------------------------------------------- bounded memory before allocating
def _with_header(tmp_path, max_new_tokens: int) -> Path:
    import h5py

    p = tmp_path / "long.h5"
    shutil.copyfile(GOLDEN, p)
    with h5py.File(p, "r+") as f:
        f["inputs"].attrs["max_new_tokens"] = max_new_tokens
    return p


def test_replay_with_a_huge_max_new_tokens_refused_before_allocating(tmp_path):
    ref = _with_header(tmp_path, 40_000)
    line = one_line_error(
        invoke("replay", ref, "-o", tmp_path / "run.h5", env={"GEMMA4_TRACE_MEMORY_LIMIT": "4G"}), "40016"
    )
    # the memory estimate (about 78 GiB) or, first for the tiny model, its 2048 positions
    assert ("needs about" in line and "4.0 GiB available" in line) or "max_position_embeddings" in line, line
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


def test_max_seq_too_large_refused_before_allocating(tmp_path):
    line = one_line_error(
        invoke(
            "replay", GOLDEN, "--max-seq", "1000000", "-o", tmp_path / "run.h5", env={"GEMMA4_TRACE_MEMORY_LIMIT": "8G"}
        ),
        "1000000",
    )
    assert ("needs about" in line and "TiB" in line) or "max_position_embeddings" in line, line
    assert not (tmp_path / "run.h5").exists()


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
    one_line_error(invoke("replay", GOLDEN, "--runtime", f"tests.hostile_plugins:{factory}", "-o", out), *needles)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plugin_name_with_newlines_and_escapes_is_printed_as_one_line(tmp_path):
    out = tmp_path / "run.h5"
    r = invoke("replay", GOLDEN, "--runtime", "tests.hostile_plugins:make_evil_name", "-o", out)
    assert r.exit_code == 0, r.output
    # one line of result on stdout (the plain phase lines go to stderr), nothing raw anywhere
    assert "\x1b" not in r.output and len(ours(r.stdout).splitlines()) == 1 and "evil\\nname" in r.stdout
    for args in (["show", out], ["diff", GOLDEN, out]):
        r = invoke(*args)
        assert r.exit_code in (0, 1) and "\x1b" not in r.output and "\x07" not in r.output, r.output
    assert "evil\\nname" in invoke("show", out).output


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


# ---------------------------------------------------------------- odd tolerances files
@pytest.mark.parametrize(
    "text,needle",
    [
        ("x = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested too deeply"),
        ("[tokens]\nnear_tie_margin = nan\n", "near_tie_margin must be a number >= 0"),
    ],
)
def test_hostile_tolerances_file(tmp_path, text, needle):
    p = tmp_path / "tol.toml"
    p.write_text(text)
    one_line_error(invoke("diff", GOLDEN, GOLDEN, "--tolerances", p), str(p), needle)


# ---------------------------------------------------------------- Ctrl-C at start-up
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
        # output was complete: Python restores the default handler at exit)
        if p.returncode == 0 or (p.returncode == -signal.SIGINT and out.strip() and not ours(err).strip()):
            continue
        assert p.returncode == 130, (delay, p.returncode, err)
        # blank lines aside: -X importtime's own report can leave one when the signal cuts it short
        lines = [ln for ln in ours(err).splitlines() if ln.strip()]
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
