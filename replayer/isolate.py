"""Layer-isolated replay (`trace replay REF --isolate`): every layer is fed REF's input.

`probe.tensor(kind, value, layer)` returns the tensor the runtime continues with. The
isolating probe records `value` (what the runtime computed) like any probe, and returns
REF's rows for the tensors that are a layer's input: the embeddings (layer 0), the
per-layer inputs (every layer's PLE), and each layer's output (the next layer's input, the
final norm's after the last). So each recorded layer output carries only that layer's own
error, not the drift accumulated above it, and `trace diff` ranks layers by it.

A runtime opts in with `supports_isolation = True` (it must continue with what the probe
returns); `--isolate` on one that does not is refused (replayer/core.py). Tokens are REF's
(teacher-forced).
"""

from __future__ import annotations

import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError

from .api import WriterProbe


class IsolatingProbe(WriterProbe):
    """Records the runtime's tensors; hands back REF's rows for layer inputs."""

    def __init__(self, writer, runtime_name: str, reference):
        super().__init__(writer, runtime_name)
        self.ref = reference  # an open TraceReader
        self.step = -1
        self.rows = slice(0, 0)

    def next_step(self) -> None:
        super().next_step()
        self.step += 1  # teacher-forced: the replay feeds REF's positions, step by step
        self.rows = slice(*self.ref.step_positions[self.step])

    def tensor(self, kind: str, value, layer: int | None = None, positions=None, tower: str = S.TEXT):
        super().tensor(kind, value, layer, positions, tower)
        if tower != S.TEXT or kind not in S.LAYER_INPUT_KINDS:  # the text decoder's layers are isolated
            return value
        if not self.ref.has(kind, layer):
            what = kind + (f" of layer {layer}" if layer is not None else "")
            raise TraceToolError(f"--isolate: the reference stores no {what}, so the layer after it cannot be isolated")
        ref = torch.from_numpy(self.ref.read(kind, layer, self.rows))
        if positions is not None:  # the runtime reported (and continues with) only these rows
            ref = ref[torch.as_tensor(positions).reshape(-1).cpu() - self.rows.start]
        if tuple(ref.shape) != tuple(value.shape):
            raise TraceToolError(
                f"--isolate: REF's {kind} rows {tuple(ref.shape)} do not fit the runtime's {tuple(value.shape)}"
            )
        return ref.to(dtype=value.dtype, device=value.device)
