"""The diff's worker processes (diff/parallel.py) give the same result as the in-process pass.

Every fixture case (tests/data/diff/) is diffed through two workers and must print the same
bytes; with blocks of a few KB (many blocks per tensor, the early stop and the row limit at work)
the pooled JSON must equal the in-process JSON; and the faster exact arithmetic (float64 row
sums, sub-blocked logit metrics) equals the plain numpy forms bit for bit."""

import numpy as np
import pytest

from gemma4_trace.diff import blocks, parallel
from gemma4_trace.diff.core import compare
from gemma4_trace.diff.logits import _step_metrics, step_metrics
from gemma4_trace.diff.metrics import row_sums
from gemma4_trace.recorder import golden
from tests.support.cli import invoke, one_line_error
from tests.support.diff_fixtures import CASES, copy_trace, expected_path, noise, run_case, set_at


@pytest.mark.parametrize("name", ["numeric", "mask", "nonfinite", "token", "shape", "image_numeric", "missing"])
def test_fixture_cases_through_workers(name, tmp_path, monkeypatch):
    monkeypatch.setenv(parallel.ENV_WORKERS, "2")
    assert name in CASES
    for suffix, text in run_case(name, tmp_path).items():
        assert text == expected_path(name, suffix).read_text(encoding="utf-8"), f"{name}.{suffix} changed"


@pytest.mark.parametrize("method", ["fork", "forkserver"])
@pytest.mark.parametrize("full", [False, True])
def test_small_blocks_pooled_equals_in_process(method, full, tmp_path, monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_BYTES", 2048)  # many blocks per tensor (fork: the workers see it)
    monkeypatch.setattr(parallel, "start_method", lambda: method)
    ref = golden.golden_path("window")
    run = tmp_path / "run.h5"
    plant, drift = set_at("mask", 6, 3, (0, 20), True), noise("q", 5, 7, 0.2, seed=2)
    edit = lambda k, l, s, rows: plant(k, l, s, drift(k, l, s, rows))  # noqa: E731
    copy_trace(ref, run, edit=edit)
    monkeypatch.setenv(parallel.ENV_WORKERS, "0")
    alone = compare(ref, run, full=full).to_json()
    if method == "forkserver":  # a fork server's workers keep the default blocks: compare with those
        monkeypatch.setattr(blocks, "BLOCK_BYTES", 16 << 20)
        alone = compare(ref, run, full=full).to_json()
    monkeypatch.setenv(parallel.ENV_WORKERS, "3")
    assert compare(ref, run, full=full).to_json() == alone


def test_bad_worker_count_is_one_line(monkeypatch):
    path = golden.golden_path("short")
    r = invoke("diff", path, path, env={parallel.ENV_WORKERS: "many"})
    one_line_error(r, parallel.ENV_WORKERS)


def test_row_sums_equal_einsum_bit_for_bit():
    rng = np.random.default_rng(0)
    for m in (1, 7, 256, 1536, 4096, np.getbufsize(), np.getbufsize() + 1, 32768):
        n = max(1, 400_000 // m)
        a = (rng.standard_normal((n, m)) * 37).astype(np.float32)
        b = a + (rng.standard_normal((n, m)) * 1e-3).astype(np.float32)
        s = row_sums(a, b)
        d = b - a
        for got, (x, y) in zip((s.nd, s.na, s.nb), ((d, d), (a, a), (b, b))):
            assert got.tobytes() == np.einsum("ij,ij->i", x, y, dtype=np.float64).tobytes(), m


def test_step_metrics_sub_blocks_equal_one_block():
    rng = np.random.default_rng(1)
    a = np.round(rng.standard_normal((40, 20000)).astype(np.float32) * 8) / 8  # ties
    b = a + np.round(rng.standard_normal(a.shape).astype(np.float32) * 2) / 8
    a[3, 9] = np.inf
    for got, want in zip(step_metrics(a, b), _step_metrics(a, b)):
        assert got.tobytes() == want.tobytes()
