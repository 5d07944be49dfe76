"""torch.export of the static runtime's prefill and decode step (static shapes, probe off).

    ep = export_decode(rt)                 # torch.export.ExportedProgram
    step = ep.module()                     # callable: (token (1,1) long, input_pos (1,) long) -> logits (vocab,)

The exported graphs mutate the runtime's KV buffers in place, exactly as the eager step.
"""

from __future__ import annotations

import torch
from torch import nn

from .runtime import StaticGemma4Runtime


class PrefillStep(nn.Module):
    def __init__(self, rt: StaticGemma4Runtime):
        super().__init__()
        self.rt = rt

    def forward(self, ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid):
        return self.rt.prefill_step(ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid)


class DecodeStep(nn.Module):
    def __init__(self, rt: StaticGemma4Runtime):
        super().__init__()
        self.rt = rt

    def forward(self, token, input_pos):
        return self.rt.decode_step(token, input_pos)


def decode_example(rt: StaticGemma4Runtime) -> tuple:
    dev = rt.embed.device
    return (torch.zeros(1, 1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev))


def export_decode(rt: StaticGemma4Runtime) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(DecodeStep(rt), decode_example(rt), strict=False)


def export_prefill(
    rt: StaticGemma4Runtime, input_ids=(0,), extra_inputs: dict | None = None
) -> torch.export.ExportedProgram:
    """Export prefill; the example prompt only fixes dtypes, every shape is (1, max_seq, ...)."""
    args = rt.prepare_prefill(list(input_ids), extra_inputs or {})
    with torch.no_grad():
        return torch.export.export(PrefillStep(rt), args, strict=False)
