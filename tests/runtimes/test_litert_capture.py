"""`--runtime litert*` capture narrowed by `--kinds` (RuntimeChoice.capture): asked for some kinds,
the interpreter keeps no tensor (experimental_preserve_all_tensors off, XNNPACK fuses) and those
kinds' tensors are extra outputs of a rewritten model.tflite (replayer/runtimes/litert/outputs.py);
asked for none, the export runs as it is: tokens and logits only, the runtime alone.

The export is test_litert.py's (max_seq 16, prefill chunks of 3 rows), from the suite's artifact cache."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (pip install -e '.[litert]')")
if importlib.util.find_spec("litert_torch") is None:  # not imported here: its TensorFlow costs each worker 4 s
    pytest.skip("litert-torch is not installed (pip install -e '.[litert]')", allow_module_level=True)

import torch  # noqa: E402

from gemma4_trace.hf.model import load_model  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import export as E  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import graph as G  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import outputs as O  # noqa: E402
from gemma4_trace.replayer.runtimes.litert.runtime import LiteRTRuntime  # noqa: E402
from gemma4_trace.traces.errors import TraceToolError  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke  # noqa: E402

pytestmark = pytest.mark.slow  # exports (once, cached) and runs the interpreter; make test-fast skips it

PROMPT = [2, 17, 33, 40, 51, 60, 71, 80]  # 7 rows through prefill_3 (chunks 0-2, 3-5, 6), the last through decode
MAX_SEQ, CHUNK = 16, 3


def _close(got, want, what) -> None:
    """The narrowed (or bare) runtime's numbers against the full capture's. Measured bit-identical
    here (max abs difference 0 for every kind, float, int8 and int4, on the embedded model): the
    same XNNPACK kernels run either way at this width. Without preserve_all_tensors XNNPACK may fuse
    ops it runs one by one otherwise, and a fused kernel may round differently on another CPU, so
    the check allows float32 rounding (1e-6 of the tensor's largest value), not more."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    assert np.abs(got - want).max() <= 1e-6 * max(1.0, np.abs(want).max()), what


class Recorder:
    def __init__(self):
        self.seen = []

    def tensor(self, kind, value, layer=None, positions=None):
        self.seen.append((kind, layer))


def _runtime(capture, mode="litert"):
    rt = LiteRTRuntime(load_model(weights=False), MAX_SEQ, mode, capture)
    rt.prefill_chunk = CHUNK
    return rt


def _steps(rt, probe) -> torch.Tensor:
    """Logits of the prompt's prefill and two decode steps."""
    try:
        out = [rt.prefill(torch.tensor(PROMPT), {}, probe)]
        for i, tok in enumerate((5, 9)):
            out.append(rt.decode(tok, len(PROMPT) + i, probe))
    finally:
        rt.close()
    return torch.stack(out)


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    d = tmp_path_factory.mktemp("litert-capture")
    ref = d / "ref.h5"
    r = invoke("record", "--input-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4", "-o", ref)
    assert r.exit_code == 0, r.output
    out = {}
    for name, kinds in (("full", ()), ("layer_out", ("--kinds", "layer_out"))):
        out[name] = d / f"{name}.h5"
        r = invoke(
            "replay",
            ref,
            "--runtime",
            "litert",
            "--max-seq",
            MAX_SEQ,
            "--prefill-chunk",
            CHUNK,
            *kinds,
            "-o",
            out[name],
        )
        assert r.exit_code == 0, r.output
    return out


def test_a_layer_out_replay_gives_the_full_replays_layer_out_and_logits(replays):
    with TraceReader(replays["full"]) as a, TraceReader(replays["layer_out"]) as b:
        assert {k for k, _ in b.kinds_present()} == {"layer_out", "logits", "token"}
        assert [x for x in a.kinds_present() if x[0] in ("layer_out", "logits")] == [
            x for x in b.kinds_present() if x[0] != "token"
        ]
        for kind, layer in b.kinds_present():
            if kind != "token":
                _close(b.read(kind, layer), a.read(kind, layer), (kind, layer))
        assert list(a.tokens()) == list(b.tokens())
        runtime = b.provenance["runtime"]
        assert "--kinds layer_out" in runtime and "extra graph outputs" in runtime, runtime
        # the pruned layers' prefill rows still come from decode steps, final_hidden's no longer
        assert "prefill rows of layers 4, 5, 6, 7 from decode steps" in runtime, runtime


def test_the_narrowed_runtime_runs_a_graph_returning_the_taps_without_keeping_tensors():
    full, narrow = _runtime(None), _runtime(frozenset({"layer_out", "final_hidden"}))
    for rt in (full, narrow):
        rt.prepare()  # exports (or takes from the cache) and loads the files
    try:
        assert full.kept == ["model"] and narrow.kept == []  # preserve_all_tensors on, then off
        src, rewritten = G.read(full.model_file), G.read(narrow.model_file)
        assert narrow.model_file != full.model_file
        for sig in (f"prefill_{CHUNK}", "decode"):
            taps = narrow.taps[sig]
            assert {t.kind for t in taps} == ({"layer_out", "final_hidden"} if sig == "decode" else {"layer_out"})
            extra = {name: i for name, i in rewritten[sig].outputs.items() if name not in src[sig].outputs}
            assert extra == {O.output_name(t.index): t.index for t in taps}, sig
            # the same graph otherwise: its tensors and operators untouched
            assert [x.name for x in rewritten[sig].tensors] == [x.name for x in src[sig].tensors]
            assert rewritten[sig].ops == src[sig].ops
    finally:
        full.close()
        narrow.close()


def test_the_runtime_alone_gives_the_same_logits_and_reports_nothing():
    every, alone = Recorder(), Recorder()
    whole = _runtime(None)
    full = _steps(whole, every)
    assert len({k for k, _ in every.seen}) >= 10  # every kind
    rt = _runtime(frozenset())
    got = _steps(rt, alone)
    assert alone.seen == [] and rt.kept == [] and rt.stepped == []  # no tensor kept, no second prefill pass
    assert rt.model_file == whole.model_file and "tokens and logits only" in rt.name  # the export as it is
    _close(got, full, "logits")
    _close(_steps(_runtime(frozenset()), None), full, "logits (probe None)")
    # narrowed, the probe gets the asked kinds, as many as the full capture reports
    some = Recorder()
    _close(_steps(_runtime(frozenset({"q", "k"})), some), full, "logits (q, k)")
    assert sorted(some.seen, key=str) == sorted([x for x in every.seen if x[0] in ("q", "k")], key=str)


def test_the_quantized_runtimes_narrow_the_same_way():
    every, some = Recorder(), Recorder()
    full = _steps(_runtime(None, "litert-int8"), every)
    _close(_steps(_runtime(frozenset({"attn_out"}), "litert-int8"), some), full, "int8 logits")
    assert some.seen and {k for k, _ in some.seen} == {"attn_out"}


# ------------------------------------------------------------------ the rewrite itself
@pytest.fixture(scope="module")
def source():
    art = E.exported(load_model(weights=False), MAX_SEQ, CHUNK)
    return art.path / "model.tflite"


def _decode_logits(path) -> np.ndarray:
    from ai_edge_litert.interpreter import Interpreter

    run = Interpreter(model_path=str(path)).get_signature_runner("decode")
    rng = np.random.default_rng(0)
    ins = {}
    for k, v in run.get_input_details().items():
        ins[k] = (
            rng.standard_normal(v["shape"]).astype(v["dtype"])
            if v["dtype"] == np.float32
            else np.zeros(v["shape"], v["dtype"])
        )
    ins["mask"][:] = 0
    return run(**ins)["logits"]


def test_a_rewritten_file_rewritten_again_moves_its_offset_buffers_and_computes_the_same(source, tmp_path):
    """The first rewrite moves the weights past the flatbuffer (offset and size, as files above
    2 GiB hold them); a second rewrite of that file moves them again: the same logits."""
    once, twice = tmp_path / "once.tflite", tmp_path / "twice.tflite"
    O.add_outputs(source, once, {"decode": [5]})
    O.add_outputs(once, twice, {f"prefill_{CHUNK}": [5]})
    assert G.read(twice)["decode"].outputs[O.output_name(5)] == 5
    assert G.read(twice)[f"prefill_{CHUNK}"].outputs[O.output_name(5)] == 5
    want = _decode_logits(source)
    for path in (once, twice):
        assert np.array_equal(_decode_logits(path), want)


def _offset_past_the_end(source, tmp_path):
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb

    moved = tmp_path / "moved.tflite"
    O.add_outputs(source, moved, {})
    m = fb.ModelT.InitFromPackedBuf(moved.read_bytes(), 0)
    b = next(b for b in m.buffers if b.offset > 1)
    b.offset = 1 << 40
    builder = flatbuffers.Builder(1 << 20)
    builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


@pytest.mark.parametrize(
    "damage, wanted, words",
    [
        (lambda s, t: b"not a flatbuffer at all", {}, "no TFL3 identifier"),
        (lambda s, t: s.read_bytes()[: s.stat().st_size // 3], {}, "cannot add outputs"),
        (lambda s, t: s.read_bytes()[:4] + b"TFL3" + b"\xff" * 64, {}, "cannot add outputs"),
        (_offset_past_the_end, {}, "a buffer lies past the end of the file"),
        (None, {"decode": [10**9]}, "signature 'decode' has no tensor 1000000000"),
        (None, {"decode": [-1]}, "has no tensor -1"),
        (None, {"nope": [1]}, "no signature 'nope'"),
    ],
    ids=["garbage", "truncated", "hostile", "offset", "index", "negative", "signature"],
)
def test_a_file_or_a_request_the_rewrite_cannot_take_is_one_line(source, tmp_path, damage, wanted, words):
    src = source
    if damage is not None:
        src = tmp_path / "bad.tflite"
        src.write_bytes(damage(source, tmp_path))
    with pytest.raises(TraceToolError) as e:
        O.add_outputs(src, tmp_path / "out.tflite", wanted)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_output_name_the_graph_already_returns_is_refused(source, tmp_path):
    once = tmp_path / "once.tflite"
    O.add_outputs(source, once, {"decode": [5]})
    with pytest.raises(TraceToolError, match="already returns tap_5"):
        O.add_outputs(once, tmp_path / "twice.tflite", {"decode": [5]})
