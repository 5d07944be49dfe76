"""The user's ExecuTorch programs are untrusted input (`trace replay REF --pte PATH`,
replayer/runtimes/executorch_file.py, executorch_user.py): a path that is no regular file is never
read, an empty, oversized, foreign, truncated or bit-flipped program is refused by the size bounds or
ExecuTorch's verifying loader before the model loads, a program that does not fit the tool's layout
once REF's checkpoint is loaded; each is one line, exit 2, nothing written, the user's files
unchanged. The only programs here are tiny ones (`x + 1`, portable ops, a few seconds to write): no
backend lowering."""

from __future__ import annotations

import hashlib
import os

import pytest

pytest.importorskip("executorch", reason="executorch is not installed (pip install -e '.[executorch]')")

import torch  # noqa: E402

from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

REF = golden_path("short")


def tiny_program(method: str = "forward") -> bytes:
    """A valid .pte of one method, x + 1 on float32[2] (no delegate)."""
    from executorch.exir import to_edge

    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    ep = torch.export.export(AddOne(), (torch.zeros(2),))
    return to_edge({method: ep}).to_executorch().buffer


@pytest.fixture(scope="module")
def program() -> bytes:
    return tiny_program()


def folder(tmp_path, prefill: bytes | None, decode: bytes | None = None):
    d = tmp_path / "programs"
    d.mkdir()
    for name, data in (("prefill.pte", prefill), ("decode.pte", decode if decode is not None else prefill)):
        if data is not None:
            (d / name).write_bytes(data)
    return d


def digests(path) -> dict:
    """Each regular file's sha256, or its size and mtime where it is large (the sparse 5 and 65 GiB ones:
    reading them would take half a minute and as much memory)."""

    def digest(p):
        st = p.stat()
        return hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size <= 1 << 26 else (st.st_size, st.st_mtime_ns)

    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {p.name: digest(p) for p in files if p.is_file() and not p.is_symlink()}


def refused(tmp_path, pte, *needles):
    out = tmp_path / "run.h5"
    before = digests(pte) if os.path.exists(pte) else None
    r = invoke("replay", REF, "--pte", pte, "--max-seq", 16, "-o", out)
    line = one_line_error(r, *needles, out=out)
    if before is not None:
        assert digests(pte) == before
    return line


def test_missing_path_and_folder_without_programs(tmp_path):
    refused(tmp_path, tmp_path / "nope", "no such file or folder")
    d = tmp_path / "half"
    d.mkdir()
    (d / "prefill.pte").write_bytes(b"x" * 100)
    refused(tmp_path, d, "no decode.pte", "trace export-pte", "Your own file")


def test_no_regular_file_is_read(tmp_path):
    d = tmp_path / "programs"
    d.mkdir()
    os.mkfifo(d / "prefill.pte")  # a FIFO with no writer: a plain open would hang
    (d / "decode.pte").write_bytes(b"x" * 100)
    refused(tmp_path, d, "prefill.pte", "not a regular file")
    os.remove(d / "prefill.pte")
    os.symlink("/dev/zero", d / "prefill.pte")  # a link to a device
    refused(tmp_path, d, "not a regular file")
    os.remove(d / "prefill.pte")
    (d / "prefill.pte").mkdir()
    refused(tmp_path, d, "not a regular file")


def test_sizes_out_of_bounds(tmp_path):
    refused(tmp_path, folder(tmp_path, b""), "prefill.pte is 0 bytes", "64 to")
    huge = tmp_path / "huge"
    huge.mkdir()
    for name in ("prefill.pte", "decode.pte"):
        with open(huge / name, "wb") as f:
            f.truncate(65 << 30)  # sparse: nothing is written, nothing read
    refused(tmp_path, huge, f"prefill.pte is {65 << 30} bytes")
    os.rename(huge, tmp_path / "over")
    huge.mkdir()
    for name in ("prefill.pte", "decode.pte"):
        with open(huge / name, "wb") as f:
            f.truncate(5 << 30)  # within the bounds: its identifier is refused before anything is copied
    refused(tmp_path, huge, "prefill.pte is not an ExecuTorch program")


def test_foreign_truncated_and_bit_flipped_programs(tmp_path, program):
    refused(tmp_path, folder(tmp_path, b"PK\x03\x04" + b"\0" * 200), "not an ExecuTorch program", "ET12")
    os.rename(tmp_path / "programs", tmp_path / "foreign")
    refused(tmp_path, folder(tmp_path, program[: len(program) // 2]), "loader refuses it", "truncated or corrupt")
    os.rename(tmp_path / "programs", tmp_path / "truncated")
    flipped = bytearray(program)
    for i in range(8, 200, 7):
        flipped[i] ^= 0xFF
    refused(tmp_path, folder(tmp_path, bytes(flipped)), "loader refuses it")


def test_no_forward_method(tmp_path):
    refused(tmp_path, folder(tmp_path, tiny_program("other")), "has no method 'forward'", "other")


def test_one_pte_file_is_refused_saying_what_is_missing(tmp_path, program):
    f = tmp_path / "model.pte"
    f.write_bytes(program)
    refused(tmp_path, f, "names none of its outputs", "trace export-pte", "Your own file")


def test_program_outside_the_tools_layout_is_refused_after_the_checkpoint_loads(tmp_path, program):
    refused(tmp_path, folder(tmp_path, program), "prefill.pte takes 1 inputs", "not the tool's step programs")
