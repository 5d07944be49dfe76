"""`trace import` treats its map and dump as untrusted input (docs/import.md, "What is read"):
it opens only regular files inside DUMP_DIR, reads nothing before its size is justified by
REF, never waits on a FIFO, never replaces a file it reads, and every malformed input is one
line naming the file, exit 2. Dumps here are built from the golden's own rows (no runtime)."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error

GOLDEN = golden_path("short")  # 13 prompt tokens, 3 steps, hidden 64
STEPS = [(0, 13), (13, 14), (14, 15)]
EMB_MAP = '[[tensor]]\nkind = "embeddings"\nfile = "step{step}.npy"\n'


def _emb():
    with TraceReader(GOLDEN) as g:
        return g.read("embeddings")  # (15, 64) float32


def _dump(tmp_path):
    """A dump of the golden's embeddings, one .npy per step: imports to a valid trace."""
    dump = tmp_path / "dump"
    dump.mkdir()
    emb = _emb()
    for s, (a, b) in enumerate(STEPS):
        np.save(dump / f"step{s}.npy", emb[a:b])
    return dump


def _import(dump, tmp_path, map_text, out=None, force=False):
    m = tmp_path / "map.toml"
    m.write_text(map_text)
    out = out or tmp_path / "imp.h5"
    args = ["import", str(dump), "--reference", str(GOLDEN), "--map", str(m), "-o", str(out)]
    return invoke(*args, *(["--force"] if force else []))


def _limited(memory=3 << 30):
    def limit():  # a defect must fail the test, not the machine
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return limit


def _import_args(dump, map_path, out) -> list[str]:
    """`trace import` arguments against the golden REF."""
    return ["import", str(dump), "--reference", str(GOLDEN), "--map", str(map_path), "-o", str(out)]


