"""replayer/artifacts.py: the content-keyed, hash-verified cache of built artifacts (exported
graphs, converted GGUF files). No torch: the builds here write small files."""

import os

import pytest

from gemma4_trace.replayer import artifacts as A
from tests.support.cli import invoke

KEY = {"model": "m0", "max_seq": 16}


@pytest.fixture(autouse=True)
def _defaults():
    A.configure()  # what the command line did last in this process must not leak in
    yield
    A.configure()


class Builder:
    """build(folder) writing two files (one in a sub-folder); counts its calls."""

    def __init__(self, fail=False):
        self.calls, self.fail = 0, fail

    def __call__(self, folder):
        self.calls += 1
        (folder / "a.bin").write_bytes(b"graph a " * 100)
        (folder / "sub").mkdir()
        (folder / "sub" / "b.bin").write_bytes(b"weights")
        if self.fail:
            raise RuntimeError("exporter failed")


def _entry(cache, key=KEY):
    return cache / "onnx" / A.key_digest(key)


def _get(cache, build, said=None, key=KEY, **kw):
    return A.artifact_folder(
        "onnx", key, build, cache=cache, what="exporting", say=(said if said is not None else []).append, **kw
    )


def test_built_once_then_cached(tmp_path):
    b, said = Builder(), []
    first = _get(tmp_path, b, said)
    assert first.note.startswith("built in ") and first.path == _entry(tmp_path)
    assert said == ["exporting"]
    mtime = (first.path / "a.bin").stat().st_mtime_ns
    second = _get(tmp_path, b, said)
    assert (second.note, b.calls, said) == ("cached", 1, ["exporting"])  # not built, nothing said
    assert (second.path / "a.bin").stat().st_mtime_ns == mtime
    assert (second.path / "sub" / "b.bin").read_bytes() == b"weights"
    second.close()  # a cached entry stays
    assert second.path.is_dir()
    other = _get(tmp_path, b, key={**KEY, "max_seq": 32})  # another key: another entry
    assert b.calls == 2 and other.path != first.path


def test_processes_missing_one_entry_at_once_build_it_once(tmp_path):
    """Two processes missing the same entry (a parallel test run): one builds it, the other waits for
    that build and uses its entry, saying it was built meanwhile; another key's pair builds its own once."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from gemma4_trace.replayer import artifacts as A
        cache, key, log = Path(sys.argv[1]), {"model": sys.argv[2]}, Path(sys.argv[3])
        arrived = cache / f"arrived-{sys.argv[2]}-{sys.argv[4]}"
        arrived.touch()
        def build(folder):
            with log.open("a") as f:
                f.write("build\\n")
            t0 = time.monotonic()  # both m0 processes are in, the other past its cache lookup
            while len(list(cache.glob(f"arrived-{key['model']}-*"))) < 2 and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            time.sleep(1.0)
            (folder / "a.bin").write_bytes(b"x" * 64)
        print(A.artifact_folder("onnx", key, build, cache=cache, say=None).note)
        """
    )
    log = tmp_path / "builds.log"
    procs = [
        subprocess.Popen([sys.executable, "-c", script, tmp_path, m, log, str(i)], stdout=subprocess.PIPE, text=True)
        for i, m in enumerate(("m0", "m0", "m1", "m1"))
    ]
    notes = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), notes
    assert log.read_text().count("build") == 2, notes  # m0 once, m1 once
    for pair in (notes[:2], notes[2:]):
        assert sorted(n.split(" in ")[0] for n in pair) == ["built", "cached (built meanwhile by another process)"]


