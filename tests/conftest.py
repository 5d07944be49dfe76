import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True, scope="session")
def _private_artifact_cache(tmp_path_factory):
    """Converted and exported artifacts (GGUF files, ...) go to a cache of this test session, never
    into the user's own cache folder (some tests damage a cached file on purpose)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GEMMA4_TRACE_CACHE", str(tmp_path_factory.mktemp("artifact-cache")))
    yield
    mp.undo()
