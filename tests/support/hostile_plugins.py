"""Runtime plug-ins that misbehave on purpose (tests/trust/test_other.py): each must end a replay as
exit 2 and one sanitised line, never as a silent success, a hang or a terminal full of escapes."""

from __future__ import annotations

import sys

import torch

VOCAB = 680  # the embedded tiny model


class Hostile:
    name = "hostile"

    def __init__(self, prefill=None, decode=None, name=None):
        self._prefill, self._decode = prefill, decode
        if name is not None:
            self.name = name

    def prefill(self, input_ids, extra_inputs, probe):
        return self._prefill(input_ids, probe) if self._prefill else torch.zeros(VOCAB)

    def decode(self, token_id, position, probe):
        return self._decode(probe) if self._decode else torch.zeros(VOCAB)


def make_exit_in_factory(loaded, max_seq):
    sys.exit(0)


def make_exit_in_prefill(loaded, max_seq):
    return Hostile(prefill=lambda ids, probe: sys.exit(0))


def make_exit_in_decode(loaded, max_seq):
    return Hostile(decode=lambda probe: sys.exit(3))


def make_complex_logits(loaded, max_seq):
    return Hostile(prefill=lambda ids, probe: torch.zeros(VOCAB, dtype=torch.complex64))


def make_string_logits(loaded, max_seq):
    return Hostile(prefill=lambda ids, probe: "logits")


def make_list_logits(loaded, max_seq):
    return Hostile(prefill=lambda ids, probe: ["a"] * VOCAB)


def make_huge_logits_view(loaded, max_seq):
    return Hostile(prefill=lambda ids, probe: torch.zeros(1).expand(10**12))


def make_wide_probe(loaded, max_seq):
    # a view claiming 13 x 10^12 floats: copying it would allocate 52 TB
    return Hostile(prefill=lambda ids, probe: probe.tensor("embeddings", torch.zeros(1, 1).expand(len(ids), 10**12)))


def make_complex_probe(loaded, max_seq):
    return Hostile(
        prefill=lambda ids, probe: probe.tensor("embeddings", torch.zeros(len(ids), 64, dtype=torch.complex64))
    )


def make_evil_error(loaded, max_seq):
    def boom(ids, probe):
        raise ValueError("first line\nsecond line \x1b[2J\x1b[31mred")

    return Hostile(prefill=boom, name="evil\nname\x1b[31m")


def make_evil_name(loaded, max_seq):
    return Hostile(name="evil\nname\x1b]0;title\x07\x1b[31m")
