"""A GGUF file is untrusted input (extra gemma4-trace[llamacpp]): `trace replay REF --gguf FILE`
(llama.cpp on the file, its metadata checked against REF's config first), `--runtime static
--weights-from FILE.gguf` (the static runtime on the file's dequantized weights, the baseline of a
three-way diff), and the bounded header reader that refuses malformed files in one line: a file
that is no regular file is never read, metadata is bounded before it is parsed, bytes past the last
tensor and weights of integer types are refused before any engine starts, and the file run is the
file checked."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from gemma4_trace.diff import diff_traces
from gemma4_trace.diff.tolerances import resolve_tolerances
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.replayer.runtimes.llamacpp import gguf_writer as GW
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error

REF = golden_path("short")
PROFILE = str(resolve_tolerances("llamacpp-f32"))
KINDS = ("embeddings", "per_layer_inputs", "q", "k", "v", "attn_out", "layer_out", "final_hidden", "logits")


# ---------------------------------------------------------------- special files, tails, bounded metadata, weight types
@pytest.mark.parametrize("option", [["--runtime", "llama.cpp", "--gguf"], ["--weights-from"]])
@pytest.mark.parametrize("special", ["fifo", "folder", "/dev/zero"])
def test_a_gguf_input_that_is_no_regular_file_is_one_line_without_reading(tmp_path, option, special):
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    if option[-1] == "--gguf":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = {"fifo": tmp_path / "fifo", "folder": tmp_path, "/dev/zero": "/dev/zero"}[special]
    if special == "fifo":
        os.mkfifo(path)  # a plain open would wait for a writer forever
    out = tmp_path / "o.h5"
    r = invoke("replay", REF, *option, path, "-o", out)
    kind = "a folder" if special == "folder" else "a device, FIFO or socket"
    one_line_error(r, "GGUF file", f"not a regular file ({kind})", out=out)


def test_a_gguf_with_a_tail_after_its_last_tensor_is_refused(tmp_path):
    """llama.cpp maps the whole file: bytes past the last tensor's data (a sparse 1 TiB tail made
    the child touch 22 GB) are refused in the header check, before any engine starts."""
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    g = tmp_path / "m.gguf"
    assert invoke("export-gguf", "-o", g).exit_code == 0
    out = tmp_path / "o.h5"
    assert invoke("replay", REF, "--weights-from", g, "-o", out).exit_code == 0  # the file as written: fine
    with open(g, "ab") as f:
        f.truncate(g.stat().st_size + (1 << 30))  # a sparse GiB after the data
    r = invoke("replay", REF, "--weights-from", g, "-o", tmp_path / "o2.h5")
    one_line_error(r, "bytes after its last tensor's data", out=tmp_path / "o2.h5")


def _gguf_with_one_key(path, key: bytes, vtype: int, payload: bytes) -> None:
    import struct

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype)
    path.write_bytes(head + payload)


def test_gguf_metadata_is_bounded_before_it_is_parsed(tmp_path):
    """An array of 2^24 empty strings took 76 s to parse; a 64 MiB architecture name made a 67 MB
    error line."""
    import struct

    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    from gemma4_trace.replayer.runtimes.llamacpp import gguf_reader as R

    g = tmp_path / "a.gguf"
    _gguf_with_one_key(g, b"x", 9, struct.pack("<IQ", 8, (1 << 24)) + bytes(64))  # ARRAY of STRING
    r = invoke("replay", REF, "--weights-from", g, "-o", tmp_path / "o.h5")
    one_line_error(r, f"claims {1 << 24} items (at most {R.MAX_ARRAY})")
    name = b"general.architecture"
    big = b"q" * (1 << 20)
    _gguf_with_one_key(g, name, 8, struct.pack("<Q", len(big)) + big)  # STRING
    r = invoke("replay", REF, "--weights-from", g, "-o", tmp_path / "o.h5")
    line = one_line_error(r, "architecture 'qqqq")
    assert len(line) < 600, len(line)


def _retype_tensor(path, name: bytes, ggml_type: int) -> None:
    """Rewrite one tensor's type field in a GGUF header (name, n_dims, dims, then the type)."""
    import struct

    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("ggml_type,name", [(24, "I8"), (25, "I16"), (26, "I32")])  # F64 overlaps: refused before
