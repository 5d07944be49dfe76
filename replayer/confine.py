"""What confines a native engine's child process (replayer/child.py), both sides.

A GGUF file, an ONNX or .pte program, a .tflite graph is read by C/C++ code that trusts it; the
child that runs it is held to:

- **no core dump** (RLIMIT_CORE 0): a crash is the parent's one line, not a file;
- **an address-space limit** (RLIMIT_AS): GEMMA4_TRACE_CHILD_ADDRESS_SPACE (e.g. 64G), by default
  four times the machine's memory and at least 64 GiB: the engines reserve large ranges they
  never touch (XNNPACK, ONNX Runtime's arenas) and llama.cpp maps its whole file, so the limit
  stops a runaway mapping or allocation, not ordinary use;
- **a memory limit on what it really uses**: the parent watches the child's anonymous and shared
  memory (RssAnon + RssShmem of /proc/PID/status, not the file pages a mapping may evict) and kills
  it past GEMMA4_TRACE_MEMORY_LIMIT, or past the MemAvailable the machine had when it started;
- **a CPU-time limit** (RLIMIT_CPU): GEMMA4_TRACE_CHILD_CPU_SECONDS, 8 hours by default;
- **writes only to its own temporary folder** (TMPDIR and XDG_CACHE_HOME point there; the parent removes it with the
  child) and to /dev/null (not /dev/shm, not /dev/kmsg), and **no TCP** at all, by Landlock (Linux
  5.13 and later, TCP from 6.7; `landlock()` returns the ABI version it applied, 0 where the kernel
  has none, and then nothing but the other parts holds); from 6.12 (ABI 6) **no abstract Unix
  socket and no signal** outside the child;
- **a network namespace of its own** (`own_network`): no datagram or connection leaves it;
- **a mount namespace of its own in which every mount is read-only but its folder**
  (`read_only_outside`, Linux 5.12's mount_setattr): metadata changes outside the folder (chmod,
  chown, times, extended attributes), which Landlock does not cover, fail (EROFS);
- **a process group of its own** (replayer/child.py starts it in a new session): the parent kills
  the group, the memory watch sums it, and the child kills it when the parent is gone or its
  input ends (`end_with_parent`);
- **a seccomp filter** (x86_64, aarch64): `connect` (a Unix socket by its path) and `memfd_create`
  (memory in no RSS field) are refused.

Not confined: what the child reads (it must read the model and its own Python), and every other
system call (docs/robustness.md, "The engines' child process").
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import threading
import time

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.limits import fmt_bytes, memory_limit

AS_ENV = "GEMMA4_TRACE_CHILD_ADDRESS_SPACE"
CPU_ENV = "GEMMA4_TRACE_CHILD_CPU_SECONDS"
WRITABLE_ENV = "GEMMA4_TRACE_CHILD_WRITABLE"  # set by the parent: the child's own folder
SECCOMP_ENV = "GEMMA4_TRACE_CHILD_SECCOMP"  # set by the child: "on" where its filter applied
NETWORK_ENV = "GEMMA4_TRACE_CHILD_NETWORK"  # set by the child: "own" (a network namespace of its own) or "shared"
MOUNTS_ENV = "GEMMA4_TRACE_CHILD_MOUNTS"  # set by the child: "read-only" (all but its folder) or "shared"
DEFAULT_CPU_SECONDS = 8 * 3600
MIN_ADDRESS_SPACE = 64 << 30
POLL_SECONDS = 0.2


def _size(name: str, text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
        if not 0 < value < 1 << 62:
            raise ValueError(text)
        return int(value)
    except ValueError:
        raise TraceToolError(f"{name}={text[:40]!r}: expected a positive number such as 64G") from None


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def child_env(folder: str) -> dict[str, str]:
    """The environment a child starts with (checked here, in the parent: a bad value is one line)."""
    space = os.environ.get(AS_ENV, "").strip()
    cpu = os.environ.get(CPU_ENV, "").strip()
    return {
        AS_ENV: str(_size(AS_ENV, space) if space else max(MIN_ADDRESS_SPACE, 4 * _mem_total())),
        CPU_ENV: str(_size(CPU_ENV, cpu) if cpu else DEFAULT_CPU_SECONDS),
        WRITABLE_ENV: folder,
        "TMPDIR": folder,
        "XDG_CACHE_HOME": folder,  # what an engine keeps between runs (onnxruntime's device id) goes with the child
        "PYTHONDONTWRITEBYTECODE": "1",
    }


# ------------------------------------------------------------------ the child's side
_FS_WRITE = {1: 0b1_1111_1111_0010, 2: 1 << 13, 3: 1 << 14}  # rights by the ABI that added them
_DEV_RIGHTS = (1 << 1) | (1 << 14)  # WRITE_FILE, TRUNCATE: /dev/null opened for writing
_NET_TCP = 0b11  # BIND_TCP, CONNECT_TCP (ABI 4)
_SCOPES = 0b11  # ABSTRACT_UNIX_SOCKET, SIGNAL (ABI 6): no abstract socket, no signal outside the child
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 1 << 18
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446  # one number on every architecture
PR_SET_NO_NEW_PRIVS = 38


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(writable: list[str]) -> int:
    """Allow file writes only beneath `writable` (and to /dev/null), no TCP, no abstract Unix socket
    and no signal to a process outside the child; the ABI version applied, or 0."""
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    abi = syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    fs = sum(bits for version, bits in _FS_WRITE.items() if abi >= version)
    attr = (ctypes.c_uint64 * 3)(fs, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    try:
        rules = [(p, fs) for p in writable] + [(os.devnull, _DEV_RIGHTS & fs)]  # not /dev/shm, not /dev/kmsg
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | (os.O_DIRECTORY if rights == fs else 0))
            except OSError:
                continue
            try:
                rule = _PathBeneath(rights, fd)
                syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return 0
        if syscall(_SYS_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            return 0
        return int(abi)
    finally:
        os.close(ruleset)


def own_network() -> bool:
    """Move this process into a network namespace of its own: no interface but a loopback that is
    down, so no datagram or connection reaches this machine or another, and abstract Unix sockets
    are its own. Root needs no user namespace; anyone else gets one that maps their own ids. False
    where the kernel refuses (then Landlock's TCP rule is what holds)."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0 and libc.unshare(CLONE_NEWNET) == 0:
        return True
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    try:  # the same ids inside: files are read and written as before
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    except OSError:
        return False
    return True


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def read_only_outside(folder: str) -> bool:
    """Move this process into a mount namespace of its own where every mount is read-only except
    `folder` (a bind mount of itself): chmod, chown, times and extended attributes outside it fail
    with EROFS (Landlock confines writes, not metadata). Root needs no user namespace; anyone else
    needs the one own_network made. False where the kernel refuses (before 5.12: no mount_setattr)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    path = folder.encode()

    def setattr_(where: bytes, attr: _MountAttr) -> bool:
        return (
            libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, where, _AT_RECURSIVE, ctypes.byref(attr), ctypes.c_size_t(32))
            == 0
        )

    return (
        libc.unshare(CLONE_NEWNS) == 0
        and libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0  # nothing propagates out
        and libc.mount(path, path, None, _MS_BIND | _MS_REC, None) == 0
        and setattr_(b"/", _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0))
        and setattr_(path, _MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0))
    )


# seccomp: the system calls a child is refused, by architecture (AUDIT_ARCH_*: connect, memfd_create)
_SECCOMP_DENY = {0xC000003E: (42, 319), 0xC00000B7: (203, 279)}  # x86_64, aarch64
_X32 = 0x40000000  # x86_64's x32 system calls: refused whole
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


def seccomp() -> bool:
    """Refuse (EPERM) `connect` (a Unix socket by its path: the network namespace covers the rest) and
    `memfd_create` (memory in no RSS field when it is written and never mapped). True where applied;
    False on another architecture or where the kernel refuses."""
    import platform

    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(platform.machine())
    if arch is None:
        return False
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    deny = _SECCOMP_DENY[arch]
    code = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, _RET_ALLOW), (LD, 0, 0, 0)]  # arch, then nr
    code.append((JGE, len(deny) + 1, 0, _X32) if arch == 0xC000003E else (JEQ, 0, 0, 0))
    for i, nr in enumerate(deny):
        code.append((JEQ, len(deny) - i, 0, nr))
    code += [(RET, 0, 0, _RET_ALLOW), (RET, 0, 0, _RET_EPERM)]
    prog = (_Filter * len(code))(*(_Filter(*c) for c in code))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_Program(len(code), prog)), 0, 0) == 0


def confine_self() -> int:
    """In the child, before any engine is imported: the limits, a network namespace of its own, the
    mounts read-only but its folder's, then Landlock (its ABI, or 0)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash is reported by the parent, not dumped
    os.environ[NETWORK_ENV] = "own" if own_network() else "shared"
    os.environ[SECCOMP_ENV] = "on" if seccomp() else "off"
    if os.environ.get(AS_ENV):
        space = int(os.environ[AS_ENV])
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (space if hard < 0 else min(space, hard), hard))
    if os.environ.get(CPU_ENV):
        cpu = int(os.environ[CPU_ENV])
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard < 0 else min(cpu, hard), hard))
    folder = os.environ.get(WRITABLE_ENV)
    os.environ[MOUNTS_ENV] = "read-only" if folder and read_only_outside(folder) else "shared"
    return landlock([folder]) if folder else 0