@pytest.mark.parametrize("enabled", [True, False])
def test_what_a_build_needs_is_built_first_and_said_first(tmp_path, enabled):
    """A build made from another artifact (a quantized file from the float one) resolves it only when
    it is itself built, before its own line: the lines come in the order the builds run (the float
    one's before the quantized one's, not the other way round), and the other artifact is handed
    over and closed after the build."""
    said, seen = [], []

    def inner(folder):
        (folder / "f32.bin").write_bytes(b"float")

    def get_inner():
        return A.artifact_folder(
            "gguf", {"t": "F32"}, inner, cache=tmp_path, enabled=enabled, what="converting", say=said.append
        )

    def outer(folder, f32):
        seen.append((f32.path, (f32.path / "f32.bin").read_bytes()))
        (folder / "q8.bin").write_bytes(b"quantized")

    def get_outer():
        return A.artifact_folder(
            "gguf", {"t": "Q8_0"}, outer, cache=tmp_path, enabled=enabled, what="quantizing", say=said.append,
            needs=lambda: (get_inner(),),
        )  # fmt: skip

    first = get_outer()
    assert [line.removesuffix(" (cache off)") for line in said] == ["converting", "quantizing"]
    assert [data for _, data in seen] == [b"float"] and (first.path / "q8.bin").read_bytes() == b"quantized"
    if enabled:  # cached: nothing needed, nothing said
        assert get_outer().note == "cached" and len(said) == 2 and len(seen) == 1
    else:  # the float one was built in a temporary folder, closed after the build
        assert not seen[0][0].exists()
    first.close()


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda e: (e / "a.bin").write_bytes(b"graph A " * 100), "a.bin fails its hash check"),  # same size
        (lambda e: (e / "sub" / "b.bin").write_bytes(b"weights!"), "sub/b.bin fails its hash check"),
        (lambda e: (e / "sub" / "b.bin").unlink(), "its files differ from its manifest"),
        (lambda e: (e / "extra.onnx").write_bytes(b"x"), "its files differ from its manifest"),
        (lambda e: (e / "manifest.json").write_text("{"), "unreadable"),
        (lambda e: (e / "manifest.json").unlink(), "unreadable"),
    ],
    ids=["changed-same-size", "changed-in-subfolder", "removed", "added", "bad-manifest", "no-manifest"],
)
def test_a_damaged_entry_is_rebuilt_and_said(tmp_path, damage, why):
    b, said = Builder(), []
    entry = _get(tmp_path, b).path
    damage(entry)
    assert A.verify(entry, KEY).startswith(why)
    again = _get(tmp_path, b, said)
    assert b.calls == 2 and again.note.startswith("rebuilt in ") and why in again.note
    assert len(said) == 1 and said[0].startswith("exporting; the cached copy was stale: ") and why in said[0]
    assert A.verify(again.path, KEY) is None
    assert (again.path / "a.bin").read_bytes() == b"graph a " * 100
    assert not (again.path / "extra.onnx").exists()
    assert sorted(p.name for p in (tmp_path / "onnx").iterdir()) == [entry.name]  # no stale or partial folder


def test_a_link_in_an_entry_is_refused_and_rebuilt(tmp_path):
    b = Builder()
    entry = _get(tmp_path, b).path
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"graph a " * 100)  # the same bytes: a link is refused whatever it points at
    (entry / "a.bin").unlink()
    os.symlink(outside, entry / "a.bin")
    assert "not a plain file" in A.verify(entry, KEY)
    again = _get(tmp_path, b)
    assert b.calls == 2 and again.note.startswith("rebuilt")
    assert not (again.path / "a.bin").is_symlink() and outside.exists()


def test_an_entry_for_another_key_is_not_used(tmp_path):
    b = Builder()
    entry = _get(tmp_path, b).path
    assert A.verify(entry, {**KEY, "max_seq": 17}) == "its manifest does not describe this artifact"


def test_a_failing_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="exporter failed"):
        _get(tmp_path, Builder(fail=True))
    assert list((tmp_path / "onnx").iterdir()) == []  # no entry, no partial folder
    good = _get(tmp_path, Builder())  # and the next build is not blocked
    assert A.verify(good.path, KEY) is None


