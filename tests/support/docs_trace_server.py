"""A warm `trace` for tests/test_docs.py: the docs' shell lines run as written, each `trace`
command in a process forked from one that has torch, transformers and the CLI imported.

`python -m tests.support.docs_trace_server SOCKET BINDIR` imports the CLI, writes BINDIR/trace (a
stdlib-only client, first on the docs' PATH) and serves: the client sends its argv, working
folder and environment with its stdin/stdout/stderr file descriptors; the server forks, the
child takes those descriptors, folder and environment and runs the console script's `main()`
(gemma4_trace.entry), and the client exits with the child's exit status. Each command is its own
process (fresh state, real exit codes and redirections); only the imports are shared, which
saves about 3 s of CPU per command: the CLI's and those transformers makes lazily at a model's
first load (WARM). Nothing has run a tensor op in the server before it forks, so no OpenMP pool
is inherited.
"""

import importlib
import json
import os
import signal
import socket
import struct
import sys

CLIENT = """#!{python} -S
import array, json, os, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({sock!r})
msg = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [struct.pack("!I", len(msg)) + msg], [0, 1, 2])
buf = b""
while len(buf) < 4:
    more = s.recv(4 - len(buf))
    if not more:
        sys.exit(70)
    buf += more
sys.exit(struct.unpack("!i", buf)[0])
"""

# what load_model's first call imports (transformers imports its model classes lazily): 3.5 s of
# the embedded model's first load, 0.15 s after these
WARM = (
    "gemma4_trace.cli",
    "gemma4_trace.hf.model",
    "gemma4_trace.recorder",
    "gemma4_trace.replayer.runtime",
    "transformers.generation.utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.gemma.tokenization_gemma",
    "transformers.models.gemma4.modeling_gemma4",
    "transformers.models.gemma4.processing_gemma4",
    "transformers.models.gemma4.image_processing_pil_gemma4",
    "transformers.models.gemma4.feature_extraction_gemma4",
)


def _recv_request(conn):
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    (n,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise EOFError
        data += more
    return json.loads(data), fds


def _child(req, fds):
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.argv = ["trace", *req["argv"]]
    from gemma4_trace.entry import main

    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # what the console script would print
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(sock_path: str, bindir: str) -> None:
    for name in WARM:
        importlib.import_module(name)

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(4)
    client = os.path.join(bindir, "trace")
    with open(client, "w") as f:
        f.write(CLIENT.format(python=sys.executable, sock=sock_path))
    os.chmod(client, 0o755)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                req, fds = _recv_request(conn)
            except (EOFError, ValueError, OSError):
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                conn.close()
                _child(req, fds)
            for fd in fds:
                os.close(fd)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
            try:
                conn.sendall(struct.pack("!i", code))
            except OSError:
                pass


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
