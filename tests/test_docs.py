"""The docs run as written: every shell block of README.md and docs/*.md, with its shown output.

A shell block is an indented (4 spaces) or fenced (```sh, ```bash, ```console, ```shell or
a plain ```) code block whose lines are commands: `$ cmd` prompt style (the lines after a
command, up to the next `$ `, are its shown output), or bare lines starting with `trace`,
`make`, `python`, `pytest` or `pip` (no output shown; a bare block that mixes in other lines
is an error: write it with prompts). Blocks of output only, TOML and Python are not shell.

Each document runs in its own temporary folder, in document order, on the embedded model;
the folder links the repository's traces/, tests/, hf/, benchmarks/, scripts/ and docs/ so
the docs' relative paths work, PYTHONPATH is the repository root (`tests.support.bug_zoo:...`
plug-ins import), this interpreter's environment is first on PATH and GEMMA4_TRACE_CACHE is a
folder of that document whose costly families (SHARED: exports, lowerings, IRs) link to the suite's
artifact cache (tests/conftest.py; keyed by content, so a document finds there what it would build,
and what it builds stays for the next run: that a build happened shows only on stderr); the GGUF
files, whose `built in 0.1 s` or `cached` a document shows, are built in the document's own folder
(a new user's empty cache; under a second each). `trace` there is the
console script's `main()` run in a process forked from a warm one (tests/support/docs_trace_server.py:
each command its own process, without the 2 s of imports); GEMMA4_DOCS_REAL_TRACE=1 runs the
environment's own `trace` instead.
A command must exit 0, 1 for a `trace diff` that reports a divergence (or a `trace sweep` in
which a prompt diverges), or 2 where the doc
shows its `error: ...` line. Its shown output
must be the first lines it prints (stdout; stderr when it prints nothing there, without the
progress lines of the phases it got through, which the docs do not show), ending in a
`...` line exactly when the command prints more than is shown (shortened output says so), numbers
compared to the precision shown (one unit in the last digit shown; integers exactly),
wall-clock figures such as `(0.7 s)` ignored, and figures of float32 rounding size (below
1e-5 in both, written with an exponent; the step where one peaks) taken as equal: they move
with the CPU's kernels.

A block is not run only when the line before it (blank lines aside) is a marker with a
reason: `<!-- not run: needs your own checkpoint folder -->`.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import without_progress

pytestmark = pytest.mark.slow  # runs every documented command; make test-fast skips it

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("traces", "tests", "hf", "benchmarks", "scripts", "docs")
COMMAND_WORDS = ("trace", "make", "python", "pytest", "pip", "printf", "cd")
FENCE_LANGS = ("", "sh", "bash", "console", "shell")
MARKER = re.compile(r"^\s*<!--\s*not run\b(.*?)-->\s*$")
MARKER_START = re.compile(r"^\s*<!--\s*not run\b")
COMMAND_TIMEOUT = 300
SHARED = ("onnx", "openvino", "executorch", "litert", "litert-outputs", "mobius", "sweep-ref")  # docstring
SHORTENED = "..."  # a shown output's last line when the command prints more than is shown


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ---- reading the blocks ------------------------------------------------------------------


def _code_blocks(text: str):
    """Yield (first line number, lines, fenced language or None for indented) of each code block."""
    lines = text.split("\n")
    i, n = 0, len(lines)
    prev_blank = True
    while i < n:
        line = lines[i]
        fence = re.match(r"^(```+|~~~+)\s*([\w-]*)", line)
        if fence:
            mark, lang = fence.group(1), fence.group(2).lower()
            j = i + 1
            while j < n and not lines[j].startswith(mark):
                j += 1
            yield i + 2, lines[i + 1 : j], lang
            i, prev_blank = j + 1, False
            continue
        if line.startswith("    ") and line.strip() and prev_blank:
            j = i
            block = []
            while j < n and (lines[j].startswith("    ") or not lines[j].strip()):
                block.append(lines[j][4:])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            yield i + 1, block, None
            i, prev_blank = i + len(block), False
            continue
        # an indented block starts after a blank line or after an HTML comment (a marker)
        prev_blank = not line.strip() or bool(re.match(r"^\s*<!--.*-->\s*$", line))
        i += 1


def _is_command(line: str) -> bool:
    words = line.split()
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
        words = words[1:]
    return bool(words) and words[0] in COMMAND_WORDS


def _is_shell(lines, lang) -> bool:
    if lang is not None and lang not in FENCE_LANGS:
        return False
    body = [ln for ln in lines if ln.strip()]
    return bool(body) and (any(ln.startswith("$ ") for ln in body) or _is_command(body[0]))


def _marker_before(text_lines, first_line: int, fenced: bool):
    """The marker line (number, reason) right before a block starting at first_line (1-based)."""
    k = first_line - 2 - (1 if fenced else 0)  # index of the line before the block (or its fence)
    while k >= 0 and not text_lines[k].strip():
        k -= 1
    if k >= 0 and MARKER_START.match(text_lines[k]):
        m = MARKER.match(text_lines[k])
        reason = m.group(1).strip().lstrip(":").strip() if m else ""
        return k + 1, reason
    return None


class Command:
    def __init__(self, line_no: int, cmd: str, shown: list[str]):
        self.line_no, self.cmd, self.shown = line_no, cmd, shown


def shell_blocks(path: Path):
    """Yield (line number, lines, marker or None, commands) for every shell block of a document."""
    text = path.read_text()
    text_lines = text.split("\n")
    for first, lines, lang in _code_blocks(text):
        if not _is_shell(lines, lang):
            continue
        marker = _marker_before(text_lines, first, lang is not None)
        try:
            commands = _commands(path, first, lines)
        except ValueError as e:  # reported by the test that runs the document
            commands = str(e)
        yield first, lines, marker, commands


def _commands(path: Path, first: int, lines: list[str]) -> list[Command]:
    prompt = any(ln.startswith("$ ") for ln in lines)
    out: list[Command] = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        if prompt and not ln.startswith("$ "):
            if out:
                out[-1].shown.append(ln)
            elif ln.strip():
                raise ValueError(f"{path.name}:{first + i}: output before the first `$ ` command")
            i += 1
            continue
        if not ln.strip():
            i += 1
            continue
        if not prompt and not _is_command(ln):
            raise ValueError(
                f"{path.name}:{first + i}: a block of bare commands holds a line that "
                f"is not one ({ln.strip()[:60]!r}): write the block with `$ ` prompts"
            )
        cmd, start = ln[2:] if prompt else ln, i
        while cmd.rstrip().endswith("\\") and i + 1 < len(lines):  # continuation lines
            i += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
        out.append(Command(first + start, cmd, []))
        i += 1
    for c in out:
        while c.shown and not c.shown[-1].strip():
            c.shown.pop()
    return out


# ---- comparing shown output --------------------------------------------------------------

NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:e[-+]?\d+)?", re.IGNORECASE)
WALL_CLOCK = re.compile(r"\b\d+(?:\.\d+)? s\b")  # "(0.7 s)", "quantized in 0.7 s": seconds, not "3 steps"


def _tokens(line: str):
    line = WALL_CLOCK.sub("<time> s", line.rstrip())
    parts, pos = [], 0
    for m in NUMBER.finditer(line):
        parts.append(line[pos : m.start()])
        parts.append(m.group())
        pos = m.end()
    parts.append(line[pos:])
    return parts


def _unit(shown: str) -> float | None:
    """One unit in the last digit shown; None for a plain integer (compared exactly)."""
    mant, _, exp = shown.lower().partition("e")
    if "." not in mant and not exp:
        return None
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    return 10.0 ** (int(exp or 0) - decimals)


NOISE = 1e-5  # figures below this in both lines are float32 rounding: they move with the CPU's kernels


def line_matches(shown: str, real: str) -> bool:
    a, b = _tokens(shown), _tokens(real)
    if len(a) != len(b):
        return False
    noise = False  # the last number pair was rounding-sized: a "(step N)" naming where it peaked is too
    for k, (x, y) in enumerate(zip(a, b)):
        if k % 2 == 0:
            if x != y:
                return False
            continue
        if abs(float(x)) < NOISE and abs(float(y)) < NOISE and "e" in x + y:
            noise = True
            continue
        if noise and a[k - 1].endswith("(step ") and x.isdigit() and y.isdigit():
            continue
        noise = False
        unit = _unit(x)
        if unit is None:
            if x.lstrip("+") != y.lstrip("+"):
                return False
        elif abs(float(x) - float(y)) > unit * 1.01:
            return False
    return True


def test_line_matches_within_the_precision_shown():
    assert line_matches(
        "rel-L2 5.4e-3 > 1e-4 (REF 0.1575 vs RUN 0.1554)", "rel-L2 5.45e-3 > 1e-4 (REF 0.1576 vs RUN 0.1554)"
    )
    assert not line_matches("rel-L2 5.4e-3 > 1e-4", "rel-L2 5.6e-3 > 1e-4")
    assert not line_matches("16/16 tokens agree", "15/16 tokens agree")
    assert not line_matches("kind q, position 0", "kind k, position 0")
    assert line_matches("wrote a.h5: 3 steps (0.2 s)", "wrote a.h5: 3 steps (41.7 s)")
    assert line_matches("quantized in 0.7 s", "quantized in 12 s")
    assert not line_matches("wrote a.h5: 3 steps (0.2 s)", "wrote a.h5: 4 steps (0.2 s)")
    assert not line_matches("L0 3.7e-7  L1 3.5e-7", "L0 3.7e-7  L1 3.5e-7  L2 3e-7")
    # rounding-sized figures (and the step where they peak) move with the CPU; real ones do not
    assert line_matches("KL mean 3.8e-15, max 4.9e-9 (step 2)", "KL mean 5.7e-15, max 7.1e-9 (step 0)")
    assert not line_matches("KL mean 3.8e-3, max 4.9e-3 (step 2)", "KL mean 3.8e-3, max 4.9e-3 (step 0)")
    assert not line_matches("rel-L2 1.3e-2 > 1e-4", "rel-L2 3e-6 > 1e-4")


# ---- running a document ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_bin(tmp_path_factory):
    """A folder whose `trace` runs the CLI forked from a warm server (None: the real one)."""
    if os.environ.get("GEMMA4_DOCS_REAL_TRACE"):
        yield None
        return
    d = tmp_path_factory.mktemp("trace-bin")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    srv = subprocess.Popen(
        [sys.executable, "-m", "tests.support.docs_trace_server", str(d / "s"), str(d)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert srv.stdout.readline().strip() == b"ready", "the docs' trace server did not start"
        yield d
    finally:
        srv.kill()
        srv.wait()


def _env(trace_bin) -> dict:
    env = dict(os.environ)
    path = [str(trace_bin)] if trace_bin else []
    env["PATH"] = os.pathsep.join([*path, str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(ROOT)
    env.pop("GEMMA4_TRACE_DEBUG", None)
    return env


def _document_cache(folder: Path) -> Path:
    """A document's artifact cache: its SHARED families are links to the suite's (docstring)."""
    suite = Path(os.environ["GEMMA4_TRACE_CACHE"])
    folder.mkdir()
    for family in SHARED:
        (suite / family).mkdir(parents=True, exist_ok=True)
        (folder / family).symlink_to(suite / family, target_is_directory=True)
    return folder


def _run_doc(path: Path, tmp: Path, trace_bin) -> int:
    for name in LINKED:
        (tmp / name).symlink_to(ROOT / name)
    env, ran, shortened = _env(trace_bin), 0, []
    env["GEMMA4_TRACE_CACHE"] = str(_document_cache(tmp / ".artifact-cache"))
    where = path.relative_to(ROOT)
    for _line_no, _lines, marker, commands in shell_blocks(path):
        if marker:
            continue
        if isinstance(commands, str):
            pytest.fail(commands)
        for c in commands:
            try:
                p = subprocess.run(
                    ["bash", "-c", c.cmd],
                    cwd=tmp,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=COMMAND_TIMEOUT,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                pytest.fail(f"{where}:{c.line_no}: `{c.cmd}` ran past {COMMAND_TIMEOUT} s")
            ran += 1
            said = f"\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
            diverged = (re.match(r"\s*trace\s+diff\b", c.cmd) and "first divergence" in p.stdout) or (
                re.match(r"\s*trace\s+sweep\b", c.cmd) and "DIVERGES" in p.stdout
            )
            refused = bool(c.shown) and c.shown[0].startswith("error: ")  # the doc shows a refusal: exit 2
            assert (
                (p.returncode == 0 and not refused)
                or (p.returncode == 1 and diverged)
                or (p.returncode == 2 and refused)
            ), f"{where}:{c.line_no}: `{c.cmd}` exited {p.returncode}{said}"
            real = (p.stdout or "".join(without_progress(p.stderr.splitlines(keepends=True)))).split("\n")
            shown_lines, cut = (
                (c.shown[:-1], True) if c.shown and c.shown[-1].strip() == SHORTENED else (c.shown, False)
            )
            for k, shown in enumerate(shown_lines):
                got = real[k] if k < len(real) else "<no more output>"
                assert line_matches(shown, got), (
                    f"{where}:{c.line_no + 1 + k}: `{c.cmd}` shows\n  {shown}\nbut printed\n  {got}{said}"
                )
            more = len([ln for ln in real if ln.strip()]) > len(shown_lines)
            if shown_lines and more != cut:  # shortened output ends in a `...` line, and only shortened output
                shortened.append(f"{where}:{c.line_no}: `{c.cmd}`" + (" prints more than shown" if more else ""))
    assert not shortened, "output shown shortened without a last `...` line, or `...` after all of it:\n" + "\n".join(
        shortened
    )
    return ran


DOCS_WITH_COMMANDS = [p for p in doc_files() if any(not marker for _, _, marker, _ in shell_blocks(p))]


@pytest.mark.parametrize("doc", DOCS_WITH_COMMANDS, ids=lambda p: p.name)
def test_doc_commands_run_with_their_shown_output(doc, tmp_path, trace_bin):
    assert _run_doc(doc, tmp_path, trace_bin) > 0


def test_every_exempt_block_says_why():
    problems = []
    for doc in doc_files():
        lines = doc.read_text().split("\n")
        marked = {m[0] for _, _, m, _ in shell_blocks(doc) if m}
        for _, _, m, _ in shell_blocks(doc):
            if m and len(m[1]) < 10:
                problems.append(f"{doc.name}:{m[0]}: a `not run` marker without its reason")
        for k, ln in enumerate(lines, 1):
            if MARKER_START.match(ln) and k not in marked:
                problems.append(f"{doc.name}:{k}: a `not run` marker that stands before no shell block")
    assert not problems, "\n".join(problems)


def test_every_block_that_runs_parses_into_commands():
    blocks = [(d, b) for d in doc_files() for b in shell_blocks(d) if not b[2]]
    errors = [b[3] for _, b in blocks if isinstance(b[3], str)]
    assert not errors, "\n".join(errors)
    assert sum(len(b[3]) for _, b in blocks) >= 40  # README and the docs show this many commands


def test_the_readme_lists_every_doc():
    """README.md's Documentation section names every page of docs/, a runtime's page through the
    runtime table (the registry's row links it)."""
    from gemma4_trace.replayer.runtimes.registry import RUNTIMES

    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("## Documentation") :] + " ".join(s.doc for s in RUNTIMES if s.doc)
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in listed]
    assert not missing, missing