def test_a_weight_of_an_integer_or_double_type_is_refused_even_when_mismatches_are_allowed(tmp_path, ggml_type, name):
    """Such weights crashed llama.cpp's child; they are no config mismatch to allow."""
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    g = tmp_path / "m.gguf"
    assert invoke("export-gguf", "-o", g).exit_code == 0
    _retype_tensor(g, b"blk.0.attn_q.weight", ggml_type)
    for more in ((), ("--allow-config-mismatch",)):
        out = tmp_path / "o.h5"
        r = invoke("replay", REF, "--weights-from", g, *more, "-o", out)
        one_line_error(r, f"tensor 'blk.0.attn_q.weight' has type {name}", out=out)


# ---------------------------------------------------------------- a user's GGUF through --gguf and --weights-from
@pytest.fixture(scope="module")
def llamacpp_installed():
    """These tests need gguf and llama-cpp-python: skipped, with the extra to install, without them."""
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")


needs_llamacpp = pytest.mark.usefixtures("llamacpp_installed")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, llamacpp_installed):
    """`trace export-gguf` of the embedded tiny model: F32 and Q8_0."""
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for t in ("F32", "Q8_0"):
        out[t] = d / f"tiny-{t.lower()}.gguf"
        res = invoke("export-gguf", "--type", t, "-o", out[t])
        assert res.exit_code == 0, res.output
    return out


def _tensors(path):
    with TraceReader(path) as r:
        return {(k, layer): r.read(k, layer) for k, layer in r.kinds_present() if k in KINDS}


@pytest.mark.slow
@needs_llamacpp
def test_exported_file_replays_like_the_runtime(tmp_path, exported):
    """--gguf of the file `trace export-gguf` wrote: the same tensors as --runtime llama.cpp (the
    same file, the same kernels), and a match under the llama.cpp profile."""
    ref, run, own = golden_path("short"), tmp_path / "user.h5", tmp_path / "own.h5"
    res = invoke("replay", ref, "--gguf", exported["F32"], "-o", run)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"wrote {run}: llama.cpp:tiny-f32.gguf (F32) (llama-cpp-python 0.3.36, CPU) runtime")
    assert "3/3 tokens agree" in res.stdout
    replay_trace(ref, own, runtime="llama.cpp")
    a, b = _tensors(run), _tensors(own)
    assert a.keys() == b.keys() and len(a) > 30
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    assert diff_traces(ref, run, PROFILE).match


@pytest.mark.slow
@needs_llamacpp
def test_mismatched_metadata_is_refused_in_one_line_and_allowed_on_request(tmp_path):
    from gemma4_trace.hf.model import load_model

    path = tmp_path / "edited.gguf"
    GW.write_f32(
        load_model(None),
        path,
        metadata={"gemma4.attention.sliding_window": 9, "gemma4.final_logit_softcapping": 15.0},
    )
    ref, run = golden_path("short"), tmp_path / "run.h5"
    res = invoke("replay", ref, "--gguf", path, "-o", run)
    assert one_line_error(res, out=run) == (
        f"error: {path} does not match REF's model config: sliding window 9 (REF 8); final logit softcap 15 "
        "(REF 30) (--allow-config-mismatch replays it anyway)"
    )
    res = invoke("replay", ref, "--gguf", path, "--allow-config-mismatch", "-o", run)
    assert res.exit_code == 0, res.output
    note = "config differs from REF: sliding window 9 (REF 8), final logit softcap 15 (REF 30)"
    assert note in res.stdout
    with TraceReader(run) as r:
        assert note in r.provenance["runtime"]
    # the allowed differences act: the window of 9 first shows at layer 0's attention mask, position 8
    first = diff_traces(ref, run, PROFILE).to_json()["first_divergence"]
    assert (first["layer"], first["kind"], first["position"]) == (0, "mask", 8), first


