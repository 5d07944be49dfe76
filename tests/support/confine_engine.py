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
        if command == "alloc":
            self.block = bytearray(args[0])  # zero-filled: every page touched; kept
            time.sleep(1)  # the parent's watch looks every 0.2 s
            return ("done", len(self.block))
        while True:  # "spin": CPU until a limit ends it
            pass
