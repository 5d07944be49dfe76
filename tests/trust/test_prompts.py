"""Bad sizes are one line and exit 2: prompts past the model's positions, --max-seq too small
or past the model's positions."""

from __future__ import annotations

import pytest

from gemma4_trace.recorder import golden
from tests import tiny_models
from tests.support import invoke, one_line_error


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """The tiny base variant with only 16 positions."""
    return tiny_models.build(tmp_path_factory.mktemp("m16") / "model", "base", max_position_embeddings=16)


def test_prompt_longer_than_max_positions(short_model, tmp_path):
    ids = ",".join(str(3 + i) for i in range(20))
    res = invoke("record", "--model", str(short_model), "--input-ids", ids, "-o", str(tmp_path / "r.h5"))
    one_line_error(res, "20 tokens", "16 positions")
    assert not (tmp_path / "r.h5").exists()


def test_prompt_plus_new_tokens_past_max_positions(short_model, tmp_path):
    ids = ",".join(str(3 + i) for i in range(10))
    res = invoke(
        "record", "--model", str(short_model), "--input-ids", ids, "--max-new-tokens", "7", "-o", str(tmp_path / "r.h5")
    )
    one_line_error(res, "= 17", "16 positions")
    res = invoke(
        "record", "--model", str(short_model), "--input-ids", ids, "--max-new-tokens", "6", "-o", str(tmp_path / "r.h5")
    )
    assert res.exit_code == 0, res.output  # exactly 16 fits


@pytest.mark.parametrize(
    "max_seq, needle",
    [("8", "exceeds --max-seq 8"), ("15", "exceeds --max-seq 15"), ("4096", "4096 exceeds the model's 2048 positions")],
)
def test_replay_max_seq(tmp_path, max_seq, needle):
    # the short golden: 13 prompt tokens + 3 new tokens = 16; the embedded model has 2048 positions
    res = invoke("replay", str(golden.golden_path("short")), "--max-seq", max_seq, "-o", str(tmp_path / "run.h5"))
    one_line_error(res, needle)
    assert not (tmp_path / "run.h5").exists()
