"""Trust, fourth round (issue 33): special files on the GGUF inputs, and no output that replaces one
of the command's own inputs (a checkpoint file, the prompts file, REF), `--force` or not."""

from __future__ import annotations

import os
import shutil

import pytest

from gemma4_trace.recorder.golden import golden_path
from tests.support import invoke, one_line_error

REF = golden_path("short")


def _model(tmp_path):
    from gemma4_trace.hf.model import resolve_model_dir

    m = tmp_path / "model"
    shutil.copytree(resolve_model_dir(None)[0], m)
    return m


@pytest.mark.parametrize("option", [["--runtime", "llama.cpp", "--gguf"], ["--weights-from"]])
@pytest.mark.parametrize("special", ["fifo", "folder", "/dev/zero"])
def test_a_gguf_input_that_is_no_regular_file_is_one_line_without_reading(tmp_path, option, special):
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    if option[-1] == "--gguf":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = {"fifo": tmp_path / "fifo", "folder": tmp_path, "/dev/zero": "/dev/zero"}[special]
    if special == "fifo":
        os.mkfifo(path)  # a plain open would wait for a writer forever
    out = tmp_path / "o.h5"
    r = invoke("replay", REF, *option, path, "-o", out)
    kind = "a folder" if special == "folder" else "a device, FIFO or socket"
    one_line_error(r, "GGUF file", f"not a regular file ({kind})", out=out)


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


@pytest.mark.parametrize("where", ["summary.json", "summary.html", "prompts/mine.txt", "link"])
def test_a_sweep_never_writes_over_its_prompts_file(tmp_path, where):
    out = tmp_path / "s"
    (out / "prompts").mkdir(parents=True)
    prompts = out / where if where != "link" else tmp_path / "link.txt"
    if where == "link":
        (out / "summary.json").write_text("Hello!\n")
        os.symlink(out / "summary.json", prompts)
    else:
        prompts.write_text("Hello!\n")
    r = invoke("sweep", prompts, "--runtime", "static", "--max-new-tokens", "2", "-o", out)
    one_line_error(r, "would replace the prompts file")
    assert prompts.read_text() == "Hello!\n"