def _cli_subprocess(args, tmp_path, timeout=60, memory=3 << 30):
    """The CLI in a child process (so a hang is a timeout and a blow-up hits its memory limit)."""
    return subprocess.run(
        [sys.executable, "-m", "gemma4_trace", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        preexec_fn=_limited(memory),
    )


def test_the_minimal_dump_imports(tmp_path):
    dump = _dump(tmp_path)
    res = _import(dump, tmp_path, EMB_MAP)
    assert res.exit_code == 0, res.output
    with TraceReader(tmp_path / "imp.h5") as r:
        assert np.array_equal(r.read("embeddings"), _emb())


# ---------------------------------------------------------------- 18.1: nothing outside DUMP_DIR
@pytest.mark.parametrize("how", ["absolute", "dotdot", "file_link", "folder_link", "etc_passwd"])
def test_no_file_outside_the_dump_is_read(tmp_path, how):
    dump = _dump(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.bin"
    secret.write_bytes(np.full((13, 64), 7.0, np.float32).tobytes())  # the right size for step 0's rows
    raw = 'format = "raw"\ndtype = "float32"\nshape = ["n", 64]\n'
    file = {
        "absolute": str(secret),
        "dotdot": "../outside/secret.bin",
        "file_link": "link.bin",
        "folder_link": "linked/secret.bin",
        "etc_passwd": "/etc/passwd",
    }[how]
    (dump / "link.bin").symlink_to(secret)
    (dump / "linked").symlink_to(outside, target_is_directory=True)
    res = _import(dump, tmp_path, f'steps = 1\n[[tensor]]\nkind = "embeddings"\nfile = "{file}"\n{raw}')
    line = one_line_error(res)
    assert "bytes" not in line and "holds" not in line  # nothing about the refused file
    assert not (tmp_path / "imp.h5").exists()


def test_a_link_inside_the_dump_is_followed(tmp_path):
    dump = _dump(tmp_path)
    (dump / "again0.npy").symlink_to(dump / "step0.npy")  # relative target inside: allowed
    (dump / "again1.npy").symlink_to("step1.npy")
    (dump / "again2.npy").symlink_to("step2.npy")
    res = _import(dump, tmp_path, EMB_MAP.replace("step{step}", "again{step}"))
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "pattern,needle",
    [
        ("step{step:>2000000000}.npy", "may have only a width"),
        ("step{step:{n}}.npy", "may have only a width"),
        ("step{step!r}.npy", "may have only a width"),
        ("step{kind[99]}.npy", "uses {kind[99]}"),
        ("step{step.real}.npy", "uses {step.real}"),
        ("step{0}.npy", "uses {0}"),
        ("step{step}{layer}.npy", "put a separator"),
    ],
)
def test_format_specs_are_what_a_file_name_needs(tmp_path, pattern, needle):
    dump = _dump(tmp_path)
    res = _cli_subprocess(
        [
            "import",
            dump,
            "--reference",
            GOLDEN,
            "--map",
            _write(tmp_path, EMB_MAP.replace("step{step}.npy", pattern)),
            "-o",
            tmp_path / "imp.h5",
        ],
        tmp_path,
    )
    one_line_error(res, "[[tensor]] #1", needle)


def test_format_spec_in_key_is_refused(tmp_path):
    dump = _dump(tmp_path)
    m = '[[tensor]]\nkind = "embeddings"\nfile = "e.npz"\nkey = "x{step:>2000000000}"\n'
    res = _cli_subprocess(
        ["import", dump, "--reference", GOLDEN, "--map", _write(tmp_path, m), "-o", tmp_path / "imp.h5"], tmp_path
    )
    one_line_error(res, "key", "may have only a width")


def _write(tmp_path, text, name="map.toml"):
    (tmp_path / name).write_text(text)
    return tmp_path / name


# ---------------------------------------------------------------- 18.4: no hang, no memory blow-up
def test_fifo_as_dump_file_is_refused(tmp_path):
    dump = _dump(tmp_path)
    (dump / "step1.npy").unlink()
    os.mkfifo(dump / "step1.npy")
    res = _cli_subprocess(
        ["import", dump, "--reference", GOLDEN, "--map", _write(tmp_path, EMB_MAP), "-o", tmp_path / "imp.h5"],
        tmp_path,
        timeout=60,
    )
    one_line_error(res, dump / "step1.npy", "not a regular file")
    assert not (tmp_path / "imp.h5").exists()


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_map_must_be_a_regular_file(tmp_path, special):
    dump = _dump(tmp_path)
    m = tmp_path / "map.toml"
    if special == "fifo":
        os.mkfifo(m)
    else:
        m = special
    res = _cli_subprocess(
        ["import", dump, "--reference", GOLDEN, "--map", m, "-o", tmp_path / "imp.h5"],
        tmp_path,
        timeout=60,
        memory=2 << 30,
    )
    one_line_error(res, f"map {m}", "not a regular file")


def test_map_size_is_bounded(tmp_path):
    dump = _dump(tmp_path)
    res = _import(dump, tmp_path, EMB_MAP + "#" * (2 << 20) + "\n")
    one_line_error(res, "larger than the 1 MiB a map may be")


# ---------------------------------------------------------------- 18.5: bounds from what is taken
def test_mask_wider_than_any_trace_is_refused_before_reading(tmp_path):
    # 2^21 keys: twice what the reader accepts in any trace; a sparse file of 27 MB declared
    dump = tmp_path / "dump"
    dump.mkdir()
    for s, (a, b) in enumerate(STEPS):
        header_arr = np.lib.format.open_memmap(dump / f"m{s}.npy", mode="w+", dtype=bool, shape=(b - a, 1 << 21))
        del header_arr
    res = _import(dump, tmp_path, '[[tensor]]\nkind = "mask"\nfile = "m{step}.npy"\nlayers = [0]\n')
    one_line_error(res, dump / "m0.npy", "allows at most 1048576 values in a mask row")


def test_npz_member_is_refused_from_its_header_before_inflating(tmp_path):
    # a member of 64 MiB of zeros (64 KiB compressed) whose rows are not REF's: refused from its
    # header with the layout error, before a byte of it is inflated (the memory limit is below it)
    dump = tmp_path / "dump"
    dump.mkdir()
    arr = np.zeros((13, 1 << 20), np.float32)
    np.savez_compressed(dump / "e.npz", e=arr)
    del arr
    m = 'steps = 1\n[[tensor]]\nkind = "embeddings"\nfile = "e.npz"\nkey = "e"\n'
    env = dict(os.environ, GEMMA4_TRACE_MEMORY_LIMIT="16M")
    p = subprocess.run(
        [sys.executable, "-m", "gemma4_trace", *_import_args(dump, _write(tmp_path, m), tmp_path / "imp.h5")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    one_line_error(p, "e.npz [e]", "rows of shape [1048576]", "expected [64]")


def test_raw_file_is_read_only_at_the_rows_used(tmp_path):
    # a 1 GiB sparse raw buffer of which the step takes 13 rows of 64 floats
    dump = tmp_path / "dump"
    dump.mkdir()
    rows = 1 << 22
    with open(dump / "buf.bin", "wb") as fh:
        fh.write(_emb()[:13].tobytes())
        fh.truncate(rows * 64 * 4)
    m = (
        'steps = 1\n[[tensor]]\nkind = "embeddings"\nfile = "buf.bin"\ndtype = "float32"\n'
        f'shape = [{rows}, 64]\nrows = "padded"\n'
    )
    code = (
        "import sys; from gemma4_trace.cli import main\nc = 0\n"
        "try:\n    main(sys.argv[1:], prog_name='trace')\nexcept SystemExit as e:\n    c = e.code\n"
        # VmHWM: this process's own peak (ru_maxrss keeps the forking parent's, a pytest with torch loaded)
        "hwm = [ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]\n"
        "print('RSS', hwm, 'EXIT', c, file=sys.stderr)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, *_import_args(dump, _write(tmp_path, m), tmp_path / "imp.h5")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = p.stderr.strip().splitlines()[-1].split()
    assert last[3] == "0", p.stdout + p.stderr
    assert int(last[1]) < 512 * 1024, p.stderr  # KiB: far below the buffer's 1 GiB (70-280 MiB seen)
    with TraceReader(tmp_path / "imp.h5") as r:
        assert np.array_equal(r.read("embeddings"), _emb()[:13])


def test_path_search_is_bounded_by_the_folder(tmp_path):
    # a REF with a 2^18-token prompt and a one-line per-position map: nothing in the folder
    # matches, so nothing is looked up per position and layer (8 layers x 262,144 names)
    from gemma4_trace.traces.writer import TraceWriter

    long_ref = tmp_path / "long.h5"
    T = 1 << 18
    with TraceReader(GOLDEN) as g, TraceWriter(long_ref) as w:
        w.write_header(
            dataclasses.replace(
                g.header(),
                prompt_ids=np.full(T, 5, np.int64),
                max_new_tokens=1,
                prompt_text="",
                chat_template_applied=False,
                extra_inputs={},
            )
        )
        w.begin_step(range(0, T))
        w.add("token", 5)
        w.end_step()
    dump = _dump(tmp_path)
    m = _write(tmp_path, '[[tensor]]\nkind = "layer_out"\nfile = "pos{position}/layer{layer}.npy"\n')
    # count the file-system lookups: one listing of the folder, not one stat per (position, layer)
    lookups = []
    real_stat, real_lstat = os.stat, os.lstat
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "stat", lambda *a, **k: lookups.append(a) or real_stat(*a, **k))
        mp.setattr(os, "lstat", lambda *a, **k: lookups.append(a) or real_lstat(*a, **k))
        res = invoke("import", dump, "--reference", long_ref, "--map", m, "-o", tmp_path / "imp.h5")
    one_line_error(res, "no file matches", "pos0/layer0.npy")
    assert len(lookups) < 1000, len(lookups)  # the old search stat'ed 8 x 2^18 names


# ---------------------------------------------------------------- 18.6: inputs are never replaced
def test_output_over_a_dump_file_is_refused_even_with_force(tmp_path):
    dump = _dump(tmp_path)
    before = (dump / "step1.npy").read_bytes()
    res = _import(dump, tmp_path, EMB_MAP, out=dump / "step1.npy", force=True)
    one_line_error(res, "is the input", dump / "step1.npy")
    assert (dump / "step1.npy").read_bytes() == before


# ---------------------------------------------------------------- 18.10: malformed inputs, one line
def _npy_with_header(path, header: str):
    h = header.encode("latin1")
    h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + bytes(13 * 64 * 4))


def _safetensors(path, header):
    h = header.encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + bytes(64))


@pytest.mark.parametrize(
    "case",
    [
        "npy_negative_shape",
        "npy_huge_float_shape",
        "npy_deep_header",
        "npz_member_without_npy",
        "npz_lying_sizes",
        "safetensors_deep_json",
        "safetensors_huge_shape",
        "safetensors_dtype_list",
        "map_deep_toml",
        "map_format_list",
        "map_kind_list",
    ],
)
def test_malformed_inputs_are_one_line(tmp_path, case):
    dump = _dump(tmp_path)
    m = "steps = 1\n" + EMB_MAP
    target = dump / "step0.npy"
    if case == "npy_negative_shape":
        _npy_with_header(target, "{'descr': '<f4', 'fortran_order': False, 'shape': (-13, 64), }")
        needles = [target, "not a readable .npy"]
    elif case == "npy_huge_float_shape":
        _npy_with_header(target, "{'descr': '<f4', 'fortran_order': False, 'shape': (1e400, 64), }")
        needles = [target, "not a readable .npy"]
    elif case == "npy_deep_header":
        _npy_with_header(target, "{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 3000 + ")" * 3000 + "}")
        needles = [target, "not a readable .npy"]
    elif case in ("npz_member_without_npy", "npz_lying_sizes"):
        target = dump / "e.npz"
        m = 'steps = 1\n[[tensor]]\nkind = "embeddings"\nfile = "e.npz"\nkey = "e"\n'
        if case == "npz_member_without_npy":
            with zipfile.ZipFile(target, "w") as z:
                z.writestr("e", b"not an array")
            needles = [target, "no array 'e'"]
        else:
            np.savez_compressed(target, e=_emb()[:13])
            data = bytearray(target.read_bytes())
            # the local header's and the central directory's uncompressed size: 100 bytes
            for sig in (b"PK\x03\x04", b"PK\x01\x02"):
                i = data.index(sig)
                off = i + (22 if sig == b"PK\x03\x04" else 24)
                data[off : off + 4] = struct.pack("<I", 100)
            target.write_bytes(bytes(data))
            needles = [target]
    elif case in ("safetensors_deep_json", "safetensors_huge_shape", "safetensors_dtype_list"):
        target = dump / "e.safetensors"
        m = 'steps = 1\n[[tensor]]\nkind = "embeddings"\nfile = "e.safetensors"\nkey = "e"\n'
        header = {
            "safetensors_deep_json": "[" * 100000 + "]" * 100000,
            "safetensors_huge_shape": json.dumps(
                {"e": {"dtype": "F32", "shape": [13, 64], "data_offsets": [0, 64]}}
            ).replace("13", "1e400"),
            "safetensors_dtype_list": json.dumps({"e": {"dtype": ["F32"], "shape": [13, 64], "data_offsets": [0, 64]}}),
        }[case]
        _safetensors(target, header)
        needles = [target]
    elif case == "map_deep_toml":
        m = "x = " + "[" * 100000 + "]" * 100000 + "\n"
        needles = ["map", "nested more than 16 deep"]
    elif case == "map_format_list":
        m = EMB_MAP + "format = ['npy']\n"
        needles = ["format must be one of"]
    else:
        m = '[[tensor]]\nkind = ["q"]\nfile = "a.npy"\n'
        needles = ["is not a canonical kind"]
    res = _import(dump, tmp_path, m)
    one_line_error(res, *needles)
    assert not (tmp_path / "imp.h5").exists()


# ---------------------------------------------------------------- the fuzzer's import classes
def test_fuzzer_import_classes_end_cleanly():
    """Two cases of each hostile import class of scripts/fuzz_traces.py (which runs hundreds):
    exit 0 or one line, nothing outside the dump opened (inotify), no dump file changed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "fuzz_traces", Path(__file__).resolve().parents[2] / "scripts" / "fuzz_traces.py"
    )
    fz = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_traces"] = fz
    spec.loader.exec_module(fz)
    for cls in fz.IMPORT:
        rep = fz.fuzz_import(2, 18, only=cls)
        summary = fz.format_import_report(rep, f"fuzz_import(2, only={cls})")
        assert rep.cases == 2 and rep.mutations[cls] == 2, summary
        assert not rep.failures, summary + "\n" + "\n".join(rep.failures)
        assert rep.watch_ok and not rep.outside and not rep.slow and not rep.big, summary
