"""`trace sweep --ray` on a local Ray cluster started here (2 CPUs): the same per-prompt numbers and
aggregates as --workers 1, whether the tasks write DIR themselves (shared storage) or return their files."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import invoke
from tests.test_sweep import subset_file

pytestmark = pytest.mark.slow  # a record, replays and a diff per prompt; make test-fast skips it

ray = pytest.importorskip("ray")

IDS = ("short-01", "ids-01")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _results(out):
    summary = json.loads((out / "summary.json").read_text())
    prompts = {p.name: json.loads(p.read_text()) for p in sorted((out / "prompts").glob("*.json"))}
    return summary, prompts


def test_ray_gives_the_numbers_of_one_worker(cluster, tmp_path):
    env = {"GEMMA4_TRACE_CACHE": str(tmp_path / "cache")}
    prompts = subset_file(tmp_path, IDS)
    args = ["sweep", prompts, "--runtime", "static-w8", "--max-new-tokens", 3]
    one = invoke(*args, "-o", tmp_path / "one", env=env)
    assert one.exit_code in (0, 1), one.output
    shared = invoke(*args, "--ray", "auto", "-o", tmp_path / "shared", env=env)
    assert shared.exit_code == one.exit_code, shared.output
    returned = invoke(*args, "--ray", "auto", "--no-shared-dir", "-o", tmp_path / "returned", env=env)
    assert returned.exit_code == one.exit_code, returned.output
    expected = _results(tmp_path / "one")
    assert len(expected[1]) == len(IDS)
    for out in ("shared", "returned"):
        assert _results(tmp_path / out) == expected, out
        for pid in IDS:
            assert (tmp_path / out / "prompts" / f"{pid}.html").is_file()
        assert not (tmp_path / out / ".sweep-token").exists()
