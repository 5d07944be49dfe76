"""The native engines' child process is confined (replayer/confine.py): no core, an address-space,
a memory and a CPU-time limit, writes only to its own folder and no TCP (Landlock, where the
kernel has it). The probe engine (tests/support/confine_engine.py) does what a hostile file could
make an engine do."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gemma4_trace.replayer import confine
from gemma4_trace.replayer.child import Child, strip_dirs
from gemma4_trace.traces.errors import TraceToolError

ENGINE = "tests.support.confine_engine:ProbeEngine"
# a write refused: by Landlock (EACCES), or first by the read-only mounts around its folder (EROFS)
REFUSED = ("PermissionError", "OSError")


def _landlock_abi() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


needs_landlock = pytest.mark.skipif(_landlock_abi() < 1, reason="this kernel has no Landlock: writes are not confined")


@pytest.fixture
def child():
    c = Child("probe", ENGINE)
    yield c
    c.close()


def test_limits_and_temporary_folder(child):
    _, limits, tmp = child.call("limits", phase="probing")
    assert limits["RLIMIT_CORE"] == 0
    assert limits["RLIMIT_CPU"] == confine.DEFAULT_CPU_SECONDS
    assert limits["RLIMIT_AS"] >= confine.MIN_ADDRESS_SPACE
    assert tmp == child.folder and Path(tmp).is_dir()
    child.close()
    assert not Path(tmp).exists()  # the folder goes with the child


@needs_landlock
def test_writes_only_to_its_own_folder(child, tmp_path):
    assert child.call("write", os.path.join(child.folder, "scratch"), phase="writing")[1] == "written"
    assert child.call("write", str(tmp_path / "outside"), phase="writing")[1] in REFUSED
    assert child.call("write", os.devnull, phase="writing")[1] == "written"
    assert not (tmp_path / "outside").exists()


@needs_landlock
def test_no_tcp(child):
    if _landlock_abi() < 4:
        pytest.skip("this kernel's Landlock has no network rules (ABI 4)")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert child.call("connect", server.getsockname()[1], phase="connecting")[1] == "PermissionError"


def test_memory_past_the_limit_is_one_line(monkeypatch):
    monkeypatch.setenv("GEMMA4_TRACE_MEMORY_LIMIT", "300M")
    c = Child("probe", ENGINE)
    try:
        assert c.call("alloc", 50 << 20, phase="allocating")[1] == 50 << 20
        with pytest.raises(TraceToolError) as e:
            c.call("alloc", 2 << 30, phase="allocating")
    finally:
        c.close()
    assert str(e.value) == (
        "probe crashed in allocating: killed by SIGKILL (it used more than the 300.0 MiB of memory it may; "
        "GEMMA4_TRACE_MEMORY_LIMIT sets that)"
    )


def test_address_space_limit(monkeypatch):
    monkeypatch.setenv(confine.AS_ENV, "1G")
    c = Child("probe", ENGINE)
    try:
        with pytest.raises(TraceToolError) as e:
            c.call("alloc", 2 << 30, phase="allocating")
    finally:
        c.close()
    assert str(e.value) == "probe failed in allocating: MemoryError"


def test_cpu_time_limit(monkeypatch):
    monkeypatch.setenv(confine.CPU_ENV, "1")
    c = Child("probe", ENGINE)
    try:
        with pytest.raises(TraceToolError) as e:
            c.call("spin", phase="spinning")
    finally:
        c.close()
    assert str(e.value) == (
        "probe crashed in spinning: killed by SIGXCPU (its CPU-time limit; GEMMA4_TRACE_CHILD_CPU_SECONDS sets it)"
    )


@pytest.mark.parametrize("value", ["lots", "0", "-5G", "1e400"])
def test_a_bad_limit_is_one_line(monkeypatch, value):
    monkeypatch.setenv(confine.AS_ENV, value)
    with pytest.raises(TraceToolError) as e:
        Child("probe", ENGINE)
    assert str(e.value) == f"{confine.AS_ENV}={value!r}: expected a positive number such as 64G"


def test_engine_messages_name_no_folders():
    line = "/tmp/pip-install-q/llama-cpp-python_9/vendor/llama.cpp/ggml/src/ggml.c:1520: GGML_ASSERT(a/b) failed"
    assert strip_dirs(line) == "ggml.c:1520: GGML_ASSERT(a/b) failed"


# ---------------------------------------------------------------- round five: what else a hostile engine tried
def test_the_child_has_a_network_of_its_own(child):
    """A network namespace of its own (root needs no user namespace; others get one mapping their
    ids): a UDP datagram to a port on this machine is not delivered, and an abstract Unix socket
    bound here cannot be reached from the child, nor the child's from here."""
    assert child.call("network", phase="probing")[1] == "own"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        server.settimeout(0.5)
        child.call("udp", server.getsockname()[1], phase="sending")  # fails, or goes nowhere
        with pytest.raises(socket.timeout):
            server.recvfrom(16)
    name = f"gemma4-trace-probe-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as ours:
        ours.bind(b"\0" + name.encode())
        ours.listen()
        assert child.call("abstract", name, "connect", phase="connecting")[1] != "ok"
    assert child.call("abstract", name + "-child", "bind", phase="binding")[1] == "ok"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe, pytest.raises(OSError):
        probe.connect(b"\0" + (name + "-child").encode())


