"""ExecuTorch in the child process (replayer/child.py's protocol): the `forward` method of each .pte
program, for --runtime executorch* (replayer/runtimes/executorch.py)."""

from __future__ import annotations

from ..child import quiet_fd2

ENGINE = f"{__name__}:ExecuTorchEngine"


class ExecuTorchEngine:
    """("load", {name: path}, options) -> ("ready", {name: ([], [])}); ("run", name, [array]) ->
    ("outputs", [array, ...]): the `forward` method of each .pte program."""

    def __init__(self, emit):
        with quiet_fd2():
            import torch
            from executorch.runtime import Runtime

            self.torch, self.et = torch, Runtime.get()
        self.methods = {}

    def handle(self, command: str, *args):
        if command == "load":
            paths, _ = args
            with quiet_fd2():
                for name, path in paths.items():
                    self.methods[name] = self.et.load_program(path).load_method("forward")
            return ("ready", {name: ([], []) for name in paths})
        name, inputs = args
        outs = self.methods[name].execute([self.torch.from_numpy(a) for a in inputs])
        return ("outputs", [t.numpy() for t in outs])  # pickled at once: before the next run reuses the memory
