"""A child engine for tests/runtimes/test_child_stream.py: it streams tensors as an engine's
capture does, then answers, or dies part way."""

from __future__ import annotations

import os

import numpy as np


class StreamEngine:
    def __init__(self, emit):
        self.emit = emit

    def handle(self, command: str, *args):
        """("echo", obj) -> ("echo", obj): whatever came, sent back.
        ("stream", layers, row_floats, die_after) -> ("done", layers): layer i's layer_out is one
        row of `row_floats` float32 values, all i; with die_after set, abort right after that layer's."""
        if command == "echo":
            return ("echo", args[0])
        layers, row, die_after = args
        for i in range(layers):
            self.emit("layer_out", i, np.full((1, row), i, dtype=np.float32))
            if i == die_after:
                os.abort()
        return ("done", layers)
