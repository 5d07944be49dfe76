"""Native engines in a child process: a crash inside one becomes one line, not a dead replay.

ONNX Runtime (`--runtime onnx`, `mobius`), ExecuTorch (`executorch`, `executorch-int8`) and
llama.cpp (`llama.cpp`, replayer/_llamacpp_child.py) are C/C++ code: a fault in them (segfault,
abort) ends the process they run in. Each runs in a child process of its own, driven over a
pipe, so the replay can name the failure in one line (runtime, phase, signal), exit 2 and leave
no trace behind:

    error: onnx (onnxruntime 1.32.0) crashed in decode step 2: killed by SIGSEGV

Parent side: `Child` (a child process and its length-prefixed pickle stream; the llama.cpp
runtime's child is one) and `Engine` (a Child that runs ONNX Runtime sessions or ExecuTorch
programs). Child side (`python -m gemma4_trace.replayer.native_child ENGINE`): loads each named
artifact with ENGINE, then runs it on the inputs it is sent, replying with numpy arrays:

    ("load", {name: path}, options, phase)  -> ("ready", {name: (inputs, outputs)})
    ("run", name, inputs, phase)            -> ("outputs", [array, ...])

`onnxruntime`: an InferenceSession per .onnx file (CPU, the SessionOptions attributes in
`options`; inputs a {name: array} feed, outputs in the session's order; the "ready" reply names
each session's inputs with their shapes, and its outputs). `executorch`: the `forward` method of
each .pte program (inputs a list of arrays, outputs in the program's order). The engine runs as
it would in-process: the same inputs, the same options and thread settings (the child inherits
the environment), so results are bit-identical. A failure the engine reports (an exception) is
("error", line). Arrays travel pickled with protocol 5.

Tests only: GEMMA4_TRACE_TEST_NATIVE_CRASH=PHASE makes the child kill itself with SIGSEGV when
it is asked to work in PHASE ("loading", "prefill", "decode step 2"): how tests/test_native_child.py
shows what a crash looks like.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import weakref

from gemma4_trace.traces.errors import TraceToolError

MAX_REPLY = 1 << 34  # bytes in one reply from a child (a step's tensors); more is no reply of ours
CRASH_ENV = "GEMMA4_TRACE_TEST_NATIVE_CRASH"  # tests: PHASE -> SIGSEGV in the child at that phase
ENGINES = ("onnxruntime", "executorch")
# the SessionOptions of --runtime onnx and mobius, as their sessions were made in-process; threads are
# onnxruntime's default (intra-op: one per physical core): the same in the child, which inherits the
# parent's environment and CPU affinity
ORT_SESSION = {"log_severity_level": 3}


def send_msg(stream, msg) -> None:
    data = pickle.dumps(msg, protocol=5)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def recv_msg(stream):
    """The next message, or None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def signal_words(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _shut(proc: subprocess.Popen, log, graceful: bool) -> None:
    """End the child and reap it: graceful, its stdin closed (it exits; one that does not is
    killed); else killed at once (an idle engine has nothing to finish, and a Python with torch
    loaded takes most of a second to exit)."""
    if proc.poll() is None:
        try:
            if not graceful:
                raise OSError
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            proc.stdin.close()
    proc.stdout.close()
    log.close()


class Child:
    """A child process running `module` (python -m), its replies read as they come.

    `label` names the runtime in errors ("llama.cpp (F32)", "onnx (onnxruntime 1.32.0)"). The
    child's stderr goes to a log, whose last line a crash message quotes. The child ends with
    close(), or when this object is collected, or with the parent (its stdin closes); `graceful`
    says whether close() lets it exit by itself or kills it."""

    def __init__(self, label: str, module: str, args=(), env=None, graceful: bool = True):
        self.label = label
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env={**os.environ, **(env or {})},
        )
        self._finalizer = weakref.finalize(self, _shut, self.proc, self.log, graceful)

    def send(self, *msg) -> None:
        try:
            send_msg(self.proc.stdin, msg)
        except (BrokenPipeError, OSError):
            pass  # it died: the next receive says how

    def receive(self, phase: str):
        head = self.proc.stdout.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n > MAX_REPLY:
                self.proc.kill()
                raise TraceToolError(f"{self.label} sent a malformed reply in {phase}{self._where()}")
            body = self.proc.stdout.read(n)
            if len(body) == n:
                msg = pickle.loads(body)
                if msg[0] == "error":
                    raise TraceToolError(f"{self.label} failed in {phase}: {msg[1]}")
                self.seen(msg)
                return msg
        rc = self.proc.wait()
        raise TraceToolError(f"{self.label} crashed in {phase}{self._where()}: {signal_words(rc)}{self._said()}")

    def seen(self, msg) -> None:
        """Called with each reply (a subclass keeps what it needs for progress())."""

    def progress(self) -> str:
        """Where in a phase the child was, for a crash message ("after layer 3 attn_out"); "" if untold."""
        return ""

    def _where(self) -> str:
        p = self.progress()
        return f" {p}" if p else ""

    def _said(self) -> str:
        """The last line the child wrote to stderr (an abort message, say), if any."""
        self.log.seek(0)
        lines = [ln.strip() for ln in self.log.read()[-4096:].decode(errors="replace").splitlines() if ln.strip()]
        return f" ({lines[-1][:200]})" if lines else ""

    def close(self) -> None:
        self._finalizer()


