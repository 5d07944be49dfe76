"""`trace replay REF --pte PATH`: the user's ExecuTorch programs read and checked before any model loads.

PATH is a folder holding prefill.pte and decode.pte as `trace export-pte` writes them: the tool's
step programs (replayer/functional.py: logits, the K/V caches, then every reported kind as extra
outputs, in the order `functional.output_names` gives). A .pte keeps no output names (ExecuTorch
1.5.1's MethodMeta gives each output's shape and dtype, nothing more), so that order is the only
naming this replay can trust; one .pte file of another layout is read and checked, then refused in
one line saying what is missing (docs/runtime-executorch.md, "Your own file").

Each program is untrusted input: a regular file (a FIFO, device, folder or a link to one is refused
before a byte is read; open_regular), 64 bytes to 64 GiB, copied in 16 MiB blocks into a private
folder while it is hashed (never held whole in memory: an E2B program is gigabytes), and that copy
is what ExecuTorch's own loader reads with its flatbuffer verifier on (`Runtime.load_program(path,
verification=InternalConsistency)`: a wrong identifier, a truncated or bit-flipped table is refused
there; in a child process, so that a loader crash on a hostile file is one line: Inspector), which
gives the methods and each one's input and output shapes and dtypes. The user's files are never
written: what runs is that same private copy, moved into the artifact cache (`pte-file/`) once its
sha256 is checked again (executorch_user.py), so the bytes checked are the bytes run. The
provenance names the files by basename and sha256, never the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import open_regular, sha256_file

from ..child import Child, quiet_fd2

OPTION = "--pte"
INSPECTOR = f"{__name__}:Inspector"
STEPS = ("prefill", "decode")
MIN_PTE = 64  # bytes: a .pte's flatbuffer header and root table
MAX_PTE = 64 << 30  # bytes of one .pte (copied block by block; a float32 E2B program is about 20 GiB)
BLOCK = 16 << 20  # bytes read and hashed at a time
DOC = 'docs/runtime-executorch.md, "Your own file"'
DTYPES = {4: "int64", 6: "float32", 11: "bool"}  # ExecuTorch's ScalarType codes the step programs use


@dataclass(frozen=True)
class Tensor:
    """One input or output of a method, as its MethodMeta gives it."""

    sizes: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.sizes))}]"


@dataclass
class UserPTE:
    """The user's programs (the folder of step programs, or one .pte), read and checked (read_pte)."""

    path: Path  # what the user named (never in the provenance)
    steps: bool  # a folder of prefill.pte and decode.pte
    inputs: dict = field(default_factory=dict)  # program -> [Tensor] of its `forward`
    outputs: dict = field(default_factory=dict)  # program -> [Tensor]
    files: dict = field(default_factory=dict)  # file name -> sha256
    copies: dict = field(default_factory=dict)  # program -> its private copy (the bytes hashed), until it runs
    folder: Path | None = None  # the copies' private folder (private_folder)

    def files_text(self) -> str:
        return ", ".join(f"{one_line(n, 100)} sha256:{h}" for n, h in self.files.items())

    def shown(self) -> str:
        return one_line(self.path.name, 100) + ("/" if self.steps else "")

    def file_of(self, program: str) -> Path:
        return self.path / f"{program}.pte" if self.steps else self.path

    def fail(self, why: str):
        fail(self.path, why)


def fail(path, why: str):
    raise TraceToolError(f"{OPTION} {one_line(str(path), 200)}: {why}")


def read_pte(path) -> UserPTE:
    """PATH read and checked within bounds (module docstring); one line for anything this replay cannot take."""
    path = Path(path)
    if not os.path.lexists(path):
        fail(path, "no such file or folder")
    if os.path.isdir(path):
        missing = [f"{g}.pte" for g in STEPS if not os.path.lexists(path / f"{g}.pte")]
        if missing:
            fail(path, f"a folder must hold the tool's own programs (prefill.pte and decode.pte, as `trace "
                 f"export-pte` writes them; no {missing[0]}); see {DOC}")  # fmt: skip
        out = UserPTE(path, True)
        with inspector() as child:
            for g in STEPS:
                read_program(out, g, child)
        return out
    out = UserPTE(path, False)
    with inspector() as child:
        read_program(out, "model", child)
    fail(path, "a .pte names none of its outputs (ExecuTorch keeps only their shapes; an ETRecord's debug "
         "handles name the lowered graph's nodes, not Gemma's layers and kinds), so this replay cannot tell "
         "which output is which: lower the tool's step programs with `trace export-pte` and give their folder "
         f"({DOC})")  # fmt: skip


def private_folder(user: UserPTE) -> Path:
    """The folder of the user's programs' copies (removed with `user`, or once they are in the cache)."""
    if user.folder is None:
        user.folder = Path(tempfile.mkdtemp(prefix="gemma4-trace-pte-"))
        weakref.finalize(user, shutil.rmtree, user.folder, True)
    return user.folder


