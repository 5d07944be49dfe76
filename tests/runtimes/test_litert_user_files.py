"""`trace replay REF --tflite PATH`: the user's own litert-torch export (a folder as export_hf writes
it, or a .litertlm bundle's TFLite sections) run per layer by the litert runtime's engine against
REF's checkpoint (replayer/runtimes/litert/user_files.py, user_runtime.py).

The fast tests hand-write what needs no real model (bytes that are no flatbuffer, FIFOs, folders and
links in place of files, a bundle header of hostile size); the slow ones export the embedded model
(the tool's own export, and litert-torch's command line run directly), replay it, and damage copies
of it: bad input is one line, exit 2, nothing written and the user's files untouched."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (pip install -e '.[litert]')")
pytest.importorskip("litert_torch", reason="litert-torch is not installed (pip install -e '.[litert]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes.litert import user_files as U  # noqa: E402
from gemma4_trace.replayer.runtimes.litert.spec import LITERT  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "hf" / "tiny_model"
FILES = ("model.tflite", "embedder.tflite", "per_layer_embedder.tflite")


def _state(d: Path) -> dict:
    """Every entry below `d` (or `d` itself, a file): its kind, mtime and (a regular file) sha256."""
    out = {}
    for p in sorted(d.rglob("*")) if d.is_dir() else [d]:
        st = p.lstat()
        regular = p.is_file() and not p.is_symlink()
        out[p.name] = (st.st_mode, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest() if regular else None)
    return out


def _refused(tmp_path, d: Path, *needles, extra=()):
    before, out = _state(d), tmp_path / "run.h5"
    line = one_line_error(invoke("replay", golden_path("short"), "--tflite", d, *extra, "-o", out), *needles, out=out)
    assert _state(d) == before  # the user's files are never modified
    return line


def _no_model_load(*a, **k):
    raise AssertionError("the model loaded before the files were refused")


@pytest.fixture
def fake(tmp_path):
    """A folder whose files are no .tflite at all (a header check refuses it before anything runs)."""
    d = tmp_path / "user"
    d.mkdir()
    for name in FILES:
        (d / name).write_bytes(b"\x00not a flatbuffer" * 8)
    return d


def _fifo(d):
    (d / "model.tflite").unlink()
    os.mkfifo(d / "model.tflite")


def _folder(d):
    (d / "model.tflite").unlink()
    (d / "model.tflite").mkdir()


def _dev_zero(d):
    (d / "model.tflite").unlink()
    (d / "model.tflite").symlink_to("/dev/zero")


def _tiny(d):
    (d / "model.tflite").write_bytes(b"TFL3")


FAST = {
    "not a flatbuffer": (lambda d: None, "model.tflite: not a LiteRT model"),
    "a FIFO for model.tflite": (_fifo, "not a regular file (a device, FIFO or socket)"),
    "a folder for model.tflite": (_folder, "not a regular file (a folder)"),
    "model.tflite a link to /dev/zero": (_dev_zero, "not a regular file (a device, FIFO or socket)"),
    "a 4-byte model.tflite": (_tiny, "model.tflite is 4 bytes"),
    "no model.tflite": (lambda d: (d / "model.tflite").unlink(), "not a litert-torch export folder (no model.tflite"),
}


@pytest.mark.parametrize("bad", FAST)
def test_bad_folders_are_one_line_before_the_model_loads(tmp_path, fake, monkeypatch, bad):
    how, words = FAST[bad]
    how(fake)
    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", _no_model_load)
    assert "--tflite" in _refused(tmp_path, fake, words)


def test_a_special_file_or_nothing_in_place_of_the_path_is_one_line(tmp_path):
    out = tmp_path / "run.h5"
    one_line_error(
        invoke("replay", golden_path("short"), "--tflite", tmp_path / "absent", "-o", out), "no such", out=out
    )
    os.mkfifo(tmp_path / "fifo")
    res = invoke("replay", golden_path("short"), "--tflite", tmp_path / "fifo", "-o", out)
    one_line_error(res, "not a regular file (a device, FIFO or socket)", out=out)
    (tmp_path / "x.bin").write_bytes(b"\0" * 64)
    res = invoke("replay", golden_path("short"), "--tflite", tmp_path / "x.bin", "-o", out)
    one_line_error(res, "neither a folder of litert-torch's .tflite files nor a .litertlm bundle", out=out)


@pytest.mark.parametrize("end", [1 << 62, 40, 31])
def test_a_bundle_header_of_hostile_size_is_one_line(tmp_path, end):
    bundle = tmp_path / "m.litertlm"
    bundle.write_bytes(U.MAGIC + struct.pack("<III", 1, 7, 0) + b"\0" * 4 + struct.pack("<Q", end) + b"\0" * 4)
    _refused(tmp_path, bundle, "claims a header ending at byte")


def test_the_files_are_run_by_the_litert_runtime_only(tmp_path, fake):
    out = tmp_path / "run.h5"
    res = invoke("replay", golden_path("short"), "--runtime", "onnx", "--tflite", fake, "-o", out)
    one_line_error(res, "is run by --runtime litert", out=out)


# ---------------------------------------------------------------- real exports (slow)
def _run(*args, cwd) -> None:
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tool's own export (`trace export --runtime litert`), litert-torch's command line run
    directly (prefill 8, cache 32: other lengths than the tool's 16 and 16), and their replays."""
    d = tmp_path_factory.mktemp("litert-user")
    res = invoke("export", "--runtime", "litert", "--max-seq", "16", "-o", d / "own")
    assert res.exit_code == 0, res.output
    (d / "cli").mkdir()
    flags = ["--prefill_lengths=8", "--cache_length=32", "--quantization_recipe=none", "--externalize_embedder=True"]
    flags.append("--keep_temporary_files=True")  # the .tflite files (else only model.litertlm stays)
    _run("-m", "litert_torch.generative.export_hf", TINY, d / "cli", *flags, cwd=d / "cli")
    out = {"ref": golden_path("short"), "dir": d}
    for name, args in {
        "litert": ("--runtime", "litert"),
        "own": ("--tflite", d / "own"),
        "cli": ("--tflite", d / "cli"),
        "bundle": ("--tflite", d / "cli" / "model.litertlm"),
    }.items():
        out[name] = d / f"{name}.h5"
        r = invoke("replay", out["ref"], *args, "-o", out[name])
        assert r.exit_code == 0, r.output
    return out


