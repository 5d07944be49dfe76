"""Capture narrowed by `--kinds` (RuntimeChoice.capture) where the adapter taps by wrapping or
hooking: mlx (its child wraps mlx-lm's modules and streams what they compute back) and tico (forward
hooks, observer taps, wrapped mask/RoPE builders). Narrowed, they tap only the kinds asked; asked
for none, nothing (the runtime alone); the numbers they compute are the same either way."""

from __future__ import annotations

import pytest
import torch

from gemma4_trace.hf.model import load_for_reference
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.api import close_runtime
from gemma4_trace.replayer.core import default_max_seq, make_runtime, read_reference
from gemma4_trace.replayer.runtimes.registry import parse_runtime
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke

pytestmark = pytest.mark.slow  # several engines per runtime; make test-fast skips it

NEEDS = {"mlx": "mlx_lm", "tico": "tico.quantization.recipes.debug.static_gemma4_runtime"}
NAMES = ("mlx", "mlx-q4", "tico", "tico-quant")
PROBED = ("mlx", "tico", "tico-quant")  # mlx-q4's child taps as mlx's does (five engines a run: ~25 s)


def _need(name: str) -> None:
    pytest.importorskip(NEEDS[name.split("-")[0]], reason=f"{name}'s extra is not installed")


class Recorder:
    """A probe keeping every (kind, layer, tensor) reported, in order."""

    def __init__(self):
        self.seen = []

    def tensor(self, kind, value, layer=None, positions=None):
        self.seen.append((kind, layer, torch.as_tensor(value).clone()))

    def of(self, kind):
        return [(layer, t) for k, layer, t in self.seen if k == kind]


def _run(choice, probe):
    """(logits of every step, the runtime's taps) of REF's short golden teacher-forced through a
    runtime made from `choice`; taps: what the mlx child streamed, or the hooks tico installed."""
    ref = read_reference(golden_path("short"))
    loaded = load_for_reference(ref.provenance, weights=not choice.spec.weightless)
    T, max_seq = len(ref.prompt_ids), default_max_seq(len(ref.prompt_ids), ref.max_new_tokens)
    rt = make_runtime(choice, loaded, max_seq)
    streamed = []
    if hasattr(rt, "child"):  # count the child's tensor messages (mlx hands each to the probe)
        call = rt.child.call

        def counting(*a, tensor=None, **k):
            def seen(kind, layer, array):
                streamed.append(kind)
                tensor(kind, layer, array)

            return call(*a, tensor=seen, **k)

        rt.child.call = counting
    try:
        with torch.no_grad():
            logits = [rt.prefill(torch.tensor(ref.prompt_ids, dtype=torch.long), ref.extra, probe)]
            for s in range(1, ref.n_steps):
                logits.append(rt.decode(ref.tokens[s - 1], T + s - 1, probe))
    finally:
        close_runtime(rt)
    return torch.stack(logits), (streamed if hasattr(rt, "child") else _tico_taps(rt.rt))


def _tico_taps(t) -> list[str]:
    """What is tapped in TICO's runtime: forward hooks on its modules, wrapped observer calls
    (`_fq`) and wrapped mask/RoPE builders."""
    roots = (t.prefill_layers, t.decode_layers, t.mm_fusion, t.token_embedding, t.ple_projection)
    mods = {id(m): m for r in roots if r is not None for m in r.modules()}.values()
    taps = [type(m).__name__ for m in mods for _ in m._forward_hooks]
    taps += ["_fq" for m in mods if "_fq" in vars(m)]
    return taps + [n for n in ("build_prefill_masks_and_rope", "build_decode_masks_and_rope") if n in vars(t)]


@pytest.mark.parametrize("name", NAMES)
def test_layer_out_replay_is_bit_identical_to_the_full_one(name, tmp_path):
    _need(name)
    ref, full, narrow = golden_path("short"), tmp_path / "full.h5", tmp_path / "narrow.h5"
    for out, kinds in ((full, ()), (narrow, ("--kinds", "layer_out"))):
        r = invoke("replay", ref, "--runtime", name, *kinds, "-o", out)
        assert r.exit_code == 0, r.output
    with TraceReader(full) as a, TraceReader(narrow) as b:
        assert {k for k, _ in b.kinds_present()} == {"layer_out", "logits", "token"}
        assert len(a.kinds_present()) > len(b.kinds_present())
        assert b.provenance["runtime"] == a.provenance["runtime"]
        for kind, layer in b.kinds_present():
            assert (a.read(kind, layer) == b.read(kind, layer)).all(), (kind, layer)
        assert list(a.tokens()) == list(b.tokens())


@pytest.mark.parametrize("name", PROBED)
def test_a_narrowed_runtime_taps_only_what_is_asked_and_alone_nothing(name):
    _need(name)
    choice = parse_runtime(name)
    every = Recorder()
    logits, taps = _run(choice, every)
    L = len(every.of("layer_out")) // 3  # 3 steps
    assert L > 1 and len({k for k, _, _ in every.seen}) >= 8
    for kinds in (("layer_out",), ("final_hidden", "q")):
        probe = Recorder()
        got, narrow = _run(choice.with_capture(kinds), probe)
        assert torch.equal(got, logits), kinds
        assert {k for k, _, _ in probe.seen} == set(kinds)
        for kind in kinds:  # the same tensors, in the same order, as the full run's
            mine, full = probe.of(kind), every.of(kind)
            assert len(mine) == len(full) > 0
            assert all(a == c and torch.equal(b, d) for (a, b), (c, d) in zip(mine, full)), kind
        assert 0 < len(narrow) < len(taps), (kinds, narrow)
        if name.startswith("mlx"):  # the child streamed the asked kinds only
            assert sorted(narrow) == sorted(k for k, _, _ in probe.seen)
        elif kinds == ("layer_out",):  # one hook on each layer's prefill and decode export module
            assert len(narrow) == 2 * L, narrow
    # the runtime alone: the same logits, nothing tapped, nothing reported to a probe given one
    alone = choice.with_capture(())
    got, none = _run(alone, None)
    assert torch.equal(got, logits) and none == []
    probe = Recorder()
    got, none = _run(alone, probe)
    assert torch.equal(got, logits) and none == [] and probe.seen == []
