"""RuntimeChoice.capture in the step-graph runtimes (onnx, openvino, executorch and its int8
reference) and mobius: a replay that keeps some kinds (`--kinds`) runs a graph whose extra outputs
are those kinds only, and a runtime asked for none (`with_capture(())`: the runtime alone) a graph
of logits and caches. The narrowed graphs give the full graph's values, bit for bit: the tests
compare real runs of both. executorch-int8's narrowed programs are the int8 reference's converted
programs lowered as executorch's float ones are; that their quantization is the full program's is
test_int8_narrowed_programs_quantize_as_the_full_ones. Neither int8 mode is replayed narrowed
here: executorch-int8's XNNPACK lowering takes about 4 minutes a program on 2 cores (the suite
lowers its full programs once, in tests/runtimes/test_executorch.py), and the int8 reference's
narrowing is executorch's own code path (the step graphs' outputs, replayer/functional.py) on
programs whose quantization that test compares; replaying it cost the suite about 3 minutes.

One 3-layer random Gemma 4 (sliding, full, and a sliding layer reusing layer 0's K/V; the model,
prompt, max_seq and prefill chunk of tests/runtimes/test_executorch.py, whose full-capture
programs the suite's artifact cache then shares) keeps the exports and lowerings short."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

MAX_SEQ, CHUNK, N_LAYERS = 16, 3, 3
PROMPT = "2,17,33,40,51,60,71"  # 7 tokens: past the sliding window of 4
NEEDS = {  # runtime -> the modules it needs
    "onnx": ("onnxruntime", "onnxscript"),
    "openvino": ("openvino",),
    "executorch": ("executorch",),
    "executorch-int8": ("executorch", "torchao"),
    "executorch-int8-reference": ("executorch", "torchao"),
    "mobius": ("mobius", "onnxruntime", "onnx_ir"),
}
LAYER_OUT = frozenset({"layer_out"})
REPLAYED = [n for n in NEEDS if not n.startswith("executorch-int8")]  # not replayed narrowed (docstring)
LAYER_OUTS = [f"L{i:02d}.layer_out" for i in range(N_LAYERS)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gemma4_trace.hf.model import load_model
    from tests.support import tiny_models

    d = tmp_path_factory.mktemp("capture")
    S, F = tiny_models.S, tiny_models.F
    path = tiny_models.build(d / "model", num_hidden_layers=N_LAYERS, layer_types=[S, F, S], num_kv_shared_layers=1)
    ref = d / "ref.h5"
    res = invoke("record", "--model", path, "--input-ids", PROMPT, "--max-new-tokens", "3", "-o", ref)
    assert res.exit_code == 0, res.output
    return {"dir": d, "path": path, "ref": ref, "loaded": load_model(path)}


@pytest.fixture(scope="module", params=REPLAYED)
def replays(request, model):
    """The runtime's full replay of REF and its `--kinds layer_out` replay (CLI)."""
    name = request.param
    missing = [m for m in NEEDS[name] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"--runtime {name} needs {', '.join(missing)}")
    chunk = ["--prefill-chunk", str(CHUNK)] if name.startswith("executorch") else []  # as test_executorch.py
    out, made = {}, []
    from gemma4_trace.replayer import replay

    def spy(choice, *args):  # the runtime each replay made: the kinds its graphs expose
        rt = real(choice, *args)
        made.append((choice.capture, exposed(rt)))
        return rt

    real = replay.make_runtime
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay, "make_runtime", spy)
        for what, kinds in (("full", []), ("layer_out", ["--kinds", "layer_out"])):
            out[what] = model["dir"] / f"{name}-{what}.h5"
            args = ("replay", model["ref"], "--model", model["path"], "--runtime", name, "--max-seq", str(MAX_SEQ))
            res = invoke(*args, *chunk, *kinds, "-o", out[what])
            assert res.exit_code == 0, res.output
    assert made[0][0] is None and made[0][1] >= {"embeddings", "q", "k", "v", "attn_out", "layer_out"}, made
    assert made[1] == (LAYER_OUT, {"layer_out"}), made  # --kinds layer_out: a graph exposing layer_out alone
    return name, out


