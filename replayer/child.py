"""Native engines in a child process: a crash inside one becomes one line, not a dead replay.

ONNX Runtime (`--runtime onnx`, `mobius`), ExecuTorch (`executorch`, `executorch-int8`) and
llama.cpp are C/C++ code: a fault in them (segfault, abort) ends the process they run in. Each
runs in a child process of its own, driven over a pipe, so the replay can name the failure in one
line (runtime, phase, the last kind the engine reported, signal), exit 2 and leave no trace behind:

    error: onnx (onnxruntime 1.32.0) crashed in decode step 2: killed by SIGSEGV

One protocol for every engine: pickles (protocol 5) over stdin/stdout, each behind a head of
lengths, an array's memory written after its pickle as it lies rather than copied into it (pickle's
out-of-band buffers), the pipes widened from 64 KiB to PIPE_BYTES where the system allows. The parent
sends (command, *arguments, phase); the child answers with any number of ("tensors", [(kind, layer,
array), ...]) messages (an engine that streams what it computes, as llama.cpp's eval callback does)
and then one reply: the command's result, or ("error", line) for a failure the engine reports.
Streamed tensors are sent in batches (FLUSH_BYTES, and all that is left before the reply), not one
message each: every message wakes the parent, which then takes a core from an engine that uses them
all. What a crash came after is not lost with an unsent batch: the child writes the last kind it
streamed to a progress file in its folder (PROGRESS), which the parent reads when the child dies.

Parent side: `Child` (the process and its stream) and `ChildRuntime`, the base of the runtimes
whose engine runs there (one phase counter, output sites turned into probe calls in one place,
`close()`). Child side (`python -m gemma4_trace.replayer.child MODULE:CLASS`): an engine class
`Engine(emit)` with `handle(command, *arguments) -> reply`; `emit(kind, layer, array)` streams a
tensor. Every engine lives beside its adapter (replayer/runtimes/onnx_engine.py: sessions of .onnx
files, also mobius's; executorch_engine.py, openvino_engine.py, llamacpp/engine.py,
litert/engine.py, mlx's in mlx.py itself). An engine runs as it
would in-process (the child inherits the environment and CPU affinity), so results are
bit-identical.

Tests only: GEMMA4_TRACE_TEST_NATIVE_CRASH=PHASE makes the child kill itself with SIGSEGV when it
is asked to work in PHASE ("loading", "prefill", "decode step 2"); =KIND or KIND@LAYER makes it
abort right after streaming that tensor (tests/runtimes/test_native_child.py shows both).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import weakref

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError

from . import confine
from .api import Runtime, progress_words

FLUSH_BYTES = 64 << 20  # streamed tensors the child holds before sending them as one message
FLUSH_ENV = "GEMMA4_TRACE_CHILD_FLUSH_BYTES"  # benchmarks: another FLUSH_BYTES (0: one message a tensor)
PROGRESS = "progress"  # in the child's folder: the last kind it streamed, "KIND LAYER" (or empty)
MAX_REPLY = 1 << 34  # bytes in one message from a child (a step's tensors); more is no message of ours
REPLY_FLOOR = 64 << 20  # a reply may hold this much besides a step's tensors (ChildRuntime.reply_limit)
MAX_BUFFERS = 1 << 16  # out-of-band buffers in one message (one an array); more is no message of ours
HEAD = struct.Struct("<QI")  # a message's head: the pickle's length, its buffers' count (their lengths follow)
PIPE_BYTES = 1 << 20  # the pipes' size asked for (Linux's default pipe-max-size; its default size is 64 KiB)
WIRE_ENV = "GEMMA4_TRACE_CHILD_WIRE"  # benchmarks: "inband" sends arrays inside the pickles over default pipes
CRASH_ENV = "GEMMA4_TRACE_TEST_NATIVE_CRASH"  # tests: PHASE -> SIGSEGV at that phase; KIND[@LAYER] -> abort after it


class EngineError(Exception):
    """An engine's own refusal (a file it cannot load): its message is the whole error line."""

    whole_line = True  # read by attribute: in the child this module is also __main__, a second copy


def send_msg(stream, msg, inband: bool = False) -> None:
    """One message: a head (the pickle's length, how many buffers follow it, each one's length), the
    pickle (protocol 5), then the buffers: a contiguous array's memory written as it lies, not
    copied into the pickle first (`inband`: into the pickle, as the protocol was; benchmarks)."""
    bufs: list = []
    data = pickle.dumps(msg, protocol=5, buffer_callback=None if inband else bufs.append)
    raws = [b.raw() for b in bufs]
    stream.write(HEAD.pack(len(data), len(raws)) + struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws)) + data)
    for r in raws:
        stream.write(r)
    stream.flush()


