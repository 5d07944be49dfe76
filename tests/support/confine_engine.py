"""A child engine for tests/trust/test_confinement.py: it does what a hostile file could make a
native engine do (write a file, open a connection, allocate, spin) and reports what happened."""

from __future__ import annotations

import os
import resource
import socket
import time


class ProbeEngine:
    def __init__(self, emit):
        pass

    def handle(self, command: str, *args):
        if command == "write":
            try:
                with open(args[0], "w") as fh:
                    fh.write("x")
                return ("done", "written")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "connect":
            try:
                socket.create_connection(("127.0.0.1", args[0]), timeout=5).close()
                return ("done", "connected")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "limits":
            names = ("RLIMIT_CORE", "RLIMIT_AS", "RLIMIT_CPU")
            return ("done", {n: resource.getrlimit(getattr(resource, n))[0] for n in names}, os.environ["TMPDIR"])
        if command == "udp":  # a datagram to a port on this machine
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.sendto(b"hello", ("127.0.0.1", args[0]))
                return ("done", "sent")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "abstract":  # connect to an abstract Unix socket (args[0]: its name), or bind one
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(b"\0" + args[0].encode()) if args[1] == "connect" else s.bind(b"\0" + args[0].encode())
                    if args[1] == "bind":
                        s.listen()
                        self.held = s.dup()
                return ("done", "ok")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "open-write":  # /dev/shm/NAME, /dev/kmsg, ...
            try:
                with open(args[0], "wb") as fh:
                    fh.write(b"x")
                return ("done", "written")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "signal":  # a signal to another process (args[0]: its pid)
            try:
                os.kill(args[0], 0 if len(args) < 2 else args[1])
                return ("done", "sent")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "grandchild":  # a process of its own that holds args[0] bytes and sleeps
            import subprocess
            import sys

            code = f"b = bytearray({int(args[0])}); import time; time.sleep(600)"
            self.grandchild = subprocess.Popen([sys.executable, "-c", code])
            time.sleep(args[1] if len(args) > 1 else 0)
            return ("done", self.grandchild.pid)
        if command == "unix-path":  # connect to a Unix socket by its path
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(args[0])
                return ("done", "connected")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "memfd":  # args[0] bytes written to a memfd, never mapped
            try:
                fd = os.memfd_create("probe")
                os.write(fd, b"x" * args[0])
                self.memfd = fd
                return ("done", "held")
            except OSError as e:
                return ("done", type(e).__name__)
        if command == "seccomp":
            return ("done", os.environ.get("GEMMA4_TRACE_CHILD_SECCOMP"))
        if command == "network":
            return ("done", os.environ.get("GEMMA4_TRACE_CHILD_NETWORK"))
        if command == "mounts":
            return ("done", os.environ.get("GEMMA4_TRACE_CHILD_MOUNTS"))
        if command == "chmod":  # args[0]: a path, args[1]: a mode; then chown to the same owner, utime
            try:
                os.chmod(args[0], args[1])
                st = os.stat(args[0])
                os.chown(args[0], st.st_uid, st.st_gid)
                os.utime(args[0], (0, 0))
                return ("done", "changed")
            except OSError as e:
                return ("done", f"{type(e).__name__} {e.errno}")
        if command == "alloc":
            self.block = bytearray(args[0])  # zero-filled: every page touched; kept
            time.sleep(1)  # the parent's watch looks every 0.2 s
            return ("done", len(self.block))
        while True:  # "spin": CPU until a limit ends it
            pass
