import os
import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
# the built artifacts (ONNX graphs, .pte programs, GGUF files) the suite builds, kept between runs: they
# are keyed by content (the model's bytes, the shapes, the builders' versions and the code they come
# from), so a second run builds none of them; GEMMA4_TRACE_TEST_CACHE chooses another folder
TEST_CACHE = Path(os.environ.get("GEMMA4_TRACE_TEST_CACHE") or ROOT / ".cache" / "test-artifacts")


@pytest.fixture(autouse=True, scope="session")
def _test_artifact_cache():
    """Artifacts go to the suite's own cache, never into the user's (tests that damage or plant a
    cached file use a cache folder of their own)."""
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("GEMMA4_TRACE_CACHE", str(TEST_CACHE))
    yield
    mp.undo()


SLOW_MODULE = re.compile(r"^pytestmark = pytest\.mark\.slow\b", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    """Under `-m "not slow"` (make test-fast) a test module marked slow as a whole is not imported at
    all: every test in it would be deselected, and importing it costs its engines' imports in each
    worker (litert-torch's TensorFlow alone about 4 s)."""
    if config.option.markexpr.replace(" ", "") != "notslow":
        return None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return bool(SLOW_MODULE.search(collection_path.read_text())) or None
    return None


def pytest_terminal_summary(terminalreporter):
    """Without a Chromium the browser check (tests/test_browser.py) did not run: say so in one line."""
    from tests.support.browser import find_chromium

    if find_chromium() is None and any(
        "test_browser.py" in r.nodeid for r in terminalreporter.stats.get("skipped", [])
    ):
        terminalreporter.write_line(
            "browser check: did not run, no Chromium found (apt-get install chromium, or set CHROMIUM=PATH)"
        )
