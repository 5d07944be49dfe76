"""`trace replay` end to end: record HF with the recorder, replay, compare the traces.

Bound: per-position rel-L2 <= 5e-5 for every float kind (float32; measured <= 1e-5),
masks exactly (the candidate's extra key columns up to max_seq all False), tokens exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_trace.hf.model import DEMO_IMAGE, DEMO_IMAGE_PROMPT, DEMO_PROMPT, embedded_model_dir
from gemma4_trace.recorder.record import record_trace
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.support import tiny_models
from tests.support.cli import invoke, one_line_error

REL = 5e-5
PROMPT = [2, 5, 9, 17, 33, 4, 8, 60, 61, 62, 11]  # 11 tokens, window 4: crossed several times


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    cache = {}

    def get(variant="base", max_new_tokens=12, prompt=tuple(PROMPT)):
        key = (variant, max_new_tokens, prompt)
        if key not in cache:
            d = tmp_path_factory.mktemp(variant)
            model = tiny_models.build(d / "model", variant)
            ref = d / "ref.h5"
            record_trace(model, ref, input_ids=list(prompt), max_new_tokens=max_new_tokens)
            cache[key] = (model, ref)
        return cache[key]

    return get


def compare(ref_path, run_path, same_kinds=True):
    with TraceReader(ref_path) as a, TraceReader(run_path) as b:
        assert b.provenance["runtime"] != a.provenance["runtime"]
        assert a.step_positions == b.step_positions
        assert list(a.prompt_ids) == list(b.prompt_ids) and a.eos_token_ids == b.eos_token_ids
        if same_kinds:
            assert b.kinds_present() == a.kinds_present()
        for kind, layer in b.kinds_present():
            x, y = a.read(kind, layer), b.read(kind, layer)
            if kind == "mask":
                w = x.shape[1]
                assert not y[:, w:].any(), f"layer {layer}: a never-written slot is visible"
                assert np.array_equal(x, y[:, :w]), f"mask layer {layer}"
            elif kind == "token":
                assert np.array_equal(x, y)
            else:
                x, y = x.reshape(len(x), -1), y.reshape(len(y), -1)
                rel = np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)
                assert rel.max() <= REL, f"{kind} layer {layer}: rel-L2 {rel.max():.2e} at row {rel.argmax()}"


@pytest.mark.parametrize("variant", sorted(tiny_models.VARIANTS))
def test_teacher_forced_matches_reference(recorded, tmp_path, variant):
    model, ref = recorded(variant)
    run = tmp_path / "run.h5"
    summary = replay_trace(ref, run, model_dir=model)
    assert "12/12 tokens agree" in summary
    compare(ref, run)
    with TraceReader(run) as r:
        assert r.mode == "teacher-forced" and r.provenance["runtime"] == "static"
        assert r.read("mask", 0).shape[1] == 24  # default max_seq: 11 + 12 rounded up to 8


def test_free_running_fills_max_seq(recorded, tmp_path):
    # prompt = max_seq - max_new_tokens: the last decode step writes slot max_seq - 2
    model, ref = recorded("base", 13, tuple(range(3, 22)))  # 19 + 13 = 32
    run = tmp_path / "run.h5"
    summary = replay_trace(ref, run, model_dir=model, mode="free-running", max_seq=32)
    assert "same tokens as the reference" in summary
    compare(ref, run)
    with TraceReader(run) as r:
        assert r.mode == "free-running" and r.n_steps == 13


def test_cli_replay_and_plugin(recorded, tmp_path):
    model, ref = recorded("k_eq_v")
    run = tmp_path / "run.h5"
    res = invoke(
        "replay",
        str(ref),
        "--model",
        str(model),
        "--runtime",
        "tests.support.plugin_runtime:make_exported",
        "--free-running",
        "-o",
        str(run),
    )
    assert res.exit_code == 0, res.output
    assert "exported-static" in res.output
    compare(ref, run, same_kinds=False)
    with TraceReader(run) as r:
        assert r.provenance["runtime"] == "exported-static"
        assert {k for k, _ in r.kinds_present()} == {
            "embeddings",
            "rope_cos_sliding",
            "rope_sin_sliding",
            "rope_cos_full",
            "rope_sin_full",
            "logits",
            "token",
        }


def test_buggy_plugin_is_visible_in_logits_only(recorded, tmp_path):
    model, ref = recorded("base")
    run = tmp_path / "run.h5"
    replay_trace(ref, run, model_dir=model, runtime="tests.support.plugin_runtime:make_no_softcap")
    with TraceReader(ref) as a, TraceReader(run) as b:
        assert np.allclose(a.read("final_hidden"), b.read("final_hidden"), rtol=1e-4, atol=1e-4)
        assert not np.allclose(a.read("logits"), b.read("logits"), rtol=1e-3, atol=1e-3)


def _fails(args, out):
    return one_line_error(invoke("replay", *args, "-o", out), out=out)


def test_bad_inputs_exit_2_one_line(recorded, tmp_path):
    model, ref = recorded("base")
    out = tmp_path / "run.h5"
    assert "no such file" in _fails([tmp_path / "missing.h5"], out)
    junk = tmp_path / "junk.h5"
    junk.write_text("not a trace")
    assert "not a readable HDF5" in _fails([junk], out)
    # recorded with a non-embedded model, no --model
    assert "--model" in _fails([ref], out)
    # a model whose config differs: the differing fields are named
    other = tiny_models.build(tmp_path / "other", "base", sliding_window=6)
    msg = _fails([ref, "--model", other], out)
    assert "sliding_window" in msg and "differs" in msg
    assert "exceeds --max-seq 16" in _fails([ref, "--model", model, "--max-seq", 16], out)
    msg = _fails([ref, "--model", model, "--runtime", "no_such_pkg_xyz.rt:make"], out)
    assert "cannot import runtime plug-in module 'no_such_pkg_xyz.rt'" in msg
    msg = _fails([ref, "--model", model, "--runtime", "tests.support.plugin_runtime:make_nothing"], out)
    assert "has no 'make_nothing'" in msg
    msg = _fails([ref, "--model", model, "--runtime", "tests.support.plugin_runtime:make_incomplete"], out)
    assert "lacks decode" in msg
    msg = _fails([ref, "--model", model, "--runtime", "tests.support.plugin_runtime:not_a_factory"], out)
    assert "not callable" in msg
    assert "MODULE:FACTORY" in _fails([ref, "--model", model, "--runtime", "nonsense"], out)


def test_existing_output_kept_without_force(recorded, tmp_path):
    model, ref = recorded("base")
    out = tmp_path / "run.h5"
    out.write_text("keep me")
    with pytest.raises(TraceToolError, match="already exists"):
        replay_trace(ref, out, model_dir=model)
    assert out.read_text() == "keep me"


def test_interrupt_leaves_nothing(recorded, tmp_path, monkeypatch):
    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    model, ref = recorded("base")
    out = tmp_path / "run.h5"

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(StaticGemma4Runtime, "decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        replay_trace(ref, out, model_dir=model)
    assert not out.exists() and not list(tmp_path.glob(".trace-partial-*"))


# ------------------------------------------------------------------ the embedded model (text + vision)
@pytest.mark.skipif(not (embedded_model_dir() / "config.json").exists(), reason="embedded model not built")
def test_embedded_text_free_running(tmp_path):
    ref, run = tmp_path / "ref.h5", tmp_path / "run.h5"
    # 13 prompt + 40 new tokens: window 8 crossed five times; no --model -> the embedded model
    record_trace(None, ref, prompt=DEMO_PROMPT, max_new_tokens=40)
    summary = replay_trace(ref, run, mode="free-running")
    assert "same tokens as the reference" in summary
    compare(ref, run)


@pytest.mark.skipif(not DEMO_IMAGE.exists(), reason="embedded model not built")
def test_embedded_image_teacher_forced(tmp_path):
    ref, run = tmp_path / "ref.h5", tmp_path / "run.h5"
    record_trace(None, ref, prompt=DEMO_IMAGE_PROMPT, images=[str(DEMO_IMAGE)], max_new_tokens=11)
    replay_trace(ref, run)
    compare(ref, run)  # includes the bidirectional image-block masks of the sliding layers
    with TraceReader(run) as r:
        assert {"pixel_values", "image_position_ids", "mm_token_type_ids"} <= set(r.extra_inputs())


def test_tiny_two_images_bidirectional(tmp_path):
    """Two images, one with padding patches, recorded through HF generate() and replayed."""
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.recorder.record import PromptInputs, record_loaded
    from tests.test_runtime import BOI, EOI, IMG, image_inputs

    model = tiny_models.build(
        tmp_path / "m", "base", multimodal=True, use_bidirectional_attention="vision", sliding_window=6
    )
    ids = [2, 5, BOI] + [IMG] * 4 + [EOI, 9, 17, BOI] + [IMG] * 2 + [EOI, 33, 4]
    ref, run = tmp_path / "ref.h5", tmp_path / "run.h5"
    record_loaded(load_model(model), PromptInputs(ids, image_inputs(ids)), ref, max_new_tokens=8)
    replay_trace(ref, run, model_dir=model)
    compare(ref, run)


def test_plugin_module_in_the_current_folder_is_found(tmp_path, monkeypatch):
    from gemma4_trace.replayer.api import load_factory

    (tmp_path / "my_npu_rt.py").write_text("def create(loaded, max_seq):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    assert load_factory("my_npu_rt:create").__name__ == "create"
    import sys

    assert str(tmp_path) not in sys.path  # only while importing
