"""`--runtime onnx` (the static runtime's steps exported to ONNX, run by onnxruntime on CPU) and
`trace export-onnx` (extra gemma4-trace[onnx])."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install -e '.[onnx]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import float_differences, invoke, one_line_error  # noqa: E402

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it


def test_onnx_matches_reference_with_kernel_sized_differences(tmp_path):
    ref, run, static = golden_path("short"), tmp_path / "onnx.h5", tmp_path / "static.h5"
    assert "3/3 tokens agree" in replay_trace(ref, run, runtime="onnx")
    replay_trace(ref, static)
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    with TraceReader(static) as a, TraceReader(run) as b:
        assert b.provenance["runtime"].startswith("onnx (onnxruntime 1.32.0")
        worst, differ = float_differences(a, b)
        # onnxruntime's kernels are not torch's: real, float32-sized differences
        assert differ >= 10 and 1e-8 < worst < 1e-5, (differ, worst)


def test_image_prompt_matches_reference_through_the_vision_graph(tmp_path):
    # two images, one padded: the vision tower runs as vision.onnx, every vision site an output
    ref, run = golden_path("two_images"), tmp_path / "onnx.h5"
    assert "8/8 tokens agree" in replay_trace(ref, run, runtime="onnx")
    res = diff_traces(ref, run)
    assert res.match, res.to_json()["first_divergence"]
    vision = {k.key for k in S.TOWER_BY_NAME["vision"].kinds}
    assert vision <= {t.kind for t in res.tensors}  # compared, none only in REF
    assert not [s for s in res.skipped if s.kind in vision]


def test_export_onnx_writes_checked_graphs(tmp_path):
    import onnx

    out = tmp_path / "graphs"
    res = invoke("export-onnx", "--max-seq", "16", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "prefill.onnx" in res.output and "decode.onnx" in res.output
    for name, first in (
        ("prefill", ["ids", "ple_ids", "mm_embeds", "mm_slots", "block_ids", "n_valid"]),
        ("decode", ["token", "input_pos"]),
    ):
        m = onnx.load(str(out / f"{name}.onnx"))
        onnx.checker.check_model(m)
        inputs = [i.name for i in m.graph.input]
        outputs = [o.name for o in m.graph.output]
        assert inputs[: len(first)] == first and inputs[len(first)] == "L00.k_cache"
        assert outputs[0] == "logits" and "L00.k_cache_out" in outputs
        assert {"embeddings", "L00.mask", "L03.q", "L04.v", "L07.attn_out", "final_hidden"} <= set(outputs)
        assert "L05.k" not in outputs  # layer 5 reuses layer 3's K/V and writes none
    before = (out / "decode.onnx").stat().st_mtime_ns
    res = invoke("export-onnx", "--max-seq", "16", "-o", str(out))
    one_line_error(res, "already exists; pass --force")
    assert (out / "decode.onnx").stat().st_mtime_ns == before


def _no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the output paths were checked")

    monkeypatch.setattr("gemma4_trace.hf.model.load_model", refuse)


@pytest.mark.parametrize("case", ["device", "under-a-file", "graph-is-a-folder", "graph-is-a-folder-force"])
def test_export_onnx_checks_outputs_before_loading(tmp_path, monkeypatch, case):
    _no_model_load(monkeypatch)
    out, extra, words = tmp_path / "graphs", [], ["graphs"]
    if case == "device":
        out, words = "/dev/full", ["/dev/full exists and is not a folder"]
    elif case == "under-a-file":
        (tmp_path / "file").write_text("x")
        out, words = tmp_path / "file" / "graphs", ["cannot make output folder"]
    else:
        (out / "prefill.onnx").mkdir(parents=True)
        extra, words = (
            (["--force"] if case.endswith("force") else []),
            ["prefill.onnx exists and is not a regular file"],
        )
    res = invoke("export-onnx", "--max-seq", "16", "-o", out, *extra)
    one_line_error(res, *words)
    if case.startswith("graph"):
        assert sorted(p.name for p in out.iterdir()) == ["prefill.onnx"]  # no decode.onnx without its prefill


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_export_onnx_refuses_a_read_only_folder(tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        res = invoke("export-onnx", "--max-seq", "16", "-o", out)
    finally:
        out.chmod(0o755)
    one_line_error(res, "not writable")


def test_export_onnx_places_both_graphs_or_neither(tmp_path, monkeypatch):
    """A graph that cannot be put in place (here a folder appears at prefill.onnx after the
    checks) leaves the previous decode.onnx, not a new decode.onnx without its prefill graph."""
    import types

    from gemma4_trace.replayer.runtimes import onnx as onnx_runtime

    out = tmp_path / "graphs"
    out.mkdir()
    (out / "decode.onnx").write_bytes(b"old decode")

    from gemma4_trace.replayer.artifacts import Artifact

    def exported(loaded, max_seq):  # fake graphs in a temporary artifact (never in the cache)
        folder = tmp_path / "artifact"
        folder.mkdir()
        for g in ("prefill", "decode"):
            (folder / f"{g}.onnx").write_bytes(b"new " + g.encode())
        (out / "prefill.onnx").mkdir()  # after the checks, before the graphs are placed
        return Artifact(folder, "built in 0.0 s, not cached", temporary=True)

    monkeypatch.setattr("gemma4_trace.hf.model.load_model", lambda *a, **k: types.SimpleNamespace(name="tiny"))
    monkeypatch.setattr(onnx_runtime, "exported", exported)
    res = invoke("export-onnx", "--max-seq", "16", "-o", out, "--force")
    one_line_error(res, "prefill.onnx", "no .onnx file was changed")
    assert (out / "decode.onnx").read_bytes() == b"old decode"
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "prefill.onnx"]  # no partial folder left
    assert not (tmp_path / "artifact").exists()  # the temporary artifact was removed


# ---- the artifact cache (replayer/artifacts.py) --------------------------------------------


@pytest.fixture(scope="module")
def cached_replays(tmp_path_factory):
    """Two replays of the short golden into one fresh --cache-dir, then export-onnx from it."""
    from gemma4_trace.replayer import artifacts

    tmp = tmp_path_factory.mktemp("onnx-cache")
    cache = tmp / "cache"
    runs = [
        invoke("replay", golden_path("short"), "--runtime", "onnx", "--cache-dir", cache, "-o", tmp / f"run{i}.h5")
        for i in range(2)
    ]
    entries = sorted((cache / "onnx").iterdir())
    mtimes = {p.name: p.stat().st_mtime_ns for p in entries[0].iterdir()} if entries else {}
    export = invoke("export-onnx", "--max-seq", "16", "--cache-dir", cache, "-o", tmp / "graphs")
    artifacts.configure()
    return tmp, cache, runs, entries, mtimes, export


def test_second_replay_runs_the_cached_graphs(cached_replays):
    tmp, cache, runs, entries, mtimes, _ = cached_replays
    assert [r.exit_code for r in runs] == [0, 0], [r.output for r in runs]
    said = [r.stderr.count("exporting ONNX (prefill and decode, max_seq 16)") for r in runs]
    assert said == [1, 0]  # exported once, with one line saying so; the second replay exported nothing
    assert len(entries) == 1 and sorted(mtimes) == ["decode.onnx", "manifest.json", "prefill.onnx"]
    assert {p.name: p.stat().st_mtime_ns for p in entries[0].iterdir()} == mtimes
    res = diff_traces(tmp / "run0.h5", tmp / "run1.h5")
    assert res.match
    with TraceReader(tmp / "run0.h5") as a, TraceReader(tmp / "run1.h5") as b:
        for kind, layer in a.kinds_present():
            assert np.array_equal(a.read(kind, layer), b.read(kind, layer)), (kind, layer)


def test_export_onnx_copies_the_cached_graphs(cached_replays):
    tmp, cache, _, entries, mtimes, export = cached_replays
    assert export.exit_code == 0, export.output
    assert "from the artifact cache" in export.output and "exporting ONNX" not in export.stderr
    for g in ("prefill.onnx", "decode.onnx"):
        assert (tmp / "graphs" / g).read_bytes() == (entries[0] / g).read_bytes()
    assert sorted(p.name for p in (tmp / "graphs").iterdir()) == ["decode.onnx", "prefill.onnx"]  # no manifest


def test_a_tampered_cached_graph_is_exported_again(cached_replays, tmp_path, monkeypatch):
    """A cached graph that was changed is never run: the replay says so and exports again (the
    export here copies the good graphs, as a real one writes them: the export is deterministic,
    and the first replay ran a real one)."""
    import shutil

    from gemma4_trace.replayer.runtimes import onnx as onnx_runtime

    _, cache, _, entries, _, _ = cached_replays
    exports = []

    def export(loaded, max_seq, folder):
        exports.append(max_seq)
        for g in ("prefill.onnx", "decode.onnx"):
            shutil.copyfile(entries[0] / g, folder / g)

    monkeypatch.setattr(onnx_runtime, "export_onnx", export)
    mine = tmp_path / "cache"
    shutil.copytree(cache, mine)
    graph = mine / "onnx" / entries[0].name / "decode.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 1
    graph.write_bytes(bytes(data))
    res = invoke("replay", golden_path("short"), "--runtime", "onnx", "--cache-dir", mine, "-o", tmp_path / "r.h5")
    assert res.exit_code == 0, res.output
    assert "the cached copy was stale: decode.onnx fails its hash check" in res.stderr and exports == [16]
    assert graph.read_bytes() == (entries[0] / "decode.onnx").read_bytes()  # the entry holds a good graph again
    assert diff_traces(golden_path("short"), tmp_path / "r.h5").match