def end_group() -> None:
    """Kill this process's group, itself included, where it leads the group (a child started by
    replayer/child.py does; started otherwise, it kills nothing but returns)."""
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)


def end_with_parent() -> None:
    """In the child: when the parent is gone (killed outright, so it could not kill this process
    group), end the group, this process and whatever it started. A thread watches its parent's id."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        end_group()

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


# ------------------------------------------------------------------ the parent's side
def _used(pid: int) -> int | None:
    """A process's anonymous plus shared resident memory in bytes; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem") if k in fields)
    except (OSError, ValueError, KeyError):
        return None


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` (the child, and whatever it started that stayed in it)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
                if int(fields[2]) == pgid:
                    found.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _group_used(pid: int) -> int | None:
    """The memory of the child's process group (the child leads it); None once the child is gone."""
    own = _used(pid)
    if own is None:
        return None
    return own + sum(_used(p) or 0 for p in group_members(pid) if p != pid)


def kill_group(proc) -> None:
    """SIGKILL the child's process group: the child and what it started in it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


class MemoryWatch:
    """Kill `proc` once its memory passes `limit` bytes (memory_limit() when the watch starts); `why()`
    is the words a crash message adds when it did."""

    def __init__(self, proc, limit: int | None = None):
        self.proc, self.limit, self.fired = proc, limit if limit is not None else memory_limit(), False
        if self.limit is not None and os.path.exists(f"/proc/{proc.pid}"):
            threading.Thread(target=self._run, name="child-memory-watch", daemon=True).start()

    def _run(self) -> None:
        while self.proc.poll() is None:
            used = _group_used(self.proc.pid)
            if used is not None and used > self.limit:
                self.fired = True
                kill_group(self.proc)
                return
            time.sleep(POLL_SECONDS)

    def why(self) -> str:
        if not self.fired:
            return ""
        return f" (it used more than the {fmt_bytes(self.limit)} of memory it may; GEMMA4_TRACE_MEMORY_LIMIT sets that)"


def signal_note(rc: int) -> str:
    """What a limit's signal means, for a crash message."""
    if rc == -signal.SIGXCPU:
        return f" (its CPU-time limit; {CPU_ENV} sets it)"
    return ""