def test_a_repro_never_replaces_ref_and_a_folder_target_is_one_line(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    ref = d / "inputs.npz"  # REF under the name a repro writes
    shutil.copyfile(REF, ref)
    run = tmp_path / "bug.h5"
    assert invoke("replay", ref, "--runtime", "tests.bug_zoo:make_no_softcap", "-o", run).exit_code == 0
    before = ref.read_bytes()
    r = invoke("repro", ref, run, "--at", "0,1", "-o", d, "--force")
    one_line_error(r, "inputs.npz is the input")
    assert ref.read_bytes() == before and sorted(p.name for p in d.iterdir()) == ["inputs.npz"]
    other = tmp_path / "o"
    (other / "weights.npz").mkdir(parents=True)
    r = invoke("repro", ref, run, "--at", "0,1", "-o", other, "--force")
    one_line_error(r, "weights.npz exists and is not a regular file")
    assert sorted(p.name for p in other.iterdir()) == ["weights.npz"]  # nothing of the repro placed


def test_a_gguf_with_a_tail_after_its_last_tensor_is_refused(tmp_path):
    """llama.cpp maps the whole file: bytes past the last tensor's data (a sparse 1 TiB tail made
    the child touch 22 GB) are refused in the header check, before any engine starts."""
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    g = tmp_path / "m.gguf"
    assert invoke("export-gguf", "-o", g).exit_code == 0
    out = tmp_path / "o.h5"
    assert invoke("replay", REF, "--weights-from", g, "-o", out).exit_code == 0  # the file as written: fine
    with open(g, "ab") as f:
        f.truncate(g.stat().st_size + (1 << 30))  # a sparse GiB after the data
    r = invoke("replay", REF, "--weights-from", g, "-o", tmp_path / "o2.h5")
    one_line_error(r, "bytes after its last tensor's data", out=tmp_path / "o2.h5")


def test_a_cache_entry_whose_manifest_is_a_fifo_is_rebuilt_not_read(tmp_path):
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    cache = tmp_path / "cache"
    assert invoke("export-gguf", "--cache-dir", cache, "-o", tmp_path / "a.gguf").exit_code == 0
    (entry,) = (cache / "gguf").iterdir()
    (entry / "manifest.json").unlink()
    os.mkfifo(entry / "manifest.json")  # reading it would wait for a writer forever
    r = invoke("export-gguf", "--cache-dir", cache, "-o", tmp_path / "b.gguf")
    assert r.exit_code == 0, r.output
    assert "the cached copy was stale: unreadable (manifest" in r.stderr and "not a regular file" in r.stderr
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_a_sweep_record_that_is_a_fifo_is_run_again_not_read(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    out = tmp_path / "s"
    (out / "prompts").mkdir(parents=True)
    os.mkfifo(out / "prompts" / "line00001.json")
    r = invoke("sweep", prompts, "--runtime", "static", "--max-new-tokens", "2", "-o", out)
    assert r.exit_code == 0, r.output
    assert "1 prompt(s) run, 0 resumed" in r.stdout
    assert (out / "prompts" / "line00001.json").is_file()


@pytest.mark.parametrize("bad", ["abc\n", "abc\r", "a\x1bb", "ab\u2028"])
def test_a_prompt_id_with_a_control_character_is_refused(tmp_path, bad):
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": bad, "text": "Hello!"}) + "\n")
    r = invoke("sweep", prompts, "--runtime", "static", "-o", tmp_path / "s")
    one_line_error(r, "id")
    assert not (tmp_path / "s").exists()


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
    monkeypatch.setenv("GEMMA4_TRACE_LLAMACPP_UBATCH", "0")
    out = tmp_path / "o.h5"
    r = invoke("replay", REF, "--runtime", "llama.cpp", "-o", out)
    one_line_error(r, "GEMMA4_TRACE_LLAMACPP_UBATCH='0': expected a whole number from 1 to 65536", out=out)


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(tmp_path):
    """The embedded model: 2048 positions, no token longer than 16 bytes; a 10 MB line took minutes
    in the tokenizer before the token count refused it (whose line says "the prompt has N tokens")."""
    r = invoke("record", "--prompt", "a" * (2048 * 16 + 1), "--max-new-tokens", "1", "-o", tmp_path / "a.h5")
    one_line_error(r, "the prompt is 32769 bytes: at least 2049 tokens", "2048 positions", out=tmp_path / "a.h5")
    r = invoke("record", "--prompt", "a" * 2048 * 16, "--max-new-tokens", "1", "-o", tmp_path / "b.h5")
    one_line_error(r, "the prompt has", "tokens, more than the model's 2048 positions", out=tmp_path / "b.h5")


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


def test_a_sweeps_files_all_get_the_users_usual_mode(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    out = tmp_path / "s"
    assert invoke("sweep", prompts, "--runtime", "static", "--max-new-tokens", "1", "-o", out).exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*out.iterdir(), *(out / "prompts").iterdir()] if p.is_file()}
    assert "line00001.html" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def _gguf_with_one_key(path, key: bytes, vtype: int, payload: bytes) -> None:
    import struct

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype)
    path.write_bytes(head + payload)


def test_gguf_metadata_is_bounded_before_it_is_parsed(tmp_path):
    """An array of 2^24 empty strings took 76 s to parse; a 64 MiB architecture name made a 67 MB
    error line."""
    import struct

    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    from gemma4_trace.replayer.runtimes.llamacpp import gguf_reader as R

    g = tmp_path / "a.gguf"
    _gguf_with_one_key(g, b"x", 9, struct.pack("<IQ", 8, (1 << 24)) + bytes(64))  # ARRAY of STRING
    r = invoke("replay", REF, "--weights-from", g, "-o", tmp_path / "o.h5")
    one_line_error(r, f"claims {1 << 24} items (at most {R.MAX_ARRAY})")
    name = b"general.architecture"
    big = b"q" * (1 << 20)
    _gguf_with_one_key(g, name, 8, struct.pack("<Q", len(big)) + big)  # STRING
    r = invoke("replay", REF, "--weights-from", g, "-o", tmp_path / "o.h5")
    line = one_line_error(r, "architecture 'qqqq")
    assert len(line) < 600, len(line)


def test_swapped_or_edited_cached_sweep_refs_are_recorded_again(tmp_path):
    """Two prompts' cached REFs swapped (or one edited) gave each prompt the other's numbers with
    exit 0; now each cached REF must hash to its stamp and hold its own prompt."""
    import json

    cache = tmp_path / "cache"
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\nName a color.\n")
    args = ("sweep", prompts, "--runtime", "static", "--max-new-tokens", "2", "--cache-dir", cache)
    assert invoke(*args, "-o", tmp_path / "a").exit_code == 0
    refs = sorted((cache / "sweep-ref").glob("*.h5"))
    assert len(refs) == 2 and all(r.with_suffix(".sha256").is_file() for r in refs)
    a, b = (r.read_bytes() for r in refs)
    from gemma4_trace.traces.inputs import sha256_file

    refs[0].write_bytes(b)  # swapped, with stamps that match the swapped files: the prompt check tells
    refs[1].write_bytes(a)
    for r in refs:
        r.with_suffix(".sha256").write_text(sha256_file(r))
    assert invoke(*args, "-o", tmp_path / "b").exit_code == 0
    assert refs[0].read_bytes() != b and refs[1].read_bytes() != a  # both recorded again, not used
    # an edited REF under its old stamp: the hash check tells
    with open(refs[0], "r+b") as f:
        f.seek(-64, 2)
        f.write(bytes(64))
    assert invoke(*args, "-o", tmp_path / "c").exit_code == 0
    for p in ("line00001", "line00002"):
        x, y, z = (json.loads((tmp_path / d / "prompts" / f"{p}.json").read_text()) for d in "abc")
        assert x["positions"] == y["positions"] == z["positions"], p  # each prompt's own positions
        assert x["kl_mean"] == y["kl_mean"] == z["kl_mean"] and x["tokens"] == y["tokens"] == z["tokens"], p


