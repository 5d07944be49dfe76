"""OpenVINO in the child process (replayer/child.py's protocol): IR files compiled for the CPU
plugin, for --runtime openvino* (replayer/runtimes/openvino.py)."""

from __future__ import annotations

import sys

from ..child import EngineError, quiet_fd2

ENGINE = f"{__name__}:OpenVINOEngine"


class OpenVINOEngine:
    """OrtEngine's protocol over OpenVINO IR files (.xml beside its .bin) compiled for the CPU plugin
    with `options` as its configuration (replayer/runtimes/openvino.py: float32 inference precision)."""

    def __init__(self, emit):
        import numpy

        sys.modules.setdefault("openvino_telemetry", None)  # no usage telemetry (replayer/runtimes/openvino.py)
        with quiet_fd2():
            import openvino

        self.np, self.core, self.compiled = numpy, openvino.Core(), {}

    def handle(self, command: str, *args):
        if command == "load":
            paths, options = args
            meta = {}
            for name, path in paths.items():
                try:
                    model = self.core.read_model(path)
                    self.compiled[name] = self.core.compile_model(model, "CPU", options)
                except Exception as e:  # noqa: BLE001 - the plugin's refusal of a file, one line
                    why = " ".join(str(e).split())[:160]
                    raise EngineError(f"{path}: OpenVINO cannot compile it ({why})") from None
                # the names as the file gives them (compiling adds internal names to some outputs)
                ins = [(i.get_any_name(), str(i.get_partial_shape())) for i in model.inputs]
                meta[name] = (ins, [o.get_any_name() for o in model.outputs])
            return ("ready", meta)
        name, inputs = args
        res = self.compiled[name](inputs)
        return ("outputs", list(res.to_tuple()))  # the request's memory, sent before the next run reuses it
