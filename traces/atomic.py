"""Write-to-temporary-then-rename, so a trace path only ever holds a complete trace."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from .errors import TraceToolError

TMP_PREFIX = ".trace-partial-"


def check_output_path(path: str | os.PathLike, force: bool, inputs=()) -> Path:
    """Refuse, before any work, an output that would destroy something: an existing file (unless
    force), one of the command's inputs (the same file by device and inode, whatever the name,
    symlink or hard link), anything that is not a regular file (a device node, a FIFO), or a
    folder we cannot write."""
    path = Path(path)
    if path.is_dir():
        raise TraceToolError(f"output {path} is a folder; give a file name such as {path / 'trace.h5'}")
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None:
        for src in inputs:
            if src is None:
                continue
            with contextlib.suppress(OSError):
                s = os.stat(src)
                if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                    raise TraceToolError(f"output {path} is the input {src}; write the output to another file")
        if not stat.S_ISREG(st.st_mode):
            raise TraceToolError(f"output {path} exists and is not a regular file; give the path of a new file")
        if not force:
            raise TraceToolError(f"output {path} already exists; pass --force to replace it")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise TraceToolError(f"output folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TraceToolError(f"output folder {folder} is not writable")
    return path


def write_bytes_atomic(path: Path, data: bytes, prefix: str = ".partial-") -> None:
    """path holds `data` whole or keeps what it held: a private file in the same folder, renamed over
    it (with the user's usual file mode); the private file goes on any error or interrupt."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def no_space(e: BaseException) -> bool:
    """Disk full, as the OS or HDF5 (whose messages carry the errno text) reports it."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        w in str(e) for w in ("No space left on device", "Disk quota exceeded", "errno = 28,")
    )


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, force: bool = False):
    """Yield a temporary path in the target folder; rename it onto `path` only on success.

    On any exception (KeyboardInterrupt included) the temporary file is removed and the
    previous content of `path`, if any, is left untouched.
    """
    path = check_output_path(path, force)
    folder = path.parent if str(path.parent) else Path(".")
    clean_stale_partials(folder)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", suffix=".h5", dir=folder)
    except OSError as e:
        if no_space(e):
            raise TraceToolError(f"no space left on device writing {path}; nothing was written") from None
        raise TraceToolError(f"cannot write in output folder {folder} ({e.strerror})") from None
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; give it a normal file's mode
        if force:
            os.replace(tmp, path)  # atomic: readers see the old or the new trace, never a mix
        else:
            try:
                os.link(tmp, path)  # atomic create-if-absent: two racing runs cannot both win
            except FileExistsError:
                raise TraceToolError(f"output {path} already exists; pass --force to replace it") from None
            os.unlink(tmp)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(e, TraceToolError) and isinstance(e, Exception) and no_space(e):
            raise TraceToolError(f"no space left on device writing {path}; nothing was written") from None
        raise


def clean_stale_partials(folder: Path) -> None:
    """Remove partial files left by runs that were killed (their process no longer exists)."""
    for p in folder.glob(f"{TMP_PREFIX}*.h5"):
        pid = p.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                p.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