@needs_landlock
def test_no_write_to_dev_shm_or_kmsg(child):
    """/dev/null is the one device it may write: /dev/shm (files that outlive it, memory nobody counts)
    and /dev/kmsg (the kernel log) are refused."""
    name = f"/dev/shm/gemma4-trace-probe-{os.getpid()}"
    assert child.call("open-write", name, phase="writing")[1] in REFUSED
    assert not os.path.exists(name)
    if os.path.exists("/dev/kmsg"):
        assert child.call("open-write", "/dev/kmsg", phase="writing")[1] in REFUSED
    assert child.call("open-write", os.devnull, phase="writing")[1] == "written"


def test_no_metadata_change_outside_its_folder(child, tmp_path):
    """Every mount is read-only in the child's mount namespace but its folder's: chmod, chown and
    times of a file outside fail (EROFS), which Landlock (writes only) does not cover; inside its
    folder they work (a linker chmods what it writes)."""
    import errno
    import stat

    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if release < (5, 12):
        pytest.skip("this kernel has no mount_setattr (Linux 5.12): metadata outside the folder is not confined")
    assert child.call("mounts", phase="probing")[1] == "read-only"
    outside = tmp_path / "outside"
    outside.write_text("x")
    outside.chmod(0o644)
    before = outside.stat()
    assert child.call("chmod", str(outside), 0o4777, phase="probing")[1] == f"OSError {errno.EROFS}"
    after = outside.stat()
    assert stat.S_IMODE(after.st_mode) == 0o644 and after.st_mtime == before.st_mtime
    inside = os.path.join(child.folder, "tool-output")
    assert child.call("write", inside, phase="writing")[1] == "written"
    assert child.call("chmod", inside, 0o755, phase="probing")[1] == "changed"
    assert stat.S_IMODE(os.stat(inside).st_mode) == 0o755


def test_no_signal_to_a_process_outside(child):
    """Landlock's signal scope (ABI 6): the child cannot signal this process (nor any other outside it)."""
    if _landlock_abi() < 6:
        pytest.skip("this kernel's Landlock has no scopes (ABI 6)")
    assert child.call("signal", os.getpid(), phase="signalling")[1] == "PermissionError"


def test_a_grandchild_goes_with_the_child():
    """The child leads a process group of its own, killed whole when it is closed: a process the
    engine started does not outlive it."""
    c = Child("probe", ENGINE)
    try:
        pid = c.call("grandchild", 1 << 20, phase="starting")[1]
        assert os.path.exists(f"/proc/{pid}") and pid in confine.group_members(c.proc.pid)
    finally:
        c.close()
    assert not _alive(pid)


def test_a_grandchild_s_memory_counts(monkeypatch):
    """The memory watch sums the child's process group: a grandchild holding 600 MB past a 300 MB limit
    ends both, in one line."""
    monkeypatch.setenv("GEMMA4_TRACE_MEMORY_LIMIT", "300M")
    c = Child("probe", ENGINE)
    try:
        with pytest.raises(TraceToolError) as e:
            c.call("grandchild", 600 << 20, 5, phase="allocating")
        pid = max(p for p in confine.group_members(c.proc.pid)) if confine.group_members(c.proc.pid) else None
    finally:
        c.close()
    assert str(e.value) == (
        "probe crashed in allocating: killed by SIGKILL (it used more than the 300.0 MiB of memory it may; "
        "GEMMA4_TRACE_MEMORY_LIMIT sets that)"
    )
    assert pid is None or not _alive(pid)


def _alive(pid: int, grace: float = 5.0) -> bool:
    """pid still runs `grace` seconds on (a SIGKILL takes a moment to land; a zombie not yet reaped by
    its new parent counts as gone)."""
    import time

    deadline = time.monotonic() + grace
    while True:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                running = fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        except OSError:
            running = False
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def test_no_unix_socket_by_path_and_no_memfd(child, tmp_path):
    """The seccomp filter (x86_64, aarch64): `connect` is refused (a Unix socket by its path, which
    Landlock and the network namespace leave open), and `memfd_create` (memory no RSS field shows
    when it is written and never mapped)."""
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("the seccomp filter is built for x86_64 and aarch64")
    assert child.call("seccomp", phase="probing")[1] == "on"
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen()
        assert child.call("unix-path", str(path), phase="connecting")[1] == "PermissionError"
    assert child.call("memfd", 1 << 20, phase="allocating")[1] == "PermissionError"


def test_a_grandchild_goes_when_the_parent_is_killed_outright(tmp_path):
    """A parent killed by SIGKILL cannot kill the child's group: the child sees its parent gone (or its
    input end) and ends the group, a process the engine started included."""
    import subprocess
    import sys

    parent = f"""
import os, sys
from gemma4_trace.replayer.child import Child
c = Child("probe", {ENGINE!r})
print(c.call("grandchild", 1 << 20, phase="starting")[1], flush=True)
os.kill(os.getpid(), 9)
"""
    r = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr[-1000:]
    assert not _alive(int(r.stdout.split()[0]))
