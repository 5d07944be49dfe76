"""pytest plug-in (entry point `gemma4_trace`): check a runtime against golden traces.

    def test_my_runtime(gemma4_golden):
        gemma4_golden.check("my_pkg.runtime:create")

`check` replays every golden trace through the runtime (teacher-forced and free-running
by default), diffs each against its golden, and fails with the first divergence.

One pytest item per golden x mode (so `pytest -n auto` with pytest-xdist spreads them
over cores and machines): ask for the `gemma4_golden_case` fixture, which this plug-in
parametrizes over every golden x mode (ids like `short-teacher-forced`):

    def test_my_runtime(gemma4_golden_case):
        gemma4_golden_case.check("my_pkg.runtime:create")

`@pytest.mark.gemma4_modes("teacher-forced")` on such a test limits the modes;
`gemma4_golden_cases(folder, modes)` lists the same cases for a parametrize of your own.
Options: `--golden-dir DIR` (default: the goldens shipped with this package),
`--golden-model DIR` (the checkpoint they were recorded with; default: the embedded
model), `--update-golden` (re-record every golden in --golden-dir with HF from its own
inputs first; refused without --golden-dir, so the installed package is never rewritten).

pytest loads this module in every run on a machine where the package is installed, so
it imports nothing but pytest at load: our modules are imported (by their namespaced
names only) when a fixture runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("gemma4-trace")
    group.addoption(
        "--update-golden",
        action="store_true",
        help="re-record the golden traces in --golden-dir with HF before checking",
    )
    group.addoption("--golden-dir", default=None, help="folder of golden *.h5 traces [default: the packaged goldens]")
    group.addoption("--golden-model", default=None, help="model folder the goldens were recorded with")


def pytest_configure(config):
    config.addinivalue_line("markers", "gemma4_modes(*modes): replay modes of the gemma4_golden_case items")
    if config.getoption("--update-golden") and not config.getoption("--golden-dir"):
        raise pytest.UsageError(
            "--update-golden rewrites golden traces: pass the folder to rewrite with --golden-dir DIR "
            "(the goldens shipped inside the package are never rewritten)"
        )


FIXTURES = ("gemma4_golden", "gemma4_golden_case")


def pytest_collection_modifyitems(session, config, items):
    """Only a session that runs this plug-in's fixtures gets its thread setting: a project that
    merely has the package installed keeps its own."""
    if any(name in FIXTURES for item in items for name in getattr(item, "fixturenames", ())):
        _share_cores_between_workers()


def _share_cores_between_workers() -> None:
    """In a pytest-xdist worker, give torch cores // workers threads. Its default, a thread per
    core in every worker, oversubscribes the cores (docs/benchmarks.md: -n 2 was slower than
    -n 0 on 2 cores). A user's own OMP_NUM_THREADS is left alone."""
    import os
    import sys

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not workers.isdigit() or int(workers) < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read when torch is imported
    torch = sys.modules.get("torch")
    if torch is not None:  # already imported (by a conftest): set it directly
        torch.set_num_threads(threads)


def _safe(text: str) -> str:
    """File names and trace text as one printable line (as the CLI prints them): no terminal escapes."""
    from gemma4_trace.traces.errors import one_line

    return one_line(text)


def golden_paths(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).glob("*.h5") if not p.name.startswith("."))


def _default_golden_dir(config=None) -> Path:
    folder = config.getoption("--golden-dir") if config is not None else None
    if folder is None:
        from gemma4_trace.recorder import golden

        folder = golden.GOLDEN_DIR
    return Path(folder)


def _replay_modes() -> tuple:
    from gemma4_trace.replayer.core import MODES

    return MODES


def gemma4_golden_cases(folder=None, modes=None, config=None) -> list:
    """pytest.param((golden path, mode), id="name-mode") for every golden x mode.

    folder: default --golden-dir (with `config`) or the packaged goldens; modes: default every
    replay mode.
    """
    folder = _default_golden_dir(config) if folder is None else Path(folder)
    return [
        pytest.param((p, m), id=_safe(f"{p.stem}-{m}"))
        for p in golden_paths(folder)
        for m in (modes or _replay_modes())
    ]


