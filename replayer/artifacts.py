"""A content-keyed cache of built artifacts (exported ONNX graphs, .pte programs, converted GGUF files).

    art = artifact_folder("onnx", {"model": model_hash(d), "max_seq": 32, ...}, build)
    art.path        # a folder holding what build(folder) wrote; art.note: "cached" / "built in 3.1 s"
    art.close()     # removes the folder only when the cache was off (enabled=False)

An entry is a folder `<cache>/<kind>/<key>` (key: sha256 of the key dict) with a manifest.json that
names each file with its size and sha256. Before an entry is used, every file is hashed again: a file
changed, missing, added or replaced by a link makes the entry stale, and it is built again. An entry
is built in a private sibling folder and renamed into place, so a crash or Ctrl-C never leaves a
half-built entry. The cache folder: `--cache-dir`, else $GEMMA4_TRACE_CACHE, else
$XDG_CACHE_HOME/gemma4-trace (~/.cache/gemma4-trace).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gemma4_trace.traces.atomic import no_space
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import read_text, sha256_file

CACHE_ENV = "GEMMA4_TRACE_CACHE"  # overrides the cache folder (default ~/.cache/gemma4-trace)
MANIFEST = "manifest.json"

# process-wide choices made once by the command line (--cache-dir, --no-cache); arguments win over them
_settings = {"cache": None, "enabled": True}


def configure(cache=None, enabled: bool = True) -> None:
    """Set the cache folder and whether artifacts are cached, for every later call that does not say."""
    _settings.update(cache=cache, enabled=enabled)


def caching() -> bool:
    """False after configure(enabled=False) (--no-cache)."""
    return bool(_settings["enabled"])


def cache_dir(override=None) -> Path:
    """The cache folder as an absolute path (a relative --cache-dir is the current folder's, also for
    a builder whose child process runs in a folder of its own)."""
    override = override if override is not None else _settings["cache"]
    if override is None and os.environ.get(CACHE_ENV):
        override = os.environ[CACHE_ENV]
    if override is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        override = os.path.join(base, "gemma4-trace")
    return Path(os.path.abspath(override))


def code_digest(*names: str) -> str:
    """A short hash of the replayer's own source files `names` (relative to replayer/): a cache key
    part, so a change to the code an artifact is built from builds it again."""
    here = Path(__file__).resolve().parent
    return hashlib.sha256(b"".join((here / n).read_bytes() for n in names)).hexdigest()[:16]


CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".jinja", ".model")  # config, weights, tokenizer, chat template


def checkpoint_files(model_dir) -> list[str]:
    """The names of the checkpoint's files an artifact is built from (sorted): its configs, the
    tokenizer (tokenizer.json, tokenizer.model), the chat template and the safetensors weights;
    never a pickled checkpoint (pytorch_model.bin, *.pt) or code (*.py)."""
    d = Path(model_dir)
    return sorted(p.name for p in d.iterdir() if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES)


def model_hash(model_dir) -> str:
    """sha256 over checkpoint_files (names and bytes)."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for n in checkpoint_files(d):
        h.update(n.encode() + b"\0" + sha256_file(d / n).encode())
    return h.hexdigest()


