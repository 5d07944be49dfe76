"""onnxruntime in the child process (replayer/child.py's protocol): sessions of .onnx files on the
CPU, for --runtime onnx (replayer/runtimes/onnx.py) and mobius (mobius.py)."""

from __future__ import annotations

ENGINE = f"{__name__}:OrtEngine"
# the SessionOptions of --runtime onnx and mobius; threads are onnxruntime's default (intra-op: one per
# physical core), the same in the child, which inherits the parent's environment and CPU affinity
SESSION = {"log_severity_level": 3}


class OrtEngine:
    """("load", {name: path}, options) -> ("ready", {name: (inputs [(name, shape)], outputs [name])});
    ("run", name, {input: array}) -> ("outputs", [array, ...]) in the session's output order."""

    def __init__(self, emit):
        import onnxruntime

        self.ort, self.sessions = onnxruntime, {}

    def handle(self, command: str, *args):
        if command == "load":
            paths, options = args
            opts = self.ort.SessionOptions()
            for k, v in options.items():
                setattr(opts, k, v)
            meta = {}
            for name, path in paths.items():
                s = self.sessions[name] = self.ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
                meta[name] = ([(i.name, list(i.shape)) for i in s.get_inputs()], [o.name for o in s.get_outputs()])
            return ("ready", meta)
        name, inputs = args
        return ("outputs", self.sessions[name].run(None, inputs))
