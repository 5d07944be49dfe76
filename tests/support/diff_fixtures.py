"""Deterministic candidate traces made from the goldens, and the `trace diff` output they give.

The JSON, text and HTML that `trace diff` printed for each case are checked in under
tests/data/diff/ (written by the diff code as it was before the typed-contracts refactor),
and tests/test_diff_json_stable.py asserts today's output is byte-identical.

No replay is involved: a candidate is a golden copied with numpy edits (seeded noise, a
flipped mask entry, a changed token), so the numbers do not depend on the CPU's kernels.
Paths in the output are stable because every case runs with the working folder set to a
scratch folder holding `ref.h5` (a byte copy of the golden) and the candidate, named by
relative path. Regenerate (only when the goldens or the report format change on purpose):

    .venv/bin/python -m tests.support.diff_fixtures --update
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from gemma4_trace.recorder import golden
from gemma4_trace.traces import TraceReader, TraceWriter
from gemma4_trace.traces import schema as S
from tests.support.cli import invoke

DATA = Path(__file__).resolve().parents[1] / "data" / "diff"


def copy_trace(src, dst, edit=None, mode=None, stop_after=None, omit=()):
    """Write `dst` as `src` with `edit(kind, layer, step, rows) -> rows` applied to every block."""
    with TraceReader(src) as r, TraceWriter(dst) as w:
        header = r.header()
        w.write_header(header.with_provenance(header.provenance.replace(mode=mode or header.provenance.mode)))
        present = [kl for kl in r.kinds_present() if kl[0] not in omit and kl not in omit]
        for step, (a, b) in enumerate(r.step_positions[:stop_after]):
            w.begin_step(range(a, b))
            for kind, layer in present:
                spec = S.KIND_BY_NAME[kind]
                if spec.encoder:  # an encoder tower's rows: all of them in the prefill
                    if step == 0:
                        rows = r.read(kind, layer)
                        rows = rows if edit is None else edit(kind, layer, step, rows.copy())
                        w.add(spec.name, rows, layer=layer, source_dtype=r.source_dtype(kind, layer), tower=spec.tower)
                    continue
                rows = r.read(
                    kind, layer, slice(step, step + 1) if S.KIND_BY_NAME[kind].index == "step" else slice(a, b)
                )
                if edit is not None:
                    rows = edit(kind, layer, step, rows.copy())
                w.add(
                    kind,
                    rows[0] if S.KIND_BY_NAME[kind].index == "step" else rows,
                    layer=layer,
                    source_dtype=r.source_dtype(kind, layer),
                )
            w.end_step()


def noise(kind, layer, from_step, rel, seed, head=None):
    """Seeded Gaussian noise of relative size `rel` on one (kind, layer) from one step on."""

    def edit(k, l, s, rows):
        if (k, l) != (kind, layer) or s < from_step:
            return rows
        rng = np.random.default_rng([seed, s])
        scale = np.float32(rel * np.sqrt(np.mean(rows.astype(np.float64) ** 2)))
        delta = (rng.standard_normal(rows.shape) * scale).astype(np.float32)
        if head is not None:  # one attention head only
            keep = np.zeros(rows.shape, dtype=bool)
            keep[:, head] = True
            delta[~keep] = 0
        return rows + delta

    return edit


def set_at(kind, layer, step, index, value):
    """Set one element (index into the step's rows) to `value`."""

    def edit(k, l, s, rows):
        if (k, l, s) == (kind, layer, step):
            rows[index] = value
        return rows

    return edit


def chain(*edits):
    def edit(k, l, s, rows):
        for e in edits:
            rows = e(k, l, s, rows)
        return rows

    return edit


def second_choice(name: str, step: int) -> int:
    """The token REF's logits rank second at `step` (a plausible wrong choice)."""
    with TraceReader(golden.golden_path(name)) as r:
        lg = r.read("logits", None, slice(step, step + 1))[0]
    return int(np.argsort(lg)[-2])


LOOSE_LAYER_OUT = (
    '[[rule]]\nkind = "layer_out"\nrel_l2 = 1e-2\n\n'
    '[[rule]]\nkind = "q"\nlayer = "4-"\nmax_abs = 0.05\nrel_l2 = false\n'
)

# name -> (golden, candidate builder kwargs (or a callable giving them), tolerances text or None)
CASES = {
    "match": ("window", lambda: {}, None),
    "numeric": (
        "window",
        lambda: {"edit": chain(noise("layer_out", 3, 5, 1e-3, seed=1), noise("q", 5, 7, 0.2, seed=2, head=1))},
        None,
    ),
    "numeric_tolerances": (
        "window",
        lambda: {"edit": chain(noise("layer_out", 3, 5, 1e-3, seed=1), noise("q", 5, 7, 0.2, seed=2, head=1))},
        LOOSE_LAYER_OUT,
    ),
    "drift_inherited": (
        "window",
        lambda: {
            "edit": chain(
                noise("layer_out", 1, 0, 5e-5, seed=3),
                noise("attn_out", 2, 0, 3e-4, seed=4),
                noise("layer_out", 2, 0, 2e-4, seed=5),
            )
        },
        None,
    ),
    "mask": ("short", lambda: {"edit": set_at("mask", 1, 1, (0, 8), False)}, None),
    "mask_future": ("window", lambda: {"edit": set_at("mask", 6, 3, (0, 20), True)}, None),
    "nonfinite": ("short", lambda: {"edit": set_at("final_hidden", None, 2, (0, 5), np.nan)}, None),
    "token": (
        "window",
        lambda: {"edit": set_at("token", None, 10, 0, second_choice("window", 10)), "mode": "teacher-forced"},
        None,
    ),
    "token_free_running": (
        "window",
        lambda: {
            "edit": chain(
                set_at("token", None, 6, 0, second_choice("window", 6)), noise("embeddings", None, 7, 0.5, seed=6)
            ),
            "mode": "free-running",
            "stop_after": 12,
        },
        None,
    ),
    "missing": ("short", lambda: {"omit": ("logits", ("attn_out", 2))}, None),
    "cosine": (
        "window",
        lambda: {"edit": noise("attn_out", 4, 2, 0.05, seed=9)},
        "[[rule]]\nrel_l2 = false\ncosine = 0.9999\n",
    ),
    "token_near_tie": (
        "short",
        lambda: {"edit": set_at("token", None, 1, 0, second_choice("short", 1))},
        "[tokens]\nnear_tie_margin = 20.0\n",
    ),
    "shape": ("short", lambda: {"edit": lambda k, l, s, rows: rows[..., :8] if (k, l) == ("k", 3) else rows}, None),
    "image_numeric": ("image", lambda: {"edit": noise("v", 0, 0, 3e-3, seed=8)}, None),
}
HTML_CASES = ("numeric", "mask", "token")


@contextlib.contextmanager
def _cwd(folder: Path):
    old = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


def run_case(name: str, folder: Path) -> dict[str, str]:
    """Build the case's traces in `folder` and return {suffix: output} of `trace diff`."""
    gold, build, tol = CASES[name]
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(golden.golden_path(gold), folder / "ref.h5")
    copy_trace(folder / "ref.h5", folder / "run.h5", **build())
    args = ["diff", "ref.h5", "run.h5"]
    if tol is not None:
        (folder / "tol.toml").write_text(tol)
        args += ["--tolerances", "tol.toml"]
    out = {}
    with _cwd(folder):
        for suffix, extra in (("json", ["--json"]), ("txt", [])):
            r = invoke(*args, *extra)
            assert r.exit_code in (0, 1), f"{name}: exit {r.exit_code}: {r.output}"
            out[suffix] = r.output
        if name in HTML_CASES:
            r = invoke(*args, "--report", "report.html")
            assert r.exit_code in (0, 1), f"{name}: exit {r.exit_code}: {r.output}"
            out["html"] = Path("report.html").read_text(encoding="utf-8")
    return out


def expected_path(name: str, suffix: str) -> Path:
    return DATA / f"{name}.{suffix}"


def update(scratch: Path) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        for suffix, text in run_case(name, scratch / name).items():
            expected_path(name, suffix).write_text(text, encoding="utf-8")
            print(f"wrote {expected_path(name, suffix)} ({len(text)} chars)")


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.support.diff_fixtures --update")
    with tempfile.TemporaryDirectory() as d:
        update(Path(d))