def staged_checkpoint(model_dir, into: Path) -> Path:
    """The folder `into`, made, with a link to each of checkpoint_files: what an engine that reads
    a model folder itself is given, so it reads no file that model_hash (the artifact's key) does
    not cover, and never a pickle beside the safetensors."""
    d = Path(model_dir).resolve()
    into.mkdir(parents=True)
    for n in checkpoint_files(d):
        (into / n).symlink_to(d / n)
    return into


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _files(folder: Path) -> dict[str, Path]:
    """Every entry under folder by relative name; a link or a special file is refused (ValueError)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            raise ValueError(f"{p.name} is not a plain file")
        if p.is_file():
            out[p.relative_to(folder).as_posix()] = p
    return out


MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a few files: name, size, sha256


def _write_manifest(folder: Path, key: dict) -> None:
    files = {n: {"size": p.stat().st_size, "sha256": sha256_file(p)} for n, p in _files(folder).items()}
    (folder / MANIFEST).write_text(json.dumps({"key": key, "files": files}, indent=1, sort_keys=True, default=str))


def verify(folder: Path, key: dict) -> str | None:
    """None when folder is an intact entry for key, else why not (one phrase)."""
    try:  # bounded, and a FIFO or device in its place is refused unread
        manifest = json.loads(read_text(folder / MANIFEST, "manifest", MAX_MANIFEST_BYTES))
        files = _files(folder)
    except (OSError, ValueError, TraceToolError) as e:
        return f"unreadable ({one_line(e, 200)})"
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict) or json.loads(json.dumps(key, default=str)) != manifest.get("key"):
        return "its manifest does not describe this artifact"
    files.pop(MANIFEST, None)
    if set(files) != set(listed):
        return "its files differ from its manifest"
    for name, p in files.items():
        want = listed[name]
        if not isinstance(want, dict) or p.stat().st_size != want.get("size") or sha256_file(p) != want.get("sha256"):
            return f"{name} fails its hash check"
    return None


@dataclass
class Artifact:
    path: Path
    note: str  # "cached", "built in 3.1 s", "rebuilt in 3.1 s (...)", "built in 3.1 s, not cached"
    temporary: bool = False

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def artifact_folder(
    kind: str,
    key: dict,
    build: Callable[[Path], None],
    *,
    cache=None,
    enabled: bool | None = None,
    what: str | None = None,
    say: Callable[[str], None] | None = _say,
    needs: Callable[[], tuple[Artifact, ...]] | None = None,
) -> Artifact:
    """The cache entry of (kind, key), built by build(folder) when absent or stale. `what` (e.g.
    "exporting ONNX (prefill and decode)") is said on stderr before a build. With enabled=False (default:
    as configure() set it) the artifact is built in a temporary folder that Artifact.close() removes.
    `needs`: the artifacts this one is made from, resolved only when it is built and before its line
    is said (each built first where it is missing, with its own line: the lines come in the order the
    builds run), then handed over, build(folder, *those), and closed after it."""
    t0 = time.perf_counter()
    enabled = _settings["enabled"] if enabled is None else enabled
    if not enabled:
        tmp = Path(tempfile.mkdtemp(prefix=f"gemma4-trace-{kind}-"))
        try:
            _build_with(build, tmp, needs, what and say and (lambda: say(f"{what} (cache off)")))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Artifact(tmp, f"built in {time.perf_counter() - t0:.1f} s, not cached", temporary=True)
    root = cache_dir(cache) / kind
    final = root / key_digest(key)
    stale = _usable(final, key)
    if stale is None:
        return Artifact(final, "cached")
    cache_write(root)
    with _one_builder(root, final.name):
        if _usable(final, key) is None:  # another process built it while this one waited
            return Artifact(final, "cached (built meanwhile by another process)")
        tmp = Path(cache_write(root, lambda: tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".partial")))
        try:
            line = f"{what}{f'; the cached copy was stale: {stale}' if stale != ABSENT else ''}"
            _build_with(build, tmp, needs, what and say and (lambda: say(line)))
            _write_manifest(tmp, key)
            won = _publish(tmp, final, key)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    verb = "rebuilt" if stale != ABSENT else "built"
    note = f"{verb} in {time.perf_counter() - t0:.1f} s" + (f" ({stale})" if stale != ABSENT else "")
    return Artifact(final, note if won else "cached (built meanwhile by another process)")


ABSENT = "absent"


@contextlib.contextmanager
def _one_builder(root: Path, name: str):
    """Hold the entry's build lock (`<root>/.<name>.lock`, flock): of the processes that miss one entry
    (a parallel test run, two sweeps), one builds it and the others wait and use it, instead of each
    building it at once. The lock file goes when its holder is done (a waiter on it then finds the
    entry, or builds it itself). Where the lock cannot be had (no flock, a planted link), each builds
    and the rename settles which entry stays (_publish)."""
    path = root / f".{name}.lock"
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), os.lstat(path)):  # ours, not a later holder's new file
                os.unlink(path)
        os.close(fd)  # closing releases the lock


def _build_with(build, folder: Path, needs, announce) -> None:
    """build(folder), or build(folder, *needs()) with what it needs resolved first; `announce` (or
    None) says the build's line after those and before it runs."""
    deps = tuple(needs()) if needs is not None else ()
    try:
        if announce:
            announce()
        build(folder, *deps)
    finally:
        for d in deps:
            d.close()


