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
    assert child.call("write", str(tmp_path / "outside"), phase="writing")[1] == "PermissionError"
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