def exposed(rt) -> set[str]:
    """The kinds a runtime's loaded graphs have as outputs (as it reads them back)."""
    from gemma4_trace.replayer import functional as F

    if hasattr(rt, "taps"):  # mobius
        return {kind for kind, _ in rt.taps.values()}
    if hasattr(rt, "names"):  # executorch: the programs' reported outputs (their number is checked per run)
        return {F.output_site(n)[0] for names in rt.names.values() for n in names}
    outs = [n for names in rt.outputs.values() for n in names]  # onnx, openvino: the engine's session's outputs
    return {F.output_site(n)[0] for n in outs if n != "logits" and not n.endswith("_cache_out")}


def same_values(name: str, narrow: np.ndarray, full: np.ndarray) -> None:
    """The narrowed graph's values are the full graph's: bit-identical (the engines compute the
    values the same way; the full graph's extra outputs are slices of them). (executorch-int8's
    XNNPACK lowering, not replayed here, moves them: it lowers the full program's extra dequantize
    nodes into other int8 delegates; measured on this model, layer_out of layer 1 4.6e-2 and logits
    1.1e-1 rel-L2, well inside the int8 run's own error against HF, 5.1e-1 and 6.7e-1.)"""
    assert narrow.shape == full.shape
    assert np.array_equal(narrow, full), (name, np.abs(narrow - full).max())


def test_a_layer_out_replay_holds_the_full_replays_layer_out_and_logits(replays, model):
    name, out = replays
    with TraceReader(out["full"]) as a, TraceReader(out["layer_out"]) as b:
        got = b.kinds_present()
        assert got == [*(("layer_out", i) for i in range(N_LAYERS)), ("logits", None), ("token", None)], got
        assert {k for k, _ in a.kinds_present()} > {"q", "attn_out", "layer_out"}  # the full replay: every kind
        for site in got:
            if site[0] == "token":
                assert np.array_equal(a.read("token"), b.read("token"))
            else:
                same_values(name, b.read(*site), a.read(*site))


def _outputs(name: str, model, kinds) -> dict:
    """The outputs of the artifact a replay with capture `kinds` runs (from the artifact cache):
    {graph: [output name]}, or for a .pte program {graph: its number of outputs}."""
    loaded, ref = model["loaded"], model["ref"]
    if name == "onnx":
        import onnx

        from gemma4_trace.replayer.runtimes import onnx as O

        art = O.exported(loaded, MAX_SEQ, kinds)
        try:
            return {g: [o.name for o in onnx.load(str(art.path / f"{g}.onnx")).graph.output] for g in O.GRAPHS}
        finally:
            art.close()
    if name == "openvino":
        import openvino as ov

        from gemma4_trace.replayer.runtimes import openvino as V

        art, core = V.ir(loaded, MAX_SEQ, name, kinds), ov.Core()
        try:
            return {
                g: [o.get_any_name() for o in core.read_model(str(art.path / f"{g}.xml")).outputs] for g in V.F.STEPS
            }
        finally:
            art.close()
    if name == "mobius":
        from gemma4_trace.replayer.runtimes.mobius import MobiusRuntime

        rt = MobiusRuntime(loaded, MAX_SEQ, kinds)  # its onnxruntime session's outputs, its taps
        try:
            return {"model": (list(rt.outputs), rt.taps)}
        finally:
            rt.close()
    from executorch.runtime import Runtime

    from gemma4_trace.replayer.core import read_reference
    from gemma4_trace.replayer.runtimes import executorch as ET

    r = read_reference(ref)
    if name == "executorch-int8-reference":  # the converted PT2E programs, run by PyTorch
        return {g: len(p.graph_signature.output_specs) for g, p in _converted(model, kinds).items()}
    art = ET.cached_programs(loaded, name, MAX_SEQ, r.prompt_ids, r.extra, prefill_chunk=CHUNK, kinds=kinds)
    try:
        et = Runtime.get()
        return {
            g: et.load_program(art.path / f"{g}.pte").load_method("forward").metadata.num_outputs() for g in ET.PROGRAMS
        }
    finally:
        art.close()


def _converted(model, kinds) -> dict:
    """executorch-int8's converted PT2E programs of capture `kinds` (from the artifact cache, built there if absent)."""
    import torch

    from gemma4_trace.replayer import functional as F
    from gemma4_trace.replayer.core import read_reference
    from gemma4_trace.replayer.runtimes import executorch as ET

    r, host = read_reference(model["ref"]), F.FunctionalKV(model["loaded"], MAX_SEQ, CHUNK)
    art = ET.converted_programs(model["loaded"], MAX_SEQ, r.prompt_ids, r.extra, host, kinds)
    try:
        with F.quiet():
            return {g: torch.export.load(art.path / f"{g}.pt2") for g in ET.PROGRAMS}
    finally:
        art.close()