class Malformed(Exception):
    """Bytes on the stream that are no message of ours."""


# what a child's reply may name: numpy's arrays, dtypes and scalars, nothing else (lists, tuples,
# dicts, strings and numbers need no name). A child runs third-party native code on untrusted files:
# a reply that named any other callable would run it in the parent, outside the confinement.
REPLY_GLOBALS = (
    {(module, name) for module in ("numpy._core.numeric", "numpy.core.numeric") for name in ("_frombuffer",)}
    | {
        (module, name)
        for module in ("numpy._core.multiarray", "numpy.core.multiarray")
        for name in ("scalar", "_reconstruct")
    }
    | {("numpy", "dtype"), ("numpy", "ndarray")}
)


class _ReplyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in REPLY_GLOBALS:
            raise pickle.UnpicklingError(f"a reply names {module}.{name}")
        return super().find_class(module, name)


def recv_msg(stream, limit: int = MAX_REPLY, trusted: bool = False):
    """The next message, or None where the stream ends before one is whole. Malformed: a head
    asking for more than `limit` bytes or MAX_BUFFERS buffers, or a pickle that does not load, or
    (unless `trusted`: the parent's commands, read by the child) one naming anything but numpy's
    array, dtype and scalar constructors (REPLY_GLOBALS)."""
    import io

    import numpy

    head = stream.read(HEAD.size)
    if len(head) < HEAD.size:
        return None
    n, count = HEAD.unpack(head)
    if count > MAX_BUFFERS:
        raise Malformed
    lengths = stream.read(8 * count)
    if len(lengths) < 8 * count:
        return None
    sizes = struct.unpack(f"<{count}Q", lengths)
    if n + sum(sizes) > limit:
        raise Malformed
    data, bufs = stream.read(n), [numpy.empty(size, dtype=numpy.uint8) for size in sizes]  # no zero-filling
    if len(data) < n or not all(_fill(stream, memoryview(b)) for b in bufs):
        return None
    try:
        if trusted:
            return pickle.loads(data, buffers=bufs)
        return _ReplyUnpickler(io.BytesIO(data), buffers=bufs).load()
    except Exception as e:  # noqa: BLE001 - whatever the bytes made pickle raise
        raise Malformed from e


def _fill(stream, view) -> bool:
    """Read into all of `view`; False where the stream ends first."""
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:])
        if not got:
            return False
        done += got
    return True


def widen_pipe(fd: int) -> None:
    """Ask for a PIPE_BYTES pipe: a step's tensors in fewer writes, each waking the reader once.
    Linux only; where the system refuses (a lower pipe-max-size), the pipe keeps its size."""
    with contextlib.suppress(AttributeError, OSError):
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)


_DIRS = re.compile(r"(?<![\w.])/(?:[^\s/:'\"()]+/)+")


def strip_dirs(text: str) -> str:
    """`text` with every absolute path cut to its last part: an engine's message names its own
    source file or a cache path (`/tmp/pip-install-x/.../ggml.c:1234`), not where they lie."""
    return _DIRS.sub("", text)


