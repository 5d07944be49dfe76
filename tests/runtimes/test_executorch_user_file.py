"""`trace replay REF --pte PATH` (replayer/runtimes/executorch_user.py, executorch_file.py): the
tool's own programs, written by `trace export-pte`, replayed as the user's. The model, prompt,
max_seq and prefill chunk are tests/runtimes/test_executorch.py's, so the programs come from the
artifact cache its replays fill (lowering none here when it has run)."""

from __future__ import annotations

import hashlib

import h5py
import numpy as np
import pytest

pytest.importorskip("executorch", reason="executorch is not installed (pip install -e '.[executorch]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support import tiny_models  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

pytestmark = pytest.mark.slow  # lowers (or reads from the cache) and runs the programs

MAX_SEQ, CHUNK = 16, 3  # test_executorch.py's


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("pte")
    model, ref = tiny_models.executorch_case(d)
    own = d / "own"
    res = invoke("export-pte", "--model", model, "--max-seq", MAX_SEQ, "--prefill-chunk", CHUNK, "-o", own)
    assert res.exit_code == 0, res.output
    ours = d / "ours.h5"
    replay_trace(ref, ours, model_dir=model, runtime="executorch", max_seq=MAX_SEQ, prefill_chunk=CHUNK)
    return {"model": model, "ref": ref, "own": own, "ours": ours, "dir": d}


def datasets(path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_own_programs_replay_bit_identical_to_runtime_executorch(case):
    before = digests(case["own"])
    mine = case["dir"] / "mine.h5"
    args = ("--pte", case["own"], "--max-seq", MAX_SEQ, "-o", mine)
    res = invoke("replay", case["ref"], "--model", case["model"], *args)
    assert res.exit_code == 0, res.output
    a, b = datasets(case["ours"]), datasets(mine)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert diff_traces(case["ours"], mine).match
    with TraceReader(case["ours"]) as x, TraceReader(mine) as y:
        differ = {k for k in {*x.provenance, *y.provenance} if x.provenance.get(k) != y.provenance.get(k)}
        runtime = y.provenance["runtime"]
    # only the runtime's name differs in the provenance
    assert differ == {"runtime"}, differ
    assert runtime.startswith("pte-file own/ (ExecuTorch 1.5.1"), runtime
    assert f"prefill.pte sha256:{before['prefill.pte']}" in runtime and str(case["dir"]) not in runtime
    assert "3-row prefill chunk" in runtime
    assert digests(case["own"]) == before  # the user's files are never written
    print("provenance fields that differ:", sorted(differ))


def test_kinds_narrow_the_trace_not_the_program(case):
    some = case["dir"] / "some.h5"
    args = ("--pte", case["own"], "--max-seq", MAX_SEQ, "--kinds", "layer_out", "-o", some)
    res = invoke("replay", case["ref"], "--model", case["model"], *args)
    assert res.exit_code == 0, res.output
    with TraceReader(case["ours"]) as x, TraceReader(some) as y:
        for layer in range(3):
            assert np.array_equal(x.read("layer_out", layer), y.read("layer_out", layer))


def test_wrong_max_seq_and_other_checkpoint_are_refused(case):
    out = case["dir"] / "bad.h5"
    r = invoke("replay", case["ref"], "--model", case["model"], "--pte", case["own"], "--max-seq", 32, "-o", out)
    one_line_error(r, "lowered for max_seq 16", "--max-seq 16", out=out)
    # the embedded 8-layer model's REF against the 3-layer programs: the config check names the field
    from gemma4_trace.recorder.golden import golden_path

    r = invoke("replay", golden_path("short"), "--pte", case["own"], "--max-seq", MAX_SEQ, "-o", out)
    one_line_error(r, "does not match REF's model config", "layers that write K/V 2 (REF 5)", out=out)


def test_a_planted_weight_fault_is_found_in_its_layer(case):
    """Layer 1's MLP down projection scaled by 1.5 in row 0, in the programs' own bytes (XNNPACK keeps
    the float32 weights verbatim in the .pte): no lowering, and the diff finds the layer."""
    from safetensors.numpy import load_file

    weights = load_file(str(next(case["model"].glob("*.safetensors"))))
    row = np.ascontiguousarray(weights["model.layers.1.mlp.down_proj.weight"][0], dtype=np.float32).tobytes()
    planted = case["dir"] / "planted"
    planted.mkdir()
    for name in ("prefill.pte", "decode.pte"):
        data = (case["own"] / name).read_bytes()
        assert data.count(row) == 1, name
        (planted / name).write_bytes(data.replace(row, (np.frombuffer(row, np.float32) * 1.5).tobytes()))
    bad = case["dir"] / "planted.h5"
    res = invoke("replay", case["ref"], "--model", case["model"], "--pte", planted, "--max-seq", MAX_SEQ, "-o", bad)
    assert res.exit_code == 0, res.output
    first = diff_traces(case["ours"], bad).to_json()["first_divergence"]
    assert (first["step"], first["layer"], first["kind"]) == (0, 1, "layer_out"), first