def test_a_failing_rebuild_keeps_nothing_stale_as_valid(tmp_path):
    entry = _get(tmp_path, Builder()).path
    (entry / "a.bin").write_bytes(b"tampered")
    with pytest.raises(RuntimeError):
        _get(tmp_path, Builder(fail=True))
    assert A.verify(entry, KEY) is not None  # still refused next time: never used as if intact
    assert [p.name for p in (tmp_path / "onnx").iterdir()] == [entry.name]


def test_cache_off_builds_in_a_temporary_folder_and_leaves_no_entry(tmp_path):
    A.configure(tmp_path, enabled=False)
    b, said = Builder(), []
    art = A.artifact_folder("onnx", KEY, b, what="exporting", say=said.append)
    assert art.note.endswith("not cached") and said == ["exporting (cache off)"]
    assert (art.path / "a.bin").exists() and tmp_path not in art.path.parents
    art.close()
    assert not art.path.exists() and not (tmp_path / "onnx").exists()
    with pytest.raises(RuntimeError):  # a failing build leaves no temporary folder either
        A.artifact_folder("onnx", KEY, Builder(fail=True), say=None)


def test_cache_folder_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(A.CACHE_ENV, str(tmp_path / "env"))
    assert A.cache_dir() == tmp_path / "env"
    A.configure(tmp_path / "flag")
    assert A.cache_dir() == tmp_path / "flag"  # --cache-dir wins over the environment
    assert A.cache_dir(tmp_path / "arg") == tmp_path / "arg"  # an argument wins over both
    A.configure()
    monkeypatch.delenv(A.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert A.cache_dir() == tmp_path / "xdg" / "gemma4-trace"


def test_model_hash_follows_the_weights(tmp_path):
    for n, data in (("config.json", b"{}"), ("model.safetensors", b"w1"), ("README.md", b"x")):
        (tmp_path / n).write_bytes(data)
    h = A.model_hash(tmp_path)
    (tmp_path / "README.md").write_bytes(b"y")  # not part of the model
    assert A.model_hash(tmp_path) == h
    (tmp_path / "model.safetensors").write_bytes(b"w2")
    assert A.model_hash(tmp_path) != h


@pytest.mark.parametrize("command", ["replay", "export-onnx"])
def test_command_line_options_reach_the_cache(tmp_path, monkeypatch, command):
    """--cache-dir / --no-cache are set before anything is built (here the command then fails
    on its missing input, before a model loads), and the defaults come back when the command ends
    (a test session or a notebook runs many commands in one process)."""
    seen = []
    monkeypatch.setattr(A, "configure", lambda cache=None, enabled=True: seen.append((cache, enabled)))
    args = (
        ["replay", tmp_path / "missing.h5", "-o", tmp_path / "run.h5"]
        if command == "replay"
        else ["export-onnx", "--model", tmp_path / "no-model", "--max-seq", "16", "-o", tmp_path / "g"]
    )
    invoke(*args, "--cache-dir", tmp_path / "c", "--no-cache")
    assert seen == [(str(tmp_path / "c"), False), (None, True)]  # set, then the defaults back
    invoke(*args)
    assert seen == [(str(tmp_path / "c"), False), (None, True), (None, True), (None, True)]


def test_an_unwritable_cache_folder_is_one_line(tmp_path):
    from gemma4_trace.traces.errors import TraceToolError

    (tmp_path / "file").write_text("x")
    b = Builder()
    with pytest.raises(TraceToolError, match=r"cannot write in the artifact cache .*file/onnx .*--no-cache"):
        _get(tmp_path / "file", b)
    assert b.calls == 0  # refused before anything was built


def test_replay_with_an_unwritable_cache_is_one_line(tmp_path):
    pytest.importorskip("onnxruntime")
    from gemma4_trace.recorder.golden import golden_path
    from tests.support.cli import one_line_error

    (tmp_path / "file").write_text("x")
    res = invoke(
        "replay",
        golden_path("short"),
        "--runtime",
        "onnx",
        "--cache-dir",
        tmp_path / "file" / "cache",
        "-o",
        tmp_path / "r.h5",
    )
    one_line_error(res, "cannot write in the artifact cache", out=tmp_path / "r.h5")