@pytest.mark.slow
@needs_llamacpp
def test_gguf_of_another_model_is_refused_naming_the_differences(tmp_path):
    from tests.support import tiny_models

    model = tiny_models.build(tmp_path / "model", num_kv_shared_layers=2)
    path = tmp_path / "other.gguf"
    assert invoke("export-gguf", "--model", model, "-o", path).exit_code == 0
    run = tmp_path / "run.h5"
    line = one_line_error(invoke("replay", golden_path("short"), "--gguf", path, "-o", run), out=run)
    assert line.startswith(
        f"error: {path} does not match REF's model config: layers 7 (REF 8); hidden width 32 (REF 64);"
    )
    for words in (
        "sliding window 4 (REF 8)",
        "KV-shared layers 2 (REF 3)",
        "per-layer-input width 4 (REF",
        "vocab 128",
    ):
        assert words in line, (words, line)
    # the same check guards --weights-from
    res = invoke("replay", golden_path("short"), "--weights-from", path, "-o", run)
    assert one_line_error(res, out=run).startswith(f"error: {path} does not match REF's model config: layers 7")
    # allowed, the static runtime still needs every weight of REF's model, each of its shape
    res = invoke("replay", golden_path("short"), "--weights-from", path, "--allow-config-mismatch", "-o", run)
    assert one_line_error(res, out=run).startswith(f"error: {path} does not fit REF's model: it lacks blk.7."), res


def _edit(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    b[at : at + struct.calcsize(fmt)] = struct.pack("<" + fmt, value)
    return bytes(b)


def _after(data: bytes, name: bytes) -> int:
    """The byte after a key's or tensor's name in the header."""
    i = data.index(struct.pack("<Q", len(name)) + name)
    return i + 8 + len(name)


LIES = {
    "empty": lambda d: b"",
    "not GGUF": lambda d: b"GGML" + d[4:],
    "truncated in the header": lambda d: d[:200],
    "truncated in the data": lambda d: d[: len(d) - 1000],
    "tensor count 2^62": lambda d: _edit(d, 8, "Q", 1 << 62),
    "key count 2^40": lambda d: _edit(d, 16, "Q", 1 << 40),
    "first key's name 2^62 bytes": lambda d: _edit(d, 24, "Q", 1 << 62),
    "array of 2^61 items": lambda d: _edit(d, _after(d, b"gemma4.attention.sliding_window_pattern") + 8, "Q", 1 << 61),
    "tensor dim 2^40": lambda d: _edit(d, _after(d, b"token_embd.weight") + 4, "Q", 1 << 40),
    "tensor offset 2^60": lambda d: _edit(d, _after(d, b"token_embd.weight") + 4 + 16 + 4, "Q", 1 << 60),
    "tensor of unknown type": lambda d: _edit(d, _after(d, b"token_embd.weight") + 4 + 16, "I", 999),
}


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("lie", LIES)
@pytest.mark.parametrize("option", ["--gguf", "--weights-from"])
def test_malformed_gguf_is_refused_in_one_line(tmp_path, exported, lie, option):
    path = tmp_path / "bad.gguf"
    path.write_bytes(LIES[lie](exported["F32"].read_bytes()))
    run = tmp_path / "run.h5"
    line = one_line_error(invoke("replay", golden_path("short"), option, path, "-o", run), out=run)
    assert line.startswith(f"error: {path}: not a valid GGUF file: "), line


@pytest.mark.slow
@needs_llamacpp
def test_weights_from_an_f32_export_reproduces_the_static_runtime(tmp_path, exported):
    ref, plain, loaded = golden_path("short"), tmp_path / "static.h5", tmp_path / "from-f32.h5"
    replay_trace(ref, plain)
    summary = replay_trace(ref, loaded, weights_from=exported["F32"])
    assert "static (weights from tiny-f32.gguf, F32, dequantized) runtime" in summary
    a, b = _tensors(plain), _tensors(loaded)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-6, atol=1e-6, err_msg=str(key))
    assert diff_traces(plain, loaded).match