def signal_words(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _shut(proc: subprocess.Popen, log, folder: str) -> None:
    """End the child and reap it. It is idle whenever the parent closes it (every command is
    answered before the next is sent), so it is killed at once: a Python with torch loaded takes
    most of a second to exit by itself."""
    if proc.poll() is None:
        confine.kill_group(proc)  # the child leads its own process group: what it started goes too
        proc.wait()
    elif confine.group_members(proc.pid):  # the child is gone, what it started is not (the id is still theirs)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for stream in (proc.stdin, proc.stdout, log):
        with contextlib.suppress(OSError):
            stream.close()
    shutil.rmtree(folder, ignore_errors=True)


class Child:
    """A child process running ENGINE ("module:Class"), its messages read as they come.

    `label` names the runtime in errors ("llama.cpp (F32)", "onnx (onnxruntime 1.32.0)"); an engine
    that `streams` its tensors as it computes them has a crash message say the last one it sent
    ("after layer 3 attn_out", "before reporting anything"). The child's stderr goes to a log, whose
    last line a crash message quotes. The child ends with close(), when this object is collected,
    or with the parent (its stdin closes)."""

    def __init__(self, label: str, engine: str, env=None, streams: bool = False, pass_fds=(), limit=None):
        self.label, self.streams = label, streams
        self.limit = limit or (lambda: MAX_REPLY)  # bytes one reply may hold, asked at each reply
        self.last: tuple[str, int | None] | None = None  # the last tensor streamed in this call
        self.folder = tempfile.mkdtemp(prefix="gemma4-trace-child-")  # the one place it may write (confine.py)
        try:
            limits = confine.child_env(self.folder)
            self.log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, engine],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                env={**os.environ, **limits, **(env or {})},
                pass_fds=tuple(pass_fds),
                start_new_session=True,  # a process group of its own, killed whole (confine.kill_group)
            )
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _shut, self.proc, self.log, self.folder)
        self.watch = confine.MemoryWatch(self.proc)
        self.inband = os.environ.get(WIRE_ENV) == "inband"
        if not self.inband:
            for stream in (self.proc.stdin, self.proc.stdout):
                widen_pipe(stream.fileno())

    def call(self, command: str, *args, phase: str, tensor=None):
        """Send (command, *args, phase) and return the reply (a tuple); each streamed tensor on the
        way is handed to tensor(kind, layer, array). A failure is one TraceToolError line."""
        self.last = None
        try:
            send_msg(self.proc.stdin, (command, *args, phase), self.inband)
        except (BrokenPipeError, OSError):
            pass  # it died: the receive says how
        while True:
            msg = self._receive(phase)
            if msg[0] != "tensors":
                return msg
            for kind, layer, array in msg[1]:
                self.last = (kind, layer)
                if tensor is not None:
                    tensor(kind, layer, array)

    def _receive(self, phase: str):
        try:
            msg = recv_msg(self.proc.stdout, self.limit())
        except Malformed:
            confine.kill_group(self.proc)
            raise TraceToolError(f"{self.label} sent a malformed reply in {phase}{self._where()}") from None
        if msg is not None:
            if msg[0] == "error":
                raise TraceToolError(f"{self.label} failed in {phase}: {msg[1]}")
            return msg
        rc = self.proc.wait()
        self.last = self._progress() or self.last
        said = self.watch.why() or confine.signal_note(rc) or self._said()
        raise TraceToolError(f"{self.label} crashed in {phase}{self._where()}: {signal_words(rc)}{said}")

    def _progress(self) -> tuple[str, int | None] | None:
        """The last kind the child streamed in this call, from its progress file (None: nothing)."""
        try:
            with open(os.path.join(self.folder, PROGRESS), "rb") as f:
                words = f.read(200).decode("ascii", errors="replace").split()
        except OSError:
            return None
        if len(words) != 2 or words[0] not in S.KIND_BY_NAME or not (words[1].isdigit() or words[1] == "None"):
            return None  # nothing streamed in this call (or not a line of ours)
        return words[0], None if words[1] == "None" else int(words[1])

    def _where(self) -> str:
        return f" {progress_words(self.last)}" if self.streams else ""

    def _said(self) -> str:
        """The last line the child wrote to stderr (an abort message, say), if any."""
        self.log.seek(0)
        lines = [ln.strip() for ln in self.log.read()[-4096:].decode(errors="replace").splitlines() if ln.strip()]
        return f" ({strip_dirs(lines[-1])[:200]})" if lines else ""

    def close(self) -> None:
        self._finalizer()


class ChildRuntime(Runtime):
    """Base of the runtimes whose engine runs in a child process (the runtime contract, docs/runtime-api.md).

    Subclasses call `start(label, engine)` (or not, for a mode that runs in-process), name each
    step's phase with `phase(prefill)` and report an engine's outputs with `report`. `close()` ends
    the child; a replay calls it, and so does leaving a `with` block."""

    name = "child"
    child: Child | None = None
    _limit: tuple[int, int] | None = None  # (max_seq, the reply limit at it)
    decodes = 0  # decode steps since the prefill: the phase a crash names

    def start(self, label: str, engine: str, env=None, streams: bool = False, pass_fds=()) -> Child:
        self.child = Child(label, engine, env, streams, pass_fds, limit=self.reply_limit)
        return self.child

    def reply_limit(self) -> int:
        """The bytes one reply of the child may hold: what a step of this replay may legitimately
        hand over (traces/limits.py step_bytes: every kind of every layer at max_seq rows, the
        caches, the vision tower's at every patch a prompt of max_seq could hold), plus REPLY_FLOOR,
        at most MAX_REPLY. MAX_REPLY until the runtime knows its model and max_seq."""
        loaded, max_seq = getattr(self, "loaded", None), getattr(self, "max_seq", None)
        if loaded is None or not isinstance(max_seq, int):
            return MAX_REPLY
        if self._limit is None or self._limit[0] != max_seq:
            self._limit = (max_seq, min(MAX_REPLY, REPLY_FLOOR + _step_bytes(loaded, max_seq)))
        return self._limit[1]

    def phase(self, prefill: bool) -> str:
        """The next step's phase: "prefill", then "decode step 1", "decode step 2", ..."""
        self.decodes = 0 if prefill else self.decodes + 1
        return "prefill" if prefill else f"decode step {self.decodes}"

    @staticmethod
    def report(probe, sites, rows: slice | None = None) -> None:
        """Hand ((kind, layer), array) pairs to the probe as torch tensors (their `rows`, if given)."""
        if probe is None:
            return
        import torch

        for (kind, layer), value in sites:
            value = value if rows is None else value[rows]
            probe.tensor(kind, value if isinstance(value, torch.Tensor) else torch.from_numpy(value), layer=layer)

    def close(self) -> None:
        if self.child is not None:
            self.child.close()