def _retype_tensor(path, name: bytes, ggml_type: int) -> None:
    """Rewrite one tensor's type field in a GGUF header (name, n_dims, dims, then the type)."""
    import struct

    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("ggml_type,name", [(24, "I8"), (25, "I16"), (26, "I32")])  # F64 overlaps: refused before
def test_a_weight_of_an_integer_or_double_type_is_refused_even_when_mismatches_are_allowed(tmp_path, ggml_type, name):
    """Such weights crashed llama.cpp's child; they are no config mismatch to allow."""
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    g = tmp_path / "m.gguf"
    assert invoke("export-gguf", "-o", g).exit_code == 0
    _retype_tensor(g, b"blk.0.attn_q.weight", ggml_type)
    for more in ((), ("--allow-config-mismatch",)):
        out = tmp_path / "o.h5"
        r = invoke("replay", REF, "--weights-from", g, *more, "-o", out)
        one_line_error(r, f"tensor 'blk.0.attn_q.weight' has type {name}", out=out)


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


def test_a_resumed_record_with_wrong_types_is_run_again(tmp_path):
    import json

    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    out = tmp_path / "s"
    args = ("sweep", prompts, "--runtime", "static", "--max-new-tokens", "2", "-o", out)
    assert invoke(*args).exit_code == 0
    rec_path = out / "prompts" / "line00001.json"
    good = json.loads(rec_path.read_text())
    edits = {
        "kl_mean": "big",
        "match": 1,
        "tokens": None,
        "positions": {"kl": ["x"]},
        "first_divergence": {"step": "0"},
        "id": "other",
    }
    for key, value in edits.items():
        rec_path.write_text(json.dumps({**good, key: value}))
        r = invoke(*args)
        assert r.exit_code == 0 and "1 prompt(s) run, 0 resumed" in r.stdout, (key, r.output)
        assert json.loads(rec_path.read_text()) == good, key


def test_a_prompts_file_over_16_mib_is_refused_unread(tmp_path):
    prompts = tmp_path / "p.txt"
    with open(prompts, "wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: a read would be quick; the size alone refuses it
    one_line_error(invoke("sweep", prompts, "--runtime", "static", "-o", tmp_path / "s"), "more than the 16777216")


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
    lines = err.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted; "), lines
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("gemma4-")]
    assert not list((cache / "sweep-ref").glob(".*"))


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
    cmd = [sys.executable, "-m", "gemma4_trace", "replay", str(REF), *option, "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: out of memory (under an address-space limit of 400 MiB, `ulimit -v`)"
    assert not out.exists()


@pytest.mark.parametrize("swap", ["folder", "link"])
def test_a_cached_gguf_that_is_a_folder_or_a_link_is_rebuilt(tmp_path, monkeypatch, swap):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    monkeypatch.setenv("GEMMA4_TRACE_CACHE", str(tmp_path / "cache"))
    assert invoke("replay", REF, "--runtime", "llama.cpp", "-o", tmp_path / "a.h5").exit_code == 0
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()
    good = (entry / "model.gguf").read_bytes()
    (entry / "model.gguf").unlink()
    if swap == "folder":
        (entry / "model.gguf").mkdir()
    else:
        (tmp_path / "elsewhere.gguf").write_bytes(good)
        (entry / "model.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    r = invoke("replay", REF, "--runtime", "llama.cpp", "-o", tmp_path / "b.h5")
    assert r.exit_code == 0, r.output
    path = entry / "model.gguf"
    assert path.is_file() and not path.is_symlink() and path.read_bytes() == good


def test_a_sweep_with_a_cache_it_cannot_write_is_one_line(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    r = invoke("sweep", prompts, "--runtime", "static", "--cache-dir", "/dev/null/x", "-o", tmp_path / "s")
    one_line_error(r, "cannot write in the artifact cache /dev/null/x/sweep-ref (Not a directory)")