def cache_write(root: Path, make=None):
    """Make the cache folder `root` (and call make() there); a folder that cannot be written is one line."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        return make() if make is not None else root
    except OSError as e:
        raise TraceToolError(
            f"cannot write in the artifact cache {root} ({e.strerror or type(e).__name__}); "
            "choose another folder with --cache-dir DIR, or pass --no-cache"
        ) from None


def _usable(final: Path, key: dict) -> str | None:
    """None when `final` is an intact entry for key; else why not (ABSENT when there is none)."""
    if final.is_symlink():
        return "the entry is a link"
    if not final.exists():
        return ABSENT
    return verify(final, key)


def _publish(tmp: Path, final: Path, key: dict) -> bool:
    """Rename the built entry into place; False when another process published an intact one first
    (ours is then dropped: the winner's is the one in use). A stale or linked entry is moved aside
    first, never deleted under a reader that holds an intact one."""
    for _ in range(3):
        try:
            os.rename(tmp, final)  # fails on an existing non-empty folder: never replaces a winner's entry
            return True
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        if _usable(final, key) is None:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        old = final.parent / f".{final.name}.{os.getpid()}.{time.monotonic_ns()}.stale"
        try:
            os.replace(final, old)
        except FileNotFoundError:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    raise TraceToolError(f"cannot place the artifact {final} in the cache (it keeps changing); pass --no-cache")


# ------------------------------------------------------------------ export commands (export-onnx, export-pte)
def model_folder_files(model_dir) -> list[Path]:
    """The regular files of a model folder (the embedded one for None): what a command that loads
    the model reads, so that none of its outputs may replace them."""
    if model_dir is None:
        from gemma4_trace.hf.model import embedded_model_dir

        model_dir = embedded_model_dir()
    try:
        return [p for p in Path(model_dir).iterdir() if p.is_file()]
    except OSError:
        return []


def same_file(a, b) -> bool:
    """Whether two paths name one file (device and inode: whatever the names, links followed)."""
    try:
        x, y = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def check_output_folder(out: Path, names: list[str], force: bool, kind: str, inputs=()) -> None:
    """Before any work: out is (or can be made) a writable folder, and each of `names` in it is
    absent or, with force, a regular file that is none of the command's `inputs` (a model folder's
    files, say). `kind` (".onnx", ".pte") names the files in messages."""
    if out.exists() and not out.is_dir():
        raise TraceToolError(f"output {out} exists and is not a folder; give a folder for the {kind} files")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TraceToolError(f"cannot make output folder {out} ({e.strerror or type(e).__name__})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise TraceToolError(f"output folder {out} is not writable")
    for t in (out / n for n in names):
        if not (t.exists() or t.is_symlink()):
            continue
        src = next((i for i in inputs if same_file(t, i)), None)
        if src is not None:
            raise TraceToolError(f"output {t} is the input {src}; write the output to another folder")
        if t.is_symlink() or not t.is_file():
            raise TraceToolError(f"output {t} exists and is not a regular file; remove it or choose another folder")
        if not force:
            raise TraceToolError(f"output {t} already exists; pass --force to replace it")


def _place_all(files: list[Path], out: Path, backups: Path, kind: str) -> None:
    """Rename every file of `files` into `out`, or none: on a failure the files already placed
    are taken back and what they replaced is restored."""
    done = []  # (target, its previous content moved to backups, or None)
    try:
        for f in files:
            target, old = out / f.name, None
            if target.exists() or target.is_symlink():
                if target.is_dir() and not target.is_symlink():
                    raise IsADirectoryError(errno.EISDIR, "is a folder", str(target))
                old = backups / f.name
                os.replace(target, old)
            done.append((target, old))
            os.replace(f, target)
    except OSError as e:
        for target, old in reversed(done):
            with contextlib.suppress(OSError):
                if old is not None:
                    os.replace(old, target)
                else:
                    target.unlink()
        what = "no space left on device" if no_space(e) else (e.strerror or type(e).__name__)
        raise TraceToolError(
            f"cannot write {one_line(e.filename2 or e.filename or out)} ({what}); no {kind} file was changed"
        ) from None


def copy_all_or_none(sources: list[Path], out: Path, kind: str) -> None:
    """Copy `sources` into out under their names, all of them or none (copied into a private
    folder inside out first, then renamed into place together)."""
    try:
        tag = "".join(c if c.isalnum() else "-" for c in kind.lstrip("."))  # ".xml/.bin" -> "xml--bin"
        with tempfile.TemporaryDirectory(dir=out, prefix=f".{tag}-partial-") as tmp:
            new, backups = Path(tmp) / "new", Path(tmp) / "old"
            new.mkdir()
            backups.mkdir()
            for f in sources:
                shutil.copyfile(f, new / f.name)
            _place_all(sorted(new.iterdir()), out, backups, kind)
    except OSError as e:  # the temporary folder could not be made or filled
        what = "no space left on device" if no_space(e) else (e.strerror or type(e).__name__)
        raise TraceToolError(f"cannot write in output folder {out} ({what}); no {kind} file was changed") from None
