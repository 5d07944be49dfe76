"""Runtime plug-ins written against the public API only (docs/runtime-api.md).

    trace replay REF.h5 --runtime tests.support.plugin_runtime:make_exported -o RUN.h5

`make_exported` runs the torch.export'ed prefill and decode graphs of the static runtime (the step
graphs of gemma4_trace.replayer.functional, K/V caches in and out, kept here between steps): it
reports the tensors it can see from outside the graphs (the input embeddings and the RoPE rows)
and the driver writes logits and tokens. `make_no_softcap` is a deliberately wrong runtime (final
soft-cap dropped, bug class 6) for diff tests. `make_incomplete` does not follow the API (no decode).
"""

from __future__ import annotations

import torch

from gemma4_trace.replayer import functional as F
from gemma4_trace.replayer.runtime import StaticGemma4Runtime
from gemma4_trace.traces.schema import rope_kinds


class ExportedRuntime:
    name = "exported-static"

    def __init__(self, loaded, max_seq: int):
        self.rt = F.FunctionalKV(loaded, max_seq)
        self.steps = {step: F.export_step(self.rt, step).module() for step in F.STEPS}
        self.caches = None

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

    def _run(self, step: str, args) -> torch.Tensor:
        n = len(F.zero_caches(self.rt))
        with torch.no_grad():
            out = self.steps[step](*args, *self.caches)
        self.caches = list(out[1 : 1 + n])  # the updated K/V caches: the next step's input
        return out[0]

    def prefill(self, input_ids, extra_inputs, probe):
        args = self.rt.prepare_prefill(input_ids, extra_inputs)
        T = len(input_ids)
        if not extra_inputs:  # text-only: embeddings are the scaled token rows
            self._report((args[0][0, :T], torch.arange(T)), probe)
        self.caches = F.zero_caches(self.rt)
        return self._run("prefill", args)

    def decode(self, token_id, position, probe):
        self._report((torch.tensor([token_id]), torch.tensor([position])), probe)
        return self._run("decode", (torch.tensor([[token_id]]), torch.tensor([position])))


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
