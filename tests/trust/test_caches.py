"""What the tool reads back of its own earlier work is untrusted input: an artifact cache entry
whose manifest or GGUF is a FIFO, a folder or a link is rebuilt, never read or followed; a sweep's
cached REFs must hash to their stamps and hold their own prompts, else they are recorded again; a
sweep's record of a finished prompt that is a FIFO or holds wrong types is run again; a cache that
cannot be written is one line."""

from __future__ import annotations

import os

import pytest

from gemma4_trace.recorder.golden import golden_path
from tests.support.cli import invoke, one_line_error

REF = golden_path("short")


# ---------------------------------------------------------------- the artifact cache
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


@pytest.mark.parametrize("how", ["--cache-dir", "GEMMA4_TRACE_CACHE"])
def test_a_relative_cache_folder_is_the_current_folders_for_every_builder(tmp_path, monkeypatch, how):
    """A builder whose child runs in a folder of its own (litert-torch's export runs in its work
    folder) gets an absolute entry folder, so a relative cache still names the current folder's."""
    from gemma4_trace.replayer import artifacts

    monkeypatch.chdir(tmp_path)
    seen = []

    def build(folder):
        seen.append(folder)
        (folder / "made").write_text("x")

    if how == "--cache-dir":
        art = artifacts.artifact_folder("probe", {"n": 1}, build, cache="rel-cache", say=None)
    else:
        monkeypatch.setenv("GEMMA4_TRACE_CACHE", "rel-cache")
        art = artifacts.artifact_folder("probe", {"n": 1}, build, say=None)
    assert seen[0].is_absolute() and art.path.is_absolute()
    assert art.path.parent == tmp_path / "rel-cache" / "probe" and (art.path / "made").is_file()


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


# ---------------------------------------------------------------- a sweep's cached REFs
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


def test_a_sweep_with_a_cache_it_cannot_write_is_one_line(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    r = invoke("sweep", prompts, "--runtime", "static", "--cache-dir", "/dev/null/x", "-o", tmp_path / "s")
    one_line_error(r, "cannot write in the artifact cache /dev/null/x/sweep-ref (Not a directory)")


# ---------------------------------------------------------------- a sweep's records of finished prompts (resuming)
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


def test_a_resumed_record_with_wrong_types_is_run_again(tmp_path):
    import json

    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello!\n")
    out = tmp_path / "s"
    args = ("sweep", prompts, "--runtime", "static", "--max-new-tokens", "2", "-o", out)
    assert invoke(*args).exit_code == 0
    rec_path = out / "prompts" / "line00001.json"
    good = json.loads(rec_path.read_text())
    huge = {k: [10**400] * len(v) for k, v in good["positions"].items()}  # no float64 holds it
    edits = [
        ("kl_mean", "big"),
        ("match", 1),
        ("tokens", None),
        ("positions", {"kl": ["x"]}),
        ("first_divergence", {"step": "0"}),
        ("id", "other"),
        ("kl_max", 10**400),  # an int no float64 holds: it overflowed the statistics' arrays
        ("positions", huge),
        ("tokens", 10**30),
        ("positions", {k: v for k, v in good["positions"].items() if k != "logp_run"}),  # the statistics' IndexError
        ("positions", {**good["positions"], "extra": good["positions"]["kl"]}),
    ]
    for key, value in edits:
        rec_path.write_text(json.dumps({**good, key: value}))
        r = invoke(*args)
        assert r.exit_code == 0 and "1 prompt(s) run, 0 resumed" in r.stdout, (key, r.output)
        assert json.loads(rec_path.read_text()) == good, key