@pytest.mark.slow
@needs_llamacpp
def test_q8_0_three_way_diff_is_a_match(tmp_path, exported):
    """REF (HF float32), RUN (llama.cpp on the Q8_0 file), BASE (the static runtime on the same
    file's dequantized weights): llama.cpp's kernels add nothing beyond its weights' rounding."""
    ref, run, base = golden_path("short"), tmp_path / "q8.h5", tmp_path / "base.h5"
    assert invoke("replay", ref, "--gguf", exported["Q8_0"], "-o", run).exit_code == 0
    summary = replay_trace(ref, base, weights_from=exported["Q8_0"])
    assert "weights from tiny-q8_0.gguf, Q8_0, dequantized" in summary
    # both really differ from REF: the rounded weights (BASE leaves the float32 tolerance at once)
    assert not diff_traces(ref, base).match
    assert not diff_traces(ref, run, PROFILE).match
    res = diff_traces(ref, run, PROFILE, baseline_path=base)
    assert res.match, res.to_json()["first_divergence"]
    # and BASE is no stand-in for any run: the F32 static runtime is no envelope for Q8_0
    static = tmp_path / "static.h5"
    replay_trace(ref, static)
    assert not diff_traces(ref, run, PROFILE, baseline_path=static).match


@pytest.mark.slow
@needs_llamacpp
def test_weights_from_needs_the_static_runtime(tmp_path, exported):
    run = tmp_path / "r.h5"
    res = invoke("replay", golden_path("short"), "--runtime", "llama.cpp", "--weights-from", exported["F32"], "-o", run)
    one_line_error(res, "--weights-from FILE is run by --runtime static; it takes no --runtime llama.cpp", out=run)
    res = invoke(
        "replay", golden_path("short"), "--gguf", exported["F32"], "--weights-from", exported["F32"], "-o", run
    )
    one_line_error(res, "give one", out=run)


@pytest.mark.slow
@needs_llamacpp
def test_the_file_run_is_the_file_checked(tmp_path, exported, monkeypatch):
    """The header is read once, from a descriptor that llama.cpp then reads too: a file swapped in
    under the checked one's name after the check does not run; one rewritten in place is refused."""
    import os
    import shutil

    from gemma4_trace.replayer.runtimes.llamacpp import gguf_reader as GR

    user, other = tmp_path / "user.gguf", tmp_path / "other.gguf"
    shutil.copyfile(exported["F32"], user)
    shutil.copyfile(exported["Q8_0"], other)
    real = GR.read_header

    def swap_after_check(path):
        header = real(path)
        os.replace(other, user)  # the name now holds the Q8_0 file
        return header

    monkeypatch.setattr(GR, "read_header", swap_after_check)
    ref, run, own = golden_path("short"), tmp_path / "run.h5", tmp_path / "own.h5"
    res = invoke("replay", ref, "--gguf", user, "-o", run)
    assert res.exit_code == 0, res.output
    replay_trace(ref, own, runtime="llama.cpp")
    a, b = _tensors(run), _tensors(own)
    assert all(np.array_equal(a[k], b[k]) for k in b)  # the F32 file ran, not the Q8_0 swapped in

    def rewrite_after_check(path):
        header = real(path)
        with open(path, "ab") as fh:
            fh.write(b"\0" * 64)
        return header

    shutil.copyfile(exported["F32"], user)
    monkeypatch.setattr(GR, "read_header", rewrite_after_check)
    res = invoke("replay", ref, "--gguf", user, "-o", tmp_path / "no.h5")
    line = one_line_error(res, out=tmp_path / "no.h5")
    assert line == f"error: {user}: the file changed after its header was checked"
