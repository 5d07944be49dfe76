"""`trace import`: dumps of the static runtime (tests/support/dump_fixture.py, one layout per kind)
import to a trace equal to a direct replay; a planted bug is localised exactly; bad maps
and files are one line, exit 2, naming the file."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from gemma4_trace.diff import diff_traces
from gemma4_trace.importer import import_dump
from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error, site_of

GOLDEN = golden_path("short")  # 13 prompt tokens, 3 steps


def _dump(folder, bug=None):
    """Replay GOLDEN through the dumping runtime: the direct replay and the dump of one run."""
    old = {k: os.environ.get(k) for k in ("GEMMA4_TRACE_DUMP_DIR", "GEMMA4_TRACE_DUMP_BUG")}
    os.environ["GEMMA4_TRACE_DUMP_DIR"] = str(folder / "dump")
    if bug:
        os.environ["GEMMA4_TRACE_DUMP_BUG"] = bug
    try:
        replay_trace(GOLDEN, folder / "tee.h5", runtime="tests.support.dump_fixture:make_dumper")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return folder / "dump"


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    d = tmp_path_factory.mktemp("import")
    dump = _dump(d)
    replay_trace(GOLDEN, d / "static.h5")
    return dump, d / "static.h5"


@pytest.fixture
def dump(dumped, tmp_path):
    """A private copy of the dump, free to break."""
    return shutil.copytree(dumped[0], tmp_path / "dump")


def _import(dump, tmp_path, map_text=None, **kw):
    m = dump / "map.toml"
    if map_text is not None:
        m = tmp_path / "map.toml"
        m.write_text(map_text)
    return invoke(
        "import", str(dump), "--reference", str(GOLDEN), "--map", str(m), "-o", str(tmp_path / "imp.h5"), **kw
    )


def test_round_trip_equals_direct_replay(dumped, tmp_path):
    dump, static = dumped
    out = tmp_path / "imp.h5"
    summary = import_dump(dump, GOLDEN, dump / "map.toml", out)
    assert "tokens from argmax of the dumped logits, 3/3 agree" in summary
    with TraceReader(static) as a, TraceReader(out) as b:
        assert b.provenance["runtime"] == "static-dump" and b.mode == "teacher-forced"
        assert b.kinds_present() == a.kinds_present()  # every kind of the replay, nothing else
        assert len(a.kinds_present()) == 51
        for kind, layer in a.kinds_present():
            x, y = a.read(kind, layer), b.read(kind, layer)
            assert x.dtype == y.dtype and np.array_equal(x, y), (kind, layer)
            assert a.source_dtype(kind, layer) == b.source_dtype(kind, layer)
        assert a.step_positions == b.step_positions and list(a.tokens()) == list(b.tokens())
    assert diff_traces(static, out).match
    assert diff_traces(GOLDEN, out).match


def test_planted_bug_is_localised(tmp_path):
    dump = _dump(tmp_path, bug="1:2")  # layer 1's v rows written at decode step 2, +5e-3 to 1.5e-2
    out = tmp_path / "imp.h5"
    import_dump(dump, GOLDEN, dump / "map.toml", out)
    fd = diff_traces(GOLDEN, out).to_json()["first_divergence"]
    assert site_of(fd, "step", "phase", "layer", "kind", "position") == (2, "decode", 1, "v", 14)
    res = invoke("diff", str(GOLDEN), str(out))
    assert res.exit_code == 1


def test_absent_kinds_and_tokens_from_reference(dump, tmp_path):
    # layer_out and logits point at files that do not exist: both absent, tokens copied from REF
    m = (dump / "map.toml").read_text().replace("pos{position:03d}/", "gone/").replace("step{step:03d}/logits", "x/l")
    res = _import(dump, tmp_path, m)
    assert res.exit_code == 0, res.output
    assert "absent: layer_out, logits" in res.output and "tokens from REF" in res.output
    with TraceReader(tmp_path / "imp.h5") as r, TraceReader(GOLDEN) as g:
        assert not r.has("layer_out", 0) and not r.has("logits") and r.has("q", 7)
        assert list(r.tokens()) == list(g.tokens())


def test_bfloat16_and_float16_files(dump, tmp_path):
    with TraceReader(GOLDEN) as g:
        emb = g.read("embeddings")
    T = 13
    bits = (emb.view(np.uint32) >> 16).astype("<u2")  # truncated to bfloat16
    for s, (a, b) in enumerate([(0, T), (T, T + 1), (T + 1, T + 2)]):
        bits[a:b].tofile(dump / f"step{s:03d}" / "emb.bf16")
        np.save(dump / f"step{s:03d}" / "rope.npy", np.ones((b - a, 16), np.float16))
    m = (
        '[[tensor]]\nkind = "embeddings"\nfile = "step{step:03d}/emb.bf16"\nformat = "raw"\n'
        'dtype = "bfloat16"\nshape = ["n", 64]\n'
        '[[tensor]]\nkind = "rope_cos_sliding"\nfile = "step{step:03d}/rope.npy"\ndtype = "float16"\n'
    )
    res = _import(dump, tmp_path, m)
    assert res.exit_code == 0, res.output
    with TraceReader(tmp_path / "imp.h5") as r:
        assert r.source_dtype("embeddings") == "bfloat16" and r.source_dtype("rope_cos_sliding") == "float16"
        assert np.array_equal(r.read("embeddings"), (bits.astype(np.uint32) << 16).view(np.float32))
        assert not r.has("q", 0)


def _replace(dump, name, arr):
    np.save(dump / name, arr)
    return dump / name


@pytest.mark.parametrize(
    "case",
    [
        "shape",
        "dtype",
        "declared_dtype",
        "raw_size",
        "missing_step",
        "axes",
        "safetensors_key",
        "safetensors_damaged",
        "not_npy",
        "mask_additive_bool",
    ],
)
def test_bad_files_name_the_file(dump, tmp_path, case):
    text = (dump / "map.toml").read_text()
    if case == "shape":  # v rows of the wrong width at decode step 1
        path = _replace(dump, "step001/layer00_v.npy", np.zeros((16, 1, 17), np.float32))
        needles = [path, "rows of shape [1, 17]", "[1, 16]"]
    elif case == "dtype":
        path = _replace(dump, "step002/embeddings.npy", np.zeros((1, 1, 64), np.int32))
        needles = [path, "int32", "floating-point"]
    elif case == "declared_dtype":
        text = text.replace(
            'file = "step{step:03d}/rope_sin_full.npy"', 'file = "step{step:03d}/rope_sin_full.npy"\ndtype = "float16"'
        )
        path, needles = dump / "step000/rope_sin_full.npy", ["float32", "the map says float16"]
        needles.append(path)
    elif case == "raw_size":
        path = dump / "step001/layer03_attn.raw"
        path.write_bytes(path.read_bytes()[:-4])
        needles = [path, "252 bytes", "256"]
    elif case == "missing_step":
        path = dump / "step002/layer04_kcache_t.npy"
        path.unlink()
        needles = [path, "missing", "layer 4", "step 2"]
    elif case == "axes":
        path = _replace(dump, "step000/embeddings.npy", np.zeros((13, 64), np.float32))
        needles = [path, "2 axes", "names 3"]
    elif case == "safetensors_key":
        text = text.replace('key = "final_hidden"', 'key = "norm_out"')
        path, needles = dump / "step000/head.safetensors", ["no tensor 'norm_out'", "final_hidden"]
        needles.append(path)
    elif case == "safetensors_damaged":
        path = dump / "step001/q.safetensors"
        path.write_bytes(b"\xff" * 8 + path.read_bytes()[8:])
        needles = [path, "not a safetensors file"]
    elif case == "not_npy":
        path = dump / "step001/logits.npy"
        path.write_bytes(b"not an npy file")
        needles = [path, "not a readable .npy"]
    else:  # an additive mask given as bool data
        path = _replace(dump, "step000/layer02_mask.npy", np.ones((16, 16), bool))
        needles = [path, "additive mask needs floating-point"]
    res = _import(dump, tmp_path, text)
    one_line_error(res, *needles)
    assert not (tmp_path / "imp.h5").exists()


@pytest.mark.parametrize(
    "text,needles",
    [
        ("runtime = \n", ["not valid TOML"]),
        ("colour = 1\n[[tensor]]\nkind='q'\nfile='a.npy'\n", ["unknown key 'colour'"]),
        ("runtime = 'x'\n", ["no [[tensor]] entries"]),
        ("[[tensor]]\nkind='qq'\nfile='a.npy'\n", ["#1", "'qq' is not a canonical kind"]),
        ("[[tensor]]\nkind='q'\nfile='a.dat'\n", ["cannot tell the format"]),
        ("[[tensor]]\nkind='q'\nfile='a.bin'\n", ["raw file needs dtype and shape"]),
        ("[[tensor]]\nkind='q'\nfile='{lyr}.npy'\n", ["uses {lyr}"]),
        ("[[tensor]]\nkind='q'\nfile='a.npy'\naxes=['pos','head','dim']\n", ["axis 'dim'"]),
        ("[[tensor]]\nkind='k'\nfile='{layer}.npy'\nlayers=[5]\n", ["layer 5", "reuses layer 3"]),
        (
            "[[tensor]]\nkind='q'\nfile='a{layer}.npy'\n[[tensor]]\nkind='q'\nfile='b{layer}.npy'\nlayers=[2]\n",
            ["q layer 2 is mapped twice"],
        ),
        ("[[tensor]]\nkind='q'\nfile='nothing{layer}.npy'\n", ["no file matches", "nothing0.npy"]),
        ("steps = 9\n[[tensor]]\nkind='q'\nfile='a.npy'\n", ["steps 9 exceeds"]),
        (
            "mode = 'free-running'\n[[tensor]]\nkind='q'\nfile='step{step:03d}/q.safetensors'\nkey='layers.{layer}.q'\n"
            "axes=['_','head','pos','d']\n",
            ["free-running dump needs token or logits"],
        ),
    ],
)
def test_bad_maps_are_one_line(dump, tmp_path, text, needles):
    one_line_error(_import(dump, tmp_path, text), *needles)
    assert not (tmp_path / "imp.h5").exists()


def test_existing_output_needs_force(dump, tmp_path):
    (tmp_path / "imp.h5").write_bytes(b"keep")
    one_line_error(_import(dump, tmp_path), "already exists")
    assert (tmp_path / "imp.h5").read_bytes() == b"keep"
    ref = tmp_path / "ref.h5"
    ref.write_bytes(GOLDEN.read_bytes())
    res = invoke(
        "import", str(dump), "--reference", str(ref), "--map", str(dump / "map.toml"), "-o", str(ref), "--force"
    )
    one_line_error(res, "is the input")
    assert ref.read_bytes() == GOLDEN.read_bytes()


def test_free_running_and_logits_rows(dump, tmp_path):
    # logits stored for every row of the step (here: the real row last, zeros before it):
    # a pos axis on a per-step kind takes the step's last row
    n_rows = {0: 13, 1: 1, 2: 1}
    for s, n in n_rows.items():
        last = np.load(dump / f"step{s:03d}" / "logits.npy")
        rows = np.zeros((n, last.shape[0]), np.float32)
        rows[-1] = last
        np.save(dump / f"step{s:03d}" / "all_logits.npy", rows)
    m = (dump / "map.toml").read_text().replace('runtime = "static-dump"', 'runtime = "npu"\nmode = "free-running"')
    m = m.replace('file = "step{step:03d}/logits.npy"', 'file = "step{step:03d}/all_logits.npy"\naxes = ["pos", "d"]')
    res = _import(dump, tmp_path, m)
    assert res.exit_code == 0, res.output
    with TraceReader(tmp_path / "imp.h5") as r, TraceReader(GOLDEN) as g:
        assert r.mode == "free-running" and r.provenance["runtime"] == "npu"
        assert list(r.tokens()) == list(g.tokens())  # argmax of the real rows
        assert np.array_equal(r.read("logits")[0], np.load(dump / "step000" / "logits.npy"))


def test_import_does_not_need_torch(dumped, tmp_path):
    # runs where the toolchain runs: numpy and h5py only
    import subprocess
    import sys

    dump = dumped[0]
    code = (
        "import sys; from gemma4_trace.cli import main; from click.testing import CliRunner; "
        f"r = CliRunner().invoke(main, ['import', {str(dump)!r}, '--reference', {str(GOLDEN)!r}, "
        f"'--map', {str(dump / 'map.toml')!r}, '-o', {str(tmp_path / 'x.h5')!r}]); "
        "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_npz_member_that_cannot_fit_is_refused_before_inflating(dump, tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_TRACE_MEMORY_LIMIT", "1000")  # bytes; each ple.npz member inflates to 3.4 KiB
    one_line_error(_import(dump, tmp_path), dump / "step000" / "ple.npz", "[ple]", "more than the 1000 B")