def _step_bytes(loaded, max_seq: int) -> int:
    """traces/limits.py step_bytes for a replay of `loaded` at max_seq: the vision tower's rows are
    every patch max_seq soft tokens could come from, each image padded to the processor's budget."""
    from gemma4_trace.hf.model import config_dict
    from gemma4_trace.traces.layers import layer_infos_from_config
    from gemma4_trace.traces.limits import step_bytes

    cfg = config_dict(loaded.config)
    vision = cfg.get("vision_config")
    towers = {}
    if isinstance(vision, dict):
        per_token = int(vision.get("pooling_kernel_size") or 1) ** 2
        towers["vision"] = max_seq * per_token * int(vision.get("default_output_length") or 1)
    return step_bytes(cfg, layer_infos_from_config(loaded.text_config), max_seq, towers)


# ---------------------------------------------------------------- the child
@contextlib.contextmanager
def quiet_fd2():
    """The engines' C++ start-up prints lines on file descriptor 2 (cpuinfo, torchao's optional
    kernels): keep them out of the log, whose last line a crash message quotes."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _crash_here(at: str | None, phase: str | None = None, kind: str | None = None, layer=None) -> None:
    """The test hook (module docstring): SIGSEGV when asked to work in phase `at`; abort after
    streaming kind `at` ("KIND" or "KIND@LAYER")."""
    if at is None:
        return
    if phase is not None and phase == at:
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind is not None and at in (kind, f"{kind}@{layer}"):
        os.abort()


def main() -> int:
    confine.confine_self()  # before any engine's code is loaded (confine.py: what it does and does not)
    confine.end_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends this child
    # the replies get stdout's pipe on a descriptor of their own; fd 1 becomes stderr, so that
    # nothing the engines' C/C++ code prints can land in the reply stream
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    crash_at = os.environ.get(CRASH_ENV)
    inband = os.environ.get(WIRE_ENV) == "inband"

    batch, held = [], [0]  # tensors streamed and not yet sent, and their bytes
    knob = os.environ.get(FLUSH_ENV, "").strip()
    flush_at = int(knob) if knob.isdigit() else FLUSH_BYTES
    mark = os.open(os.path.join(os.environ[confine.WRITABLE_ENV], PROGRESS), os.O_WRONLY | os.O_CREAT, 0o600)

    def progress(text: str) -> None:
        os.pwrite(mark, text.encode().ljust(64), 0)  # no message: the parent reads it if this process dies

    def flush() -> None:
        if batch:
            send_msg(out, ("tensors", batch[:]), inband)
            batch.clear()
            held[0] = 0

    def emit(kind: str, layer, array) -> None:
        batch.append((kind, layer, array))
        held[0] += array.nbytes
        progress(f"{kind} {layer}")
        if held[0] >= flush_at:
            flush()
        _crash_here(crash_at, kind=kind, layer=layer)

    module, _, cls = sys.argv[1].partition(":")
    engine = getattr(importlib.import_module(module), cls)(emit)  # imported before the first command
    while True:
        msg = recv_msg(inp, trusted=True)  # the parent's command
        if msg is None:  # the parent closed its end, or is gone: nothing this process started stays
            confine.end_group()
            return 0
        command, *args, phase = msg
        progress("")
        _crash_here(crash_at, phase=phase)
        try:
            reply = engine.handle(command, *args)
        except Exception as e:  # noqa: BLE001 - the engine's own error, one line for the parent
            text = strip_dirs(" ".join(str(e).split()))[:300]
            if not getattr(e, "whole_line", False):
                text = f"{type(e).__name__}: {text}" if text else type(e).__name__
            reply = ("error", text)
        flush()
        send_msg(out, reply, inband)


if __name__ == "__main__":
    sys.exit(main())
