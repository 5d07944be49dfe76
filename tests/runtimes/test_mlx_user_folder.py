"""`trace replay REF --mlx-model DIR` (and `--mlx-model-dq DIR`, its baseline): the user's own mlx-lm
folder run by the mlx runtime's engine against REF's checkpoint (replayer/runtimes/mlx_folder.py).

The fast tests hand-write a folder (a fixed config.json and a small safetensors file) and check
that bad input is one line, exit 2, nothing written and the folder untouched; the slow ones convert
the embedded model (the tool's own mlx-q4 conversion, and mlx-lm's `convert` run directly) and
replay it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[mlx]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.runtimes import mlx_folder as F  # noqa: E402
from gemma4_trace.replayer.runtimes.mlx import fixed_config  # noqa: E402
from gemma4_trace.replayer.runtimes.mlx_spec import MLX  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "hf" / "tiny_model"
Q4 = {"group_size": 64, "bits": 4, "mode": "affine"}


def _config(**text) -> dict:
    cfg, _ = fixed_config(json.loads((TINY / "config.json").read_text()))
    cfg["text_config"].update(text)
    return {**cfg, "quantization": Q4, "quantization_config": Q4}


def _safetensors(path: Path, tensors: dict, header_size: int | None = None, cut: int = 0) -> None:
    table, data = {"__metadata__": {"format": "mlx"}}, b""
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        table[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(table).encode()
    blob = struct.pack("<Q", len(head) if header_size is None else header_size) + head + data
    path.write_bytes(blob[: len(blob) - cut])


@pytest.fixture
def folder(tmp_path):
    """A hand-written mlx-lm folder: its header passes the checks (its weights are not the model's)."""
    d = tmp_path / "user-q4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_config()))
    _safetensors(d / "model.safetensors", {"language_model.model.norm.weight": np.ones(64)})
    return d


def _state(d: Path) -> dict:
    """Every entry below `d`: its kind, mtime and (for a regular file) sha256."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
        out[p.name] = (st.st_mode, st.st_mtime_ns, digest)
    return out


def _refused(tmp_path, d: Path, *needles, opt="--mlx-model"):
    before, out = _state(d), tmp_path / "run.h5"
    line = one_line_error(invoke("replay", golden_path("short"), opt, d, "-o", out), *needles, out=out)
    assert _state(d) == before  # the user's folder is never modified
    return line


def _fifo(d):
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")


def _folder_as_weights(d):
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _special_config(d):
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("/dev/zero")


def _truncated(d):
    _safetensors(d / "model.safetensors", {"language_model.model.norm.weight": np.ones(64)}, cut=16)


def _huge_header(d):
    _safetensors(d / "model.safetensors", {"x": np.ones(4)}, header_size=1 << 62)


def _header_past_the_file(d):
    _safetensors(d / "model.safetensors", {"x": np.ones(4)}, header_size=10_000)


def _not_json(d):
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{[" + b"\0" * 16)


def _no_config(d):
    (d / "config.json").unlink()


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _another_model_type(d):
    (d / "config.json").write_text(json.dumps({**_config(), "model_type": "llama"}))


def _model_file(d):
    (d / "config.json").write_text(json.dumps({**_config(), "model_file": "evil.py"}))


def _bad_bits(d):
    (d / "config.json").write_text(json.dumps({**_config(), "quantization": {**Q4, "bits": 7}}))


def _index_names_a_missing_shard(d):
    (d / F.INDEX).write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))


BAD = {
    "no config.json": (_no_config, "not an mlx-lm folder (no config.json)"),
    "no weights": (_no_weights, "not an mlx-lm folder (no model*.safetensors)"),
    "a FIFO for the weights": (_fifo, "not a regular file (a device, FIFO or socket)"),
    "a folder for the weights": (_folder_as_weights, "not a regular file (a folder)"),
    "config.json a link to /dev/zero": (_special_config, "not a regular file (a device, FIFO or socket)"),
    "a truncated safetensors": (_truncated, "lies outside the file's"),
    "a header size of 2**62": (_huge_header, "claims a 4611686018427387904-byte header"),
    "a header size past the file": (_header_past_the_file, "claims a 10000-byte header"),
    "a header that is not JSON": (_not_json, "header is not readable JSON"),
    "another model type": (_another_model_type, "model_type is 'llama', not a Gemma 4 model"),
    "a model_file to run": (_model_file, "names a model_file"),
    "7-bit quantization": (_bad_bits, "quantization bits is 7"),
    "an index naming a missing shard": (_index_names_a_missing_shard, "names model-00002-of-00002.safetensors"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_folders_are_one_line_before_the_model_loads(tmp_path, folder, monkeypatch, bad):
    how, words = BAD[bad]
    how(folder)
    monkeypatch.setattr("gemma4_trace.replayer.replay.load_for_reference", _no_model_load)
    assert "--mlx-model" in _refused(tmp_path, folder, words)


def _no_model_load(*a, **k):
    raise AssertionError("the model loaded before the folder was refused")


def test_a_file_or_nothing_in_place_of_the_folder_is_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    out = tmp_path / "run.h5"
    res = invoke("replay", golden_path("short"), "--mlx-model", tmp_path / "model.safetensors", "-o", out)
    one_line_error(res, "not a folder", out=out)
    res = invoke("replay", golden_path("short"), "--mlx-model", tmp_path / "absent", "-o", out)
    one_line_error(res, "no such folder", out=out)


def test_a_config_for_another_model_is_one_line_naming_the_field(tmp_path, folder):
    cfg = _config()
    text = cfg["text_config"]  # a 4-layer model of the same widths, consistent in itself
    text.update(num_hidden_layers=4, layer_types=text["layer_types"][:4], num_kv_shared_layers=1)
    text["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items() if int(k) < 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    line = _refused(tmp_path, folder, "does not match REF's model config: num_hidden_layers 4 (REF 8)")
    assert "--allow-config-mismatch" in line


def test_the_dq_baseline_of_a_float_folder_is_one_line(tmp_path, folder):
    cfg = _config()
    del cfg["quantization"], cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(tmp_path, folder, "holds no quantized weights", opt="--mlx-model-dq")


def test_a_folder_is_run_by_the_mlx_runtime_only(tmp_path, folder):
    out = tmp_path / "run.h5"
    res = invoke("replay", golden_path("short"), "--runtime", "onnx", "--mlx-model", folder, "-o", out)
    one_line_error(res, "is run by --runtime mlx", out=out)
    res = invoke("replay", golden_path("short"), "--mlx-model", folder, "--gguf", folder / "x.gguf", "-o", out)
    one_line_error(res, "give one", out=out)


def test_the_header_names_quantization_and_hashes_every_file_read(folder):
    q = {**Q4, "language_model.model.layers.0.mlp.down_proj": False}
    (folder / "config.json").write_text(json.dumps({**_config(), "quantization": q}))
    f = F.read_folder(folder)
    assert f.quant_text() == "4-bit affine, group size 64, 1 modules kept float"
    assert sorted(f.files) == ["config.json", "model.safetensors"]
    assert f.files["model.safetensors"] == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert str(folder) not in f.files_text()  # names and sha256, never the path


# ---------------------------------------------------------------- converted folders (slow)
CONVERT_OWN = "import sys; from gemma4_trace.replayer.runtimes.mlx_folder import save_conversion as s; s(*sys.argv[1:])"


def _convert(*args) -> None:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tool's own mlx-q4 conversion saved as a folder (mlx_folder.save_conversion), mlx-lm's
    `convert -q` run directly on the checkpoint (its config fixed first, as mlx-lm 0.32.2 needs),
    each replayed, and the runtime's own mlx-q4 replay."""
    d = tmp_path_factory.mktemp("mlx-folder")
    ref = golden_path("window")
    _convert("-c", CONVERT_OWN.replace("s(*sys.argv[1:])", "s(sys.argv[1], 4, sys.argv[2])"), TINY, d / "own-q4")
    fixed = d / "fixed-hf"
    shutil.copytree(TINY, fixed)
    cfg, _ = fixed_config(json.loads((TINY / "config.json").read_text()))
    (fixed / "config.json").write_text(json.dumps(cfg))
    _convert("-m", "mlx_lm", "convert", "--hf-path", fixed, "--mlx-path", d / "mlx-lm-q4", "-q", "--q-bits", "4")
    out = {"ref": ref, "dir": d}
    for name, args in {
        "mlx-q4": ("--runtime", "mlx-q4"),
        "own": ("--mlx-model", d / "own-q4"),
        "direct": ("--mlx-model", d / "mlx-lm-q4"),
        "direct-dq": ("--mlx-model-dq", d / "mlx-lm-q4"),
    }.items():
        out[name] = d / f"{name}.h5"
        r = invoke("replay", ref, *args, "-o", out[name])
        assert r.exit_code == 0, r.output
    return out


def _hash_as(path: Path, tmp: Path, runtime: str = "") -> str:
    """The trace's content hash with its provenance's runtime name set to `runtime`: the one field
    that must differ (it names the user's folder and its files)."""
    import h5py

    shutil.copyfile(path, tmp)
    with h5py.File(tmp, "r+") as f:
        f.attrs["runtime"] = runtime
    with TraceReader(tmp) as r:
        return r.content_hash()


@pytest.mark.slow
def test_the_tools_own_q4_folder_replays_as_mlx_q4_does(converted, tmp_path):
    own, q4 = converted["own"], converted["mlx-q4"]
    assert _hash_as(own, tmp_path / "a.h5") == _hash_as(q4, tmp_path / "b.h5")
    with TraceReader(own) as r:
        name = r.provenance["runtime"]
    assert name.startswith("mlx-folder own-q4 (mlx ") and "4-bit affine, group size 64" in name, name
    assert "model.safetensors sha256:" in name and str(converted["dir"]) not in name


@pytest.mark.slow
def test_mlx_lms_own_convert_replays_with_every_kind_compared(converted):
    """A folder made by `python -m mlx_lm convert -q` outside the tool: every text kind the mlx
    runtime's capture map names is in the trace and compared, within its -dq baseline."""
    ref, run, base = converted["ref"], converted["direct"], converted["direct-dq"]
    res = diff_traces(ref, run, baseline_path=base, full=True)
    j = res.to_json()
    assert res.match, j["first_divergence"]
    mapped = {r.kind for r in MLX.rows if S.KIND_BY_NAME[r.kind].tower == S.TEXT}
    compared = {t["kind"] for t in j["tensors"] if t["status"] == "ok" and t["rows_compared"] == t["rows"]}
    assert compared == mapped, (compared, mapped)
    assert j["tokens"]["matches"] == j["tokens"]["compared_steps"] == 24, j["tokens"]


@pytest.mark.slow
def test_a_planted_fault_is_localised_to_its_layer_and_kind(converted, tmp_path):
    import mlx.core as mx

    bad = tmp_path / "fault"
    shutil.copytree(converted["dir"] / "mlx-lm-q4", bad)
    weights = dict(mx.load(str(bad / "model.safetensors")))
    key = "language_model.model.layers.3.self_attn.q_proj.scales"
    weights[key] = weights[key] * 1.5
    mx.save_safetensors(str(bad / "model.safetensors"), weights, metadata={"format": "mlx"})
    run = tmp_path / "fault.h5"
    r = invoke("replay", converted["ref"], "--mlx-model", bad, "-o", run)
    assert r.exit_code == 0, r.output
    for against in (converted["direct"], converted["ref"]):
        baseline = converted["direct-dq"] if against == converted["ref"] else None
        first = diff_traces(against, run, baseline_path=baseline).to_json()["first_divergence"]
        assert (first["step"], first["layer"], first["kind"]) == (0, 3, "q"), first
