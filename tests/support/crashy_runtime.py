"""Runtime plug-ins that crash, or report only some rows, for tests/test_plugin_api.py.

Each crashes at a line of THIS file that the one-line error must name ("at
tests/support/crashy_runtime.py:N"), after reporting something the line must name too ("after
layer 4 q"). They wrap the static runtime, so everything before the crash is real.
"""

from __future__ import annotations

import torch

from gemma4_trace.replayer.runtime import StaticGemma4Runtime, rms_norm


class _Probe:
    """Passes reports on to the driver's probe; `hook(kind, layer)` runs after each."""

    def __init__(self, probe, hook):
        self.probe, self.hook = probe, hook

    def tensor(self, kind, value, layer=None, positions=None):
        got = (
            self.probe.tensor(kind, value, layer)
            if positions is None
            else self.probe.tensor(kind, value, layer, positions=positions)
        )
        self.hook(kind, layer)
        return got


class CrashAfter(StaticGemma4Runtime):
    """Raises ValueError right after reporting (kind, layer) in the given phase."""

    name = "crashy"

    def __init__(self, loaded, max_seq, kind, layer, phase="prefill"):
        super().__init__(loaded, max_seq)
        self.at, self.phase = (kind, layer), phase

    def _hook(self, kind, layer):
        if (kind, layer) == self.at:
            raise ValueError(f"NPU kernel rejected the {kind} tile")  # CRASH-SITE-AFTER

    def prefill(self, input_ids, extra_inputs=None, probe=None):
        wrap = _Probe(probe, self._hook) if self.phase == "prefill" else probe
        return super().prefill(input_ids, extra_inputs, wrap)

    def decode(self, token_id, position, probe=None):
        wrap = _Probe(probe, self._hook) if self.phase == "decode" else probe
        return super().decode(token_id, position, wrap)


class CrashInOurHelper(StaticGemma4Runtime):
    """Calls one of our helpers wrongly: the error is raised in our code, the site is the call here."""

    name = "crashy-helper"

    def prefill(self, input_ids, extra_inputs=None, probe=None):
        return rms_norm(torch.zeros(2, 3), torch.zeros(5), 1e-6)  # CRASH-SITE-HELPER


class DeferredRuntime:
    """Builds the static runtime only at prefill: the factory has no cost and no max_seq to guess."""

    name = "deferred"

    def __init__(self, loaded, max_seq):
        self.loaded, self.max_seq, self.rt = loaded, max_seq, None

    def prefill(self, input_ids, extra_inputs, probe):
        self.rt = StaticGemma4Runtime(self.loaded, self.max_seq)
        return self.rt.prefill(input_ids, extra_inputs, probe)

    def decode(self, token_id, position, probe):
        return self.rt.decode(token_id, position, probe)


class LastRowOnly(StaticGemma4Runtime):
    """Reports final_hidden for the prompt's last row only in prefill (its head runs on that row),
    every other kind in full; `plant` adds 1.0 to channel 0 of the reported row."""

    name = "last-row-only"

    def __init__(self, loaded, max_seq, plant=False):
        super().__init__(loaded, max_seq)
        self.plant, self.prompt_len = plant, None

    def prefill(self, input_ids, extra_inputs=None, probe=None):
        self.prompt_len = len(input_ids)
        return super().prefill(input_ids, extra_inputs, None if probe is None else _LastRow(probe, self))


class _LastRow:
    def __init__(self, probe, rt):
        self.probe, self.rt = probe, rt

    def tensor(self, kind, value, layer=None):
        if kind != "final_hidden":
            return self.probe.tensor(kind, value, layer)
        T = self.rt.prompt_len
        row = value[T - 1 : T].clone()
        if self.rt.plant:
            row[0, 0] += 1.0
        return self.probe.tensor(kind, row, positions=[T - 1])


class CausalVision(StaticGemma4Runtime):
    """Image tokens attend causally (no bidirectional image blocks): TICO's text masks."""

    name = "causal-vision"

    def __init__(self, loaded, max_seq):
        super().__init__(loaded, max_seq)
        self.bidir_vision = False


def make_crash_after_layer4_q(loaded, max_seq):
    return CrashAfter(loaded, max_seq, "q", 4)


def make_crash_after_embeddings_in_decode(loaded, max_seq):
    return CrashAfter(loaded, max_seq, "embeddings", None, phase="decode")


def make_crash_in_factory(loaded, max_seq):
    return CrashAfter(loaded, max_seq, "never", None)._crash_now()  # the factory itself crashes


def _crash_now(self):
    raise RuntimeError("no NPU device found")  # CRASH-SITE-FACTORY


CrashAfter._crash_now = _crash_now


def make_crash_in_our_helper(loaded, max_seq):
    return CrashInOurHelper(loaded, max_seq)


def make_deferred(loaded, max_seq):
    return DeferredRuntime(loaded, max_seq)


def make_last_row_only(loaded, max_seq):
    return LastRowOnly(loaded, max_seq)


def make_last_row_only_planted(loaded, max_seq):
    return LastRowOnly(loaded, max_seq, plant=True)


def make_causal_vision(loaded, max_seq):
    return CausalVision(loaded, max_seq)


class _BadPositions(StaticGemma4Runtime):
    name = "bad-positions"

    def __init__(self, loaded, max_seq, positions):
        super().__init__(loaded, max_seq)
        self.positions = positions

    def prefill(self, input_ids, extra_inputs=None, probe=None):
        zeros = torch.zeros(len(self.positions), self.hidden)
        probe.tensor("embeddings", zeros, positions=self.positions)  # CRASH-SITE-POSITIONS
        return super().prefill(input_ids, extra_inputs, None)


def make_positions_past_step(loaded, max_seq):
    return _BadPositions(loaded, max_seq, [11, 12, 13])  # the prefill feeds 0..12


def make_positions_unsorted(loaded, max_seq):
    return _BadPositions(loaded, max_seq, [5, 3])


class _PlantRow:
    def __init__(self, probe, row):
        self.probe, self.row = probe, row

    def tensor(self, kind, value, layer=None):
        if kind == "final_hidden" and value.shape[0] > self.row:
            value = value.clone()
            value[self.row, 0] += 1.0
        return self.probe.tensor(kind, value, layer)


class PlantedPromptRow(StaticGemma4Runtime):
    """Reports every row; final_hidden's prompt row 3 has 1.0 added to channel 0."""

    name = "planted-row-3"

    def prefill(self, input_ids, extra_inputs=None, probe=None):
        return super().prefill(input_ids, extra_inputs, None if probe is None else _PlantRow(probe, 3))


def make_planted_prompt_row(loaded, max_seq):
    return PlantedPromptRow(loaded, max_seq)