class Engine(Child):
    """ONNX Runtime sessions or ExecuTorch programs run in a child process (module docstring)."""

    def __init__(self, label: str, engine: str):
        assert engine in ENGINES, engine
        super().__init__(label, __name__, (engine,), graceful=False)

    def load(self, paths: dict, options: dict | None = None) -> dict:
        """{name: artifact path} -> {name: (inputs [(name, shape)], outputs [name])} (onnxruntime;
        ExecuTorch's are empty). Reads the files now: they may be removed after."""
        self.send("load", {n: str(p) for n, p in paths.items()}, dict(options or {}), "loading")
        return self.receive("loading")[1]

    def run(self, name: str, inputs, phase: str) -> list:
        """Run artifact `name` on inputs ({name: array} for onnxruntime, [array] for ExecuTorch)."""
        self.send("run", name, inputs, phase)
        return self.receive(phase)[1]


# ---------------------------------------------------------------- the child
@contextlib.contextmanager
def _quiet_fd2():
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


class _Ort:
    def __init__(self):
        import onnxruntime

        self.ort, self.sessions = onnxruntime, {}

    def load(self, paths: dict, options: dict) -> dict:
        opts = self.ort.SessionOptions()
        for k, v in options.items():
            setattr(opts, k, v)
        meta = {}
        for name, path in paths.items():
            s = self.sessions[name] = self.ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            meta[name] = ([(i.name, list(i.shape)) for i in s.get_inputs()], [o.name for o in s.get_outputs()])
        return meta

    def run(self, name: str, inputs: dict) -> list:
        return self.sessions[name].run(None, inputs)


class _ExecuTorch:
    def __init__(self):
        with _quiet_fd2():
            import torch
            from executorch.runtime import Runtime

            self.torch, self.et = torch, Runtime.get()
        self.methods = {}

    def load(self, paths: dict, options: dict) -> dict:
        with _quiet_fd2():
            for name, path in paths.items():
                self.methods[name] = self.et.load_program(path).load_method("forward")
        return {name: ([], []) for name in paths}

    def run(self, name: str, inputs: list) -> list:
        outs = self.methods[name].execute([self.torch.from_numpy(a) for a in inputs])
        return [t.numpy() for t in outs]  # pickled at once: before the next run reuses the program's memory


def main() -> int:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash is reported by the parent, not dumped
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends this child
    # the replies get stdout's pipe on a descriptor of their own; fd 1 becomes stderr, so that
    # nothing the engines' C++ code prints can land in the reply stream
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    engine = {"onnxruntime": _Ort, "executorch": _ExecuTorch}[sys.argv[1]]()  # imported before the first command
    crash_at = os.environ.get(CRASH_ENV)
    while True:
        msg = recv_msg(inp)
        if msg is None:
            return 0
        cmd, *args, phase = msg
        if phase == crash_at:
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            if cmd == "load":
                reply = ("ready", engine.load(*args))
            else:
                reply = ("outputs", engine.run(*args))
        except Exception as e:  # noqa: BLE001 - the engine's own error, one line for the parent
            text = " ".join(str(e).split())[:300]
            reply = ("error", f"{type(e).__name__}: {text}" if text else type(e).__name__)
        send_msg(out, reply)


if __name__ == "__main__":
    sys.exit(main())
