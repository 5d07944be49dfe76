"""What installing the package does to other people's environments.

- `pip install .` (not editable) puts only gemma4_trace* into site-packages: no generic
  top-level `traces`, `diff`, `recorder`, `replayer` or `hf` next to users' modules.
- Our pytest plug-in is loaded in every pytest run on a machine where we are installed:
  a project with its own traces.py, diff.py and recorder.py still passes, under `pytest`
  and `python -m pytest` (which puts the project folder first on sys.path), and the
  plug-in still finds its own goldens.
- `pytest --update-golden` without `--golden-dir` refuses (one line) instead of rewriting
  the goldens inside the installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SOURCES = (
    "pyproject.toml",
    "README.md",
    "gemma4_trace",
    "traces",
    "diff",
    "recorder",
    "replayer",
    "hf",
    "importer",
    "analysis",
)

pytestmark = pytest.mark.slow  # pip installs and subprocess pytest runs; make test-fast skips it


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # only what is installed, never this checkout
    return env


def test_pip_install_puts_only_gemma4_trace_into_site_packages(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # a copy, so that building leaves no build/ or egg-info in the checkout
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(ROOT / name, src / name)
    target = tmp_path / "site-packages"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    # --target also receives the `trace` console script in bin/ (a venv's bin/, not site-packages)
    top = sorted(e.name for e in target.iterdir() if e.name != "bin")
    assert top and all(name.startswith("gemma4_trace") for name in top), top
    assert any(name.endswith(".dist-info") for name in top), top
    pkg = target / "gemma4_trace"
    for sub in ("traces", "diff", "recorder", "replayer", "replayer/runtimes", "hf", "importer", "analysis"):
        assert (pkg / sub / "__init__.py").is_file(), sub
    for model in ("tiny_model", "tiny_audio_model"):  # package data travels
        assert sorted(p.name for p in (pkg / "hf" / model).iterdir()) == sorted(
            p.name for p in (ROOT / "hf" / model).iterdir()
        )
    assert not (pkg / "recorder" / "tiny_model").exists()
    assert sorted(p.name for p in (pkg / "traces" / "golden").glob("*.h5")) == [
        "audio.h5",
        "eos.h5",
        "image.h5",
        "short.h5",
        "two_images.h5",
        "window.h5",
    ]


# a user's project whose module names are the generic ones we used to install
USER_MODULES = {
    "traces.py": "def load(name):\n    return f'user traces {name}'\n",
    "diff.py": "def load(name):\n    return f'user diff {name}'\n",
    "recorder.py": "def load(name):\n    return f'user recorder {name}'\n",
}
USER_TEST = """
import diff
import recorder
import traces


def test_own_modules():
    assert traces.load("a") == "user traces a"
    assert diff.load("b") == "user diff b"
    assert recorder.load("c") == "user recorder c"


def test_our_plugin_is_loaded_and_finds_its_goldens(pytestconfig, gemma4_golden):
    assert pytestconfig.pluginmanager.hasplugin("gemma4_trace")
    assert gemma4_golden.folder == GOLDEN_DIR and len(gemma4_golden.paths) == 6
"""


@pytest.fixture
def user_project(tmp_path):
    from gemma4_trace.recorder.golden import GOLDEN_DIR

    for name, text in USER_MODULES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "test_user.py").write_text(
        f"from pathlib import Path\n\nGOLDEN_DIR = Path({str(GOLDEN_DIR)!r})\n" + USER_TEST
    )
    return tmp_path


@pytest.mark.parametrize(
    "command", [[str(BIN / "pytest")], [sys.executable, "-m", "pytest"]], ids=["pytest", "python -m pytest"]
)
def test_a_project_with_its_own_traces_diff_recorder_modules_passes(user_project, command):
    p = subprocess.run(
        [*command, "-q", "-p", "no:cacheprovider"],
        cwd=user_project,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout + p.stderr


def test_update_golden_without_golden_dir_refuses(user_project):
    from gemma4_trace.recorder.golden import GOLDEN_DIR

    before = {p.name: p.stat().st_mtime_ns for p in GOLDEN_DIR.iterdir()}
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--update-golden"],
        cwd=user_project,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert p.returncode == pytest.ExitCode.USAGE_ERROR, p.stdout + p.stderr
    errors = [line for line in (p.stdout + p.stderr).splitlines() if "--update-golden" in line]
    assert len(errors) == 1 and "--golden-dir" in errors[0], p.stdout + p.stderr
    assert {p.name: p.stat().st_mtime_ns for p in GOLDEN_DIR.iterdir()} == before


def test_plugin_imports_nothing_of_ours_or_heavy_at_load(tmp_path):
    code = (
        "import sys\nbefore = set(sys.modules)\nimport gemma4_trace.pytest_plugin\n"
        "new = {m.split('.')[0] if not m.startswith('gemma4_trace') else m for m in set(sys.modules) - before}\n"
        "print(sorted(new & {'gemma4_trace', 'gemma4_trace.pytest_plugin', 'gemma4_trace.traces', 'gemma4_trace.hf',\n"
        "    'gemma4_trace.recorder', 'gemma4_trace.diff', 'h5py', 'numpy', 'torch', 'transformers'}))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=120
    )
    assert p.stdout.strip() == "['gemma4_trace', 'gemma4_trace.pytest_plugin']", p.stdout + p.stderr


def test_xdist_workers_share_the_cores(tmp_path):
    """Under `pytest -n 2` each worker's torch gets cores // 2 threads (not one per core each) in a
    session that uses the golden fixtures; a session that does not keeps torch's own choice."""
    for name, arg in (("golden", "gemma4_golden"), ("plain", "")):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, torch\n"
            f"def test_a({arg}): open(f'threads-{{os.environ[\"PYTEST_XDIST_WORKER\"]}}-a', "
            "'w').write(str(torch.get_num_threads()))\n"
            f"def test_b({arg}): open(f'threads-{{os.environ[\"PYTEST_XDIST_WORKER\"]}}-b', "
            "'w').write(str(torch.get_num_threads()))\n"
        )
    env = {k: v for k, v in _env().items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}

    def threads_seen(test_file, *extra):
        for f in tmp_path.glob("threads-*"):
            f.unlink()
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, "-n", "2", test_file],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        files = list(tmp_path.glob("threads-*"))
        assert len(files) == 2, files
        return {f.read_text() for f in files}

    shared = str(max(1, len(os.sched_getaffinity(0)) // 2))
    default = threads_seen("test_plain.py", "-p", "no:gemma4_trace")  # torch's own choice in each worker
    if default == {shared}:
        pytest.skip(f"torch already picks {shared} thread(s) per worker here: nothing to tell apart")
    assert threads_seen("test_plain.py") == default  # installed, its fixtures unused: no thread setting
    assert threads_seen("test_golden.py") == {shared}, default
