"""Runtime plug-ins written against the public API only (docs/runtime-api.md).

    trace replay REF.h5 --runtime tests.plugin_runtime:make_exported -o RUN.h5

`make_exported` runs the torch.export'ed prefill and decode graphs of the static runtime:
the graphs have no probe, so it reports the tensors it can see from outside the graph
(the input embeddings and the RoPE rows) and the driver writes logits and tokens.
`make_no_softcap` is a deliberately wrong runtime (final soft-cap dropped, bug class 6)
for diff tests. `make_incomplete` does not follow the API (no decode).
"""

from __future__ import annotations

import torch

from gemma4_trace.replayer.export import export_decode, export_prefill
from gemma4_trace.replayer.runtime import StaticGemma4Runtime
from gemma4_trace.traces.schema import rope_kinds


class ExportedRuntime:
    name = "exported-static"

    def __init__(self, loaded, max_seq: int):
        self.rt = StaticGemma4Runtime(loaded, max_seq)
        self.max_seq = max_seq
        self.decode_step = export_decode(self.rt).module()
        self.prefill_graph = None

    def _report(self, rows, probe) -> None:
        ids, positions = rows
        if probe is None:
            return
        rt = self.rt
        probe.tensor("embeddings", torch.nn.functional.embedding(ids, rt.embed) * rt.embed_scale)
        for t in rt.types:
            cos_kind, sin_kind = rope_kinds(t)
            probe.tensor(cos_kind, getattr(rt, f"cos_{t}")[positions])
            probe.tensor(sin_kind, getattr(rt, f"sin_{t}")[positions])

    def prefill(self, input_ids, extra_inputs, probe):
        args = self.rt.prepare_prefill(input_ids, extra_inputs)
        if self.prefill_graph is None:
            self.prefill_graph = export_prefill(self.rt, input_ids, extra_inputs).module()
        T = len(input_ids)
        if not extra_inputs:  # text-only: embeddings are the scaled token rows
            self._report((args[0][0, :T], torch.arange(T)), probe)
        with torch.no_grad():
            return self.prefill_graph(*args)

    def decode(self, token_id, position, probe):
        self._report((torch.tensor([token_id]), torch.tensor([position])), probe)
        with torch.no_grad():
            return self.decode_step(torch.tensor([[token_id]]), torch.tensor([position]))


class NoSoftcapRuntime(StaticGemma4Runtime):
    """The static runtime with the final logit soft-cap left out (a known bug class)."""

    name = "static-no-softcap"

    def __init__(self, loaded, max_seq: int):
        super().__init__(loaded, max_seq)
        self.softcap = None


class Incomplete:
    name = "incomplete"

    def prefill(self, input_ids, extra_inputs, probe):
        raise AssertionError("never called")


def make_exported(loaded, max_seq: int):
    return ExportedRuntime(loaded, max_seq)


def make_no_softcap(loaded, max_seq: int):
    return NoSoftcapRuntime(loaded, max_seq)


def make_incomplete(loaded, max_seq: int):
    return Incomplete()


not_a_factory = 42
