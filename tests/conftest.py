import os
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