def pytest_generate_tests(metafunc):
    if "gemma4_golden_case" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("gemma4_modes")
    cases = gemma4_golden_cases(modes=marker.args if marker else None, config=metafunc.config)
    if not cases:
        cases = [
            pytest.param(
                None, id="no-goldens", marks=pytest.mark.skip(reason="no golden traces (*.h5) in --golden-dir")
            )
        ]
    metafunc.parametrize("gemma4_golden_case", cases, indirect=True)


class GoldenCase:
    """One golden x mode: `check(runtime)` replays it and fails with the first divergence."""

    def __init__(self, path: Path, mode: str, model_dir, tmp: Path):
        self.path, self.mode, self.model_dir, self.tmp = Path(path), mode, model_dir, tmp

    def check(self, runtime: str = "static", tolerances=None):
        from gemma4_trace.diff import diff_traces, format_text
        from gemma4_trace.replayer.replay import replay_trace

        out = self.tmp / f"{self.path.stem}.{self.mode}.h5"
        replay_trace(self.path, out, model_dir=self.model_dir, runtime=runtime, mode=self.mode, force=True)
        res = diff_traces(self.path, out, tolerances)
        if not res.match:
            first = format_text(res).splitlines()[0]
            pytest.fail(_safe(f"runtime diverges from golden {self.path.name} ({self.mode}): {first}"), pytrace=False)
        return res


class GoldenChecker:
    def __init__(self, folder: Path, model_dir, update: bool, tmp: Path):
        self.folder, self.model_dir, self.tmp = Path(folder), model_dir, tmp
        self.paths = golden_paths(self.folder)
        if not self.paths:
            pytest.fail(_safe(f"no golden traces (*.h5) in {self.folder}"), pytrace=False)
        if update:
            self.update()

    def update(self) -> None:
        """Re-record each golden from its own inputs with the installed transformers; every
        golden's inputs are checked before the first is rewritten."""
        from gemma4_trace.recorder.rerecord import check_extra_inputs, rerecord_trace
        from gemma4_trace.traces import TraceReader
        from gemma4_trace.traces.errors import TraceToolError, one_line

        try:
            for p in self.paths:
                with TraceReader(p) as r:
                    check_extra_inputs(r)
            for p in self.paths:
                rerecord_trace(p, p, model_dir=self.model_dir, force=True)
        except TraceToolError as e:
            pytest.fail(f"--update-golden: {one_line(e)}", pytrace=False)

    def check(self, runtime: str = "static", modes=None, tolerances=None):
        """Replay every golden through `runtime` in `modes` (default: every replay mode)
        and assert each matches; return the diff results."""
        from gemma4_trace.diff import diff_traces, format_text
        from gemma4_trace.replayer.core import MODES
        from gemma4_trace.replayer.replay import replay_trace

        results, failures = [], []
        for p in self.paths:
            for mode in modes or MODES:
                out = self.tmp / f"{p.stem}.{mode}.h5"
                replay_trace(p, out, model_dir=self.model_dir, runtime=runtime, mode=mode, force=True)
                res = diff_traces(p, out, tolerances)
                results.append(res)
                if not res.match:
                    first = format_text(res).splitlines()[0]
                    failures.append(_safe(f"{p.name} ({mode}): {first}"))
        if failures:
            pytest.fail("runtime diverges from golden traces:\n  " + "\n  ".join(failures), pytrace=False)
        return results


@pytest.fixture
def gemma4_golden_case(request, tmp_path) -> GoldenCase:
    """One golden x mode (parametrized by this plug-in): `.check(runtime)`."""
    path, mode = request.param
    cfg = request.config
    if cfg.getoption("--update-golden"):
        pytest.fail("--update-golden rewrites goldens once, through the gemma4_golden fixture, not per case")
    return GoldenCase(path, mode, cfg.getoption("--golden-model"), tmp_path)


@pytest.fixture
def gemma4_golden(request, tmp_path) -> GoldenChecker:
    """Checks a runtime (`'static'` or `'MODULE:FACTORY'`) against golden traces."""
    cfg = request.config
    return GoldenChecker(
        _default_golden_dir(cfg), cfg.getoption("--golden-model"), cfg.getoption("--update-golden"), tmp_path
    )
