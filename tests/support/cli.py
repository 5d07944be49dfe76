"""What the tests share: the one way to run the CLI in-process, the one check of the project's
promise for bad input (exit 2 and exactly one line `error: ...`, docs/robustness.md), and the
site of a divergence or row as a tuple."""

from __future__ import annotations

import os
import re

from click.testing import CliRunner

from gemma4_trace.cli import main

# transformers imports torchao when it is installed (the `quant` extra), which logs these on first
# import in a process: third-party start-up noise, not ours
THIRD_PARTY_NOISE = ("Failed to load ", "Warning: Detected no triton")

SITE = ("step", "layer", "kind", "position")


def invoke(*args, env=None, **kw):
    """`trace ARGS...` run in-process (each argument str()-ed); stdout and stderr apart on the result."""
    return CliRunner().invoke(main, [str(a) for a in args], env=env, **kw)


def ours(text: str) -> str:
    """`text` without the lines of THIRD_PARTY_NOISE."""
    return "".join(
        ln
        for ln in text.splitlines(keepends=True)
        if not ln.startswith(THIRD_PARTY_NOISE) and "torch/utils/_pytree.py" not in ln
    )


# a line of the progress a log gets (gemma4_trace/progress.py): "replaying: loading the model: 3.5 s",
# "replaying: lowering ... 2/8 steps, 31 s"
PROGRESS_LINE = re.compile(r"(?!error:)[a-z][a-z0-9 _.-]*: .+ \d+(\.\d)? s\n")


def without_progress(lines: list[str]) -> list[str]:
    """`lines` (stderr's, split) without the progress lines of the phases a run got through."""
    return [ln for ln in lines if not PROGRESS_LINE.fullmatch(ln.rstrip("\n") + "\n")]


def one_line_error(r, *needles, out=None) -> str:
    """Assert the answer to bad input: exit 2, nothing on stdout, exactly one error line on stderr
    that starts with 'error: ' and says something, ends in a newline and holds every needle
    (str()-ed), after nothing but the progress lines of the phases the run got through; no
    traceback, no 'internal error', no escape codes anywhere (third-party start-up noise set
    aside, see `ours`). With `out`, nothing was written there (nor a partial file beside it). `r`
    is a click result or a subprocess.CompletedProcess (text mode). Returns the line."""
    code = r.exit_code if hasattr(r, "exit_code") else r.returncode
    stdout, stderr = ours(r.stdout), ours(r.stderr)
    text = stdout + stderr
    assert code == 2, (code, text)
    assert "Traceback" not in text and "internal error" not in text and "\x1b" not in text, text
    assert stdout == "", text
    lines = stderr.splitlines(keepends=True)
    while len(lines) > 1 and PROGRESS_LINE.fullmatch(lines[0]):
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].endswith("\n"), text
    line = lines[0].rstrip("\n")
    assert line.startswith("error: ") and line[len("error: ") :].strip(), text
    for n in needles:
        assert str(n) in line, (n, line)
    if out is not None:
        assert not os.path.exists(out), out
        folder = os.path.dirname(out) or "."
        assert not [p for p in os.listdir(folder) if p.startswith(".trace-partial")], os.listdir(folder)
    return line


def site_of(d, *fields) -> tuple:
    """The values of `fields` (default step, layer, kind, position) of a divergence, row or rule:
    a dict (the JSON) or an object (the typed result)."""
    return tuple(d[f] if isinstance(d, dict) else getattr(d, f) for f in fields or SITE)


def plant_gguf(model_dir=None, write=None, **how):
    """Put a GGUF in the artifact cache (GEMMA4_TRACE_CACHE) as the F32 conversion of the model
    (the embedded one by default), where a replay takes it: written by the project's writer with
    `how` (write_f32's mutate= / metadata=: a fault planted on purpose), or by write(path). The
    entry is a real one (its manifest holds the file's hash), so it is used, not rebuilt. Returns
    the file's path."""
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.artifacts import artifact_folder
    from gemma4_trace.replayer.runtimes.llamacpp import gguf_writer as GW
    from gemma4_trace.replayer.runtimes.llamacpp.runtime import GGUF_NAME, conversion_key

    loaded = load_model(model_dir)
    art = artifact_folder(
        "gguf",
        conversion_key(loaded, "F32"),
        lambda folder: write(folder / GGUF_NAME) if write else GW.write_f32(loaded, folder / GGUF_NAME, **how),
        say=None,
    )
    assert art.note != "cached", "plant into an empty cache: this one already holds the conversion"
    return art.path / GGUF_NAME


def float_differences(a, b) -> tuple[float, int]:
    """Two open TraceReaders, over the (kind, layer) pairs b holds: the worst per-row rel-L2 of
    b's float tensors against a's and how many of them differ at all; masks and tokens must be
    equal, every shape the same."""
    import numpy as np

    worst, differ = 0.0, 0
    for kind, layer in b.kinds_present():
        x, y = a.read(kind, layer), b.read(kind, layer)
        assert x.shape == y.shape, (kind, layer)
        if x.dtype.kind != "f":
            assert np.array_equal(x, y), (kind, layer)
            continue
        x, y = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1)
        rel = np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)
        worst, differ = max(worst, rel.max()), differ + bool(rel.max() > 0)
    return worst, differ


def same_figures(real: str, shown: str, rounding: float = 1e-6) -> bool:
    """A printed line against the one a doc shows: the same words, numbers within 10%, or both under
    `rounding` (float32 rounding differs from one CPU to another)."""
    num = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
    if num.sub("#", real) != num.sub("#", shown):
        return False
    pairs = zip(map(float, num.findall(real)), map(float, num.findall(shown)))
    return all(abs(a - b) <= 0.1 * abs(b) or max(a, b) < rounding for a, b in pairs)
