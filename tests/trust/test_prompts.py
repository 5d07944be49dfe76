"""A prompt is untrusted input, on the command line (`trace record --prompt`) or in a prompts file
(`trace sweep`): past the model's positions it is one line and exit 2, refused before it is
tokenized when no tokenization could fit; a prompts file is a bounded regular file whose images are
regular files inside its own folder, its ids hold no control character, and no sweep output ever
replaces it."""

from __future__ import annotations

import os

import pytest

from tests.support import tiny_models
from tests.support.cli import invoke, one_line_error


# ---------------------------------------------------------------- past the model's positions
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


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(tmp_path):
    """The embedded model: 2048 positions, no token longer than 16 bytes; a 10 MB line took minutes
    in the tokenizer before the token count refused it (whose line says "the prompt has N tokens")."""
    r = invoke("record", "--prompt", "a" * (2048 * 16 + 1), "--max-new-tokens", "1", "-o", tmp_path / "a.h5")
    one_line_error(r, "the prompt is 32769 bytes: at least 2049 tokens", "2048 positions", out=tmp_path / "a.h5")
    r = invoke("record", "--prompt", "a" * 2048 * 16, "--max-new-tokens", "1", "-o", tmp_path / "b.h5")
    one_line_error(r, "the prompt has", "tokens, more than the model's 2048 positions", out=tmp_path / "b.h5")


# ---------------------------------------------------------------- prompts files
def test_a_prompts_file_over_16_mib_is_refused_unread(tmp_path):
    prompts = tmp_path / "p.txt"
    with open(prompts, "wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: a read would be quick; the size alone refuses it
    one_line_error(invoke("sweep", prompts, "--runtime", "static", "-o", tmp_path / "s"), "more than the 16777216")


@pytest.mark.slow  # a sweep; make test-fast skips it
def test_prompt_files_read_only_what_they_name_inside_their_folder(tmp_path):
    """A prompts file is untrusted: its images must be regular files inside its own folder (links
    followed), and the file itself a bounded regular file; each refusal is one line, before work."""
    import os

    from gemma4_trace.hf.model import embedded_model_dir

    d = tmp_path / "set"
    d.mkdir()
    outside = tmp_path / "outside.png"
    outside.write_bytes((embedded_model_dir() / "example.png").read_bytes())
    (d / "link.png").symlink_to(outside)
    (d / "folder.png").mkdir()
    cases = {
        '{"text": "a", "image": "../outside.png"}': "outside the prompts file's folder",
        f'{{"text": "a", "image": "{outside}"}}': "outside the prompts file's folder",
        '{"text": "a", "image": "link.png"}': "outside the prompts file's folder",
        '{"text": "a", "image": "folder.png"}': "not a regular file",
    }
    for line, needle in cases.items():
        (d / "p.jsonl").write_text(line + "\n")
        one_line_error(invoke("sweep", d / "p.jsonl", "--runtime", "static", "-o", tmp_path / "out"), "line 1", needle)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block for ever
    one_line_error(invoke("sweep", fifo, "--runtime", "static", "-o", tmp_path / "out"), "not a regular file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["abc\n", "abc\r", "a\x1bb", "ab\u2028"])
def test_a_prompt_id_with_a_control_character_is_refused(tmp_path, bad):
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": bad, "text": "Hello!"}) + "\n")
    r = invoke("sweep", prompts, "--runtime", "static", "-o", tmp_path / "s")
    one_line_error(r, "id")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("where", ["summary.json", "summary.html", "prompts/mine.txt", "link"])
def test_a_sweep_never_writes_over_its_prompts_file(tmp_path, where):
    out = tmp_path / "s"
    (out / "prompts").mkdir(parents=True)
    prompts = out / where if where != "link" else tmp_path / "link.txt"
    if where == "link":
        (out / "summary.json").write_text("Hello!\n")
        os.symlink(out / "summary.json", prompts)
    else:
        prompts.write_text("Hello!\n")
    r = invoke("sweep", prompts, "--runtime", "static", "--max-new-tokens", "2", "-o", out)
    one_line_error(r, "would replace the prompts file")
    assert prompts.read_text() == "Hello!\n"