@pytest.mark.parametrize("kinds", [LAYER_OUT, frozenset()], ids=["layer_out", "none"])
def test_a_narrowed_artifact_has_only_the_asked_kinds_as_outputs(replays, model, kinds):
    from gemma4_trace.replayer import functional as F

    name, _ = replays
    full, narrow = _outputs(name, model, None), _outputs(name, model, kinds)
    if name == "mobius":  # promoted outputs are named by mobius's graph values: taps.json names their kinds
        (outs, taps), (full_outs, full_taps) = narrow["model"], full["model"]
        caches = [n for n in full_outs if n.startswith("present.")]
        asked = [n for n, (kind, _) in full_taps.items() if kind in kinds]
        assert len(asked) == len(kinds) * N_LAYERS and len(full_taps) > 3 * N_LAYERS, full_taps
        assert sorted(outs) == sorted(["logits", *caches, *asked]) and taps == {n: full_taps[n] for n in asked}
        return
    caches = [f"{c}_out" for c in F.cache_names(F.FunctionalKV(model["loaded"], MAX_SEQ))]
    asked = LAYER_OUTS if kinds else []
    for g, outs in narrow.items():
        if name.startswith("executorch"):  # a .pte program's outputs have no names: their number
            assert outs == 1 + len(caches) + len(asked) < full[g], (g, outs, full[g])
        else:
            assert outs == ["logits", *caches, *asked], (g, outs)
            assert set(outs) < set(full[g]) and "L00.q" in full[g]


class Recorder:
    def __init__(self):
        self.sites = []

    def tensor(self, kind, value, layer=None):
        self.sites.append((kind, layer))


def test_the_runtime_alone_gives_the_full_replays_logits_and_reports_nothing(replays, model):
    """with_capture(()): the graph of logits and caches, run with probe=None, gives the logits of the
    full replay (REF's tokens fed, as the replay fed them); given a probe it reports nothing."""
    from gemma4_trace.replayer.core import make_runtime, read_reference
    from gemma4_trace.replayer.runtimes.registry import parse_runtime

    name, out = replays
    r = read_reference(model["ref"])
    rt = make_runtime(parse_runtime(name).with_capture(()), model["loaded"], MAX_SEQ)
    try:
        if name.startswith("executorch"):
            rt.prefill_chunk = CHUNK
        assert exposed(rt) == set()
        for probe in (None, Recorder()):
            import torch

            T = len(r.prompt_ids)
            logits = [rt.prefill(torch.tensor(r.prompt_ids), r.extra, probe)]
            logits += [rt.decode(tok, T + i, probe) for i, tok in enumerate(r.tokens[:-1])]
            with TraceReader(out["full"]) as a:
                want = a.read("logits")
            same_values(name, np.stack([t.float().numpy() for t in logits]), want)
        assert probe.sites == []
    finally:
        rt.close()


def test_int8_narrowed_programs_quantize_as_the_full_ones(model):
    """Calibrating a narrowed program gives the full program's quantization: the same observers on
    the same computation, so the same quantize nodes with the same scales and zero points, in
    order; the programs differ only by the full one's output slices and the dequantize nodes that
    feed them."""
    if any(importlib.util.find_spec(m) is None for m in NEEDS["executorch-int8"]):
        pytest.skip("executorch-int8 needs executorch and torchao")
    from collections import Counter

    def parts(program):
        nodes = [n for n in program.graph.nodes if n.op == "call_function"]
        q = [n for n in nodes if "quantize_per" in str(n.target) and "dequantize" not in str(n.target)]
        params = [(str(n.target), *(a for a in n.args[1:] if not hasattr(a, "op"))) for n in q]
        return params, Counter(str(n.target) for n in nodes)

    full = {g: parts(p) for g, p in _converted(model, None).items()}
    for kinds in (LAYER_OUT, frozenset()):
        for g, (params, ops) in ((g, parts(p)) for g, p in _converted(model, kinds).items()):
            assert len(params) > 100 and params == full[g][0], (kinds, g)
            extra = full[g][1] - ops
            assert not ops - full[g][1] and set(extra) <= {
                "aten.select.int",
                "quantized_decomposed.dequantize_per_tensor.default",
            }, (kinds, g, extra)