def copy_program(user: UserPTE, program: str) -> tuple[Path, str]:
    """A program's file (regular, within bounds, an ExecuTorch program by its identifier) copied block by
    block into the private folder: (the copy, its sha256)."""
    file = user.file_of(program)
    name = one_line(file.name, 100)
    folder = private_folder(user)
    dest = folder / f"{program}.pte"
    h, n = hashlib.sha256(), 0
    with open_regular(file, f"{OPTION}'s {file.name}" if user.steps else OPTION) as f:
        size = os.fstat(f.fileno()).st_size
        if not MIN_PTE <= size <= MAX_PTE:
            user.fail(f"{name} is {size} bytes (a .pte: {MIN_PTE} to {MAX_PTE})")
        head = f.read(8)
        if head[4:8] != b"ET12":
            user.fail(f"{name} is not an ExecuTorch program (its flatbuffer identifier is {head[4:8]!r}, not b'ET12')")
        free = shutil.disk_usage(folder).free
        if free < size:
            user.fail(f"{name} is {size} bytes and the temporary folder has {free} free "
                      "for its private copy (set TMPDIR to a larger disk)")  # fmt: skip
        try:
            with open(dest, "xb") as out:
                block = head
                while block and n <= size:
                    h.update(block)
                    out.write(block)
                    n += len(block)
                    block = f.read(min(BLOCK, size + 1 - n))
        except OSError as e:
            user.fail(f"copying {name} into a private folder: {e.strerror or e}")
    if n != size:
        user.fail(f"{name} changed while it was read")
    return dest, h.hexdigest()


def read_program(user: UserPTE, program: str, child: Child) -> None:
    """One .pte: copied within bounds and hashed, the copy loaded by ExecuTorch's verifying loader (in
    `child`), its `forward` described."""
    name = one_line(user.file_of(program).name, 100)
    copy, digest = copy_program(user, program)
    user.files[name], user.copies[program] = digest, copy
    try:
        _, methods, inputs, outputs = child.call("describe", str(copy), phase="reading " + name)
    except TraceToolError as e:  # the loader's refusal, or its crash: one line either way
        user.fail(f"{name}: ExecuTorch's loader refuses it, truncated or corrupt ({one_line(e, 160)})")
    if inputs is None:
        user.fail(f"{name} has no method 'forward' (its methods: {one_line(', '.join(methods), 120) or 'none'})")
    user.inputs[program] = [Tensor(tuple(sizes), DTYPES.get(code, f"scalar type {code}")) for sizes, code in inputs]
    user.outputs[program] = [Tensor(tuple(sizes), DTYPES.get(code, f"scalar type {code}")) for sizes, code in outputs]


@contextlib.contextmanager
def inspector():
    """A child process running Inspector (replayer/child.py), ended on leaving."""
    try:
        import executorch.runtime  # noqa: F401
    except ImportError as e:
        raise TraceToolError(f"{OPTION} needs executorch ({e})") from None
    child = Child("ExecuTorch's program loader", INSPECTOR)
    try:
        yield child
    finally:
        child.close()


class Inspector:
    """In the child process: ("describe", path) -> ("described", methods, inputs, outputs), the program
    (the parent's private copy) loaded by ExecuTorch's verifying loader; inputs and outputs are
    [(sizes, dtype code)] of its `forward` (None where it has none). The loader's refusal is its
    exception, one line for the parent."""

    def __init__(self, emit):
        with quiet_fd2():
            from executorch.runtime import Runtime, Verification

        self.runtime, self.verification = Runtime.get(), Verification.InternalConsistency

    def handle(self, command: str, path: str):
        with quiet_fd2(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            prog = self.runtime.load_program(Path(path), verification=self.verification)
            methods = sorted(prog.method_names)
            if "forward" not in methods:
                return ("described", methods, None, None)
            meta = prog.metadata("forward")
            ins = [_tensor(meta.input_tensor_meta(i)) for i in range(meta.num_inputs())]
            outs = [_tensor(meta.output_tensor_meta(i)) for i in range(meta.num_outputs())]
        return ("described", methods, ins, outs)


def _tensor(info) -> tuple[list[int], int]:
    return [int(s) for s in info.sizes()], int(info.dtype())


def place_checked(user: UserPTE, program: str, dest: Path) -> None:
    """The program's private copy moved to `dest` (the cache entry being built), refused unless it
    still hashes to what was checked."""
    name = one_line(user.file_of(program).name, 100)
    copy = user.copies.get(program)
    try:
        digest = sha256_file(copy)
    except (OSError, TypeError):
        user.fail(f"{name}: its private copy is gone")
    if digest != user.files.get(name):
        user.fail(f"{name} changed since it was read")
    shutil.move(copy, dest)