def _hash_as(path: Path, tmp: Path, runtime: str = "") -> str:
    """The trace's content hash with its provenance's runtime name set to `runtime`: the one field
    that must differ (it names the user's files and their sha256)."""
    import h5py

    shutil.copyfile(path, tmp)
    with h5py.File(tmp, "r+") as f:
        f.attrs["runtime"] = runtime
    with TraceReader(tmp) as r:
        return r.content_hash()


@pytest.mark.slow
def test_the_tools_own_export_replays_as_the_litert_runtime_does(exported, tmp_path):
    own = exported["own"]
    assert _hash_as(own, tmp_path / "a.h5") == _hash_as(exported["litert"], tmp_path / "b.h5")
    with TraceReader(own) as r:
        name = r.provenance["runtime"]
    assert name.startswith("litert-files own (") and "prefill 16, cache 16" in name, name
    assert "model.tflite sha256:" in name and str(exported["dir"]) not in name


@pytest.mark.slow
def test_litert_torchs_own_command_line_export_replays_with_every_kind_compared(exported, tmp_path):
    """A folder made by `python -m litert_torch.generative.export_hf` outside the tool: every text
    kind of the litert capture map is in the trace and compared; its bundle's sections replay the same."""
    j = diff_traces(exported["ref"], exported["cli"], full=True).to_json()
    mapped = {r.kind for r in LITERT.rows if S.KIND_BY_NAME[r.kind].tower == S.TEXT}
    compared = {t["kind"] for t in j["tensors"] if t["rows_compared"] == t["rows"] and t["rows"]}
    assert compared == mapped, (compared, mapped)
    assert j["tokens"]["matches"] == j["tokens"]["compared_steps"], j["tokens"]
    assert _hash_as(exported["cli"], tmp_path / "a.h5") == _hash_as(exported["bundle"], tmp_path / "b.h5")
    with TraceReader(exported["bundle"]) as r:
        name = r.provenance["runtime"]
    assert "model.litertlm sha256:" in name and "model.tflite (section 3) sha256:" in name, name


def _q_weight(buf: bytearray, layer: int, rows: int) -> int:
    """The byte offset of layer `layer`'s q_proj weight ((rows, hidden) float32) in model.tflite."""
    from ai_edge_litert import schema_py_generated as fb

    m = fb.Model.GetRootAsModel(buf, 0)
    for s in range(m.SubgraphsLength()):
        g = m.Subgraphs(s)
        for i in range(g.TensorsLength()):
            t = g.Tensors(i)
            name, b = t.Name().decode(), m.Buffers(t.Buffer())
            if f"DecoderLayer_{layer}/" in name and "Linear_q_proj" in name and t.ShapeAsNumpy()[0] == rows:
                if b.DataLength():  # the weight's bytes inside the flatbuffer (buffers are shared by the signatures)
                    return b._tab.Vector(b._tab.Offset(4))
    raise AssertionError("no q_proj weight")


@pytest.mark.slow
def test_a_planted_fault_is_localised_to_its_layer_and_kind(exported, tmp_path):
    bad = tmp_path / "fault"
    shutil.copytree(exported["dir"] / "cli", bad)
    buf = bytearray((bad / "model.tflite").read_bytes())
    at = _q_weight(buf, 3, 64) + 4 * (5 * 64 + 7)  # q_proj[5, 7] of layer 3 (4 heads of 16, hidden 64)
    buf[at : at + 4] = (np.frombuffer(buf[at : at + 4], np.float32) + 2.0).tobytes()
    (bad / "model.tflite").write_bytes(bytes(buf))
    run = tmp_path / "fault.h5"
    r = invoke("replay", exported["ref"], "--tflite", bad, "-o", run)
    assert r.exit_code == 0, r.output
    for against in (exported["cli"], exported["ref"]):
        first = diff_traces(against, run).to_json()["first_divergence"]
        assert (first["step"], first["layer"], first["kind"]) == (0, 3, "q"), first


def _flip(d: Path, at: int = 5) -> None:  # a bit of the TFL3 identifier
    p = d / "model.tflite"
    raw = bytearray(p.read_bytes())
    raw[at] ^= 0x04
    p.write_bytes(bytes(raw))


def _truncate(d: Path) -> None:
    p = d / "model.tflite"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _logits_shape(d: Path, vocab: int) -> None:
    """model.tflite as another model's would be: its decode logits `vocab` wide (the shape in place)."""
    from ai_edge_litert import schema_py_generated as fb

    p = d / "model.tflite"
    buf = bytearray(p.read_bytes())
    m = fb.Model.GetRootAsModel(buf, 0)
    for s in range(m.SignatureDefsLength()):
        sd = m.SignatureDefs(s)
        for o in range(sd.OutputsLength()):
            if sd.Outputs(o).Name() == b"logits":
                t = m.Subgraphs(sd.SubgraphIndex()).Tensors(sd.Outputs(o).TensorIndex())
                last = t._tab.Vector(t._tab.Offset(4)) + 4 * (t.ShapeLength() - 1)  # shape: the first field
                buf[last : last + 4] = struct.pack("<i", vocab)
    p.write_bytes(bytes(buf))


def _past_the_end(bundle: Path) -> None:
    """The bundle's last section made to end past the end of the file (its EndOffset in place)."""
    from litert_lm_builder import litertlm_header_schema_py_generated as H

    raw = bytearray(bundle.read_bytes())
    (end,) = struct.unpack("<Q", raw[24:32])
    objects = H.LiteRTLMMetaData.GetRootAs(raw[32:end], 0).SectionMetadata()
    o = objects.Objects(objects.ObjectsLength() - 1)
    field = 32 + o._tab.Pos + o._tab.Offset(8)  # EndOffset: the table's third field (vtable slot 8)
    assert struct.unpack("<Q", raw[field : field + 8])[0] == o.EndOffset()
    raw[field : field + 8] = struct.pack("<Q", len(raw) + 4096)
    bundle.write_bytes(bytes(raw))


REAL = {
    "a truncated model.tflite": (_truncate, "not a LiteRT model"),
    "a bit flipped in model.tflite": (_flip, "not a LiteRT model (no TFL3 identifier)"),
    "another model's vocabulary": (_logits_shape, "does not match REF's model config: vocabulary 681 (REF 680)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bad", REAL)
def test_damaged_exports_are_one_line(exported, tmp_path, bad):
    how, words = REAL[bad]
    d = tmp_path / "user"
    shutil.copytree(exported["dir"] / "cli", d)
    how(d, 681) if bad == "another model's vocabulary" else how(d)
    line = _refused(tmp_path, d, words)
    if "config" in words:
        assert "--allow-config-mismatch" in line


@pytest.mark.slow
def test_a_bundle_section_past_the_end_is_one_line(exported, tmp_path):
    bundle = tmp_path / "m.litertlm"
    shutil.copyfile(exported["dir"] / "cli" / "model.litertlm", bundle)
    _past_the_end(bundle)
    _refused(tmp_path, bundle, "past the end of the file")


@pytest.mark.slow
def test_a_cache_shorter_than_max_seq_is_one_line(exported, tmp_path):
    _refused(tmp_path, exported["dir"] / "own", "its K/V caches hold 16 positions", extra=("--max-seq", "24"))
