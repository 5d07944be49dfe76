"""The ExecuTorch runtimes' chunked prefill, checked without lowering anything: the prefill program
(replayer/functional.py: the chunked step graph, the static runtime's prefill_chunk_step over N
rows from a start position) is run eagerly where the lowered one would run, so what is tested is
the host's part: the chunk plan, the caches carried between runs, the rows stitched by position,
the calibration inputs and the cache key. The lowered programs' chunked replays are in
tests/runtimes/test_executorch.py (its fixture's programs are chunked)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("executorch", reason="executorch is not installed (pip install -e '.[executorch]')")

from gemma4_trace.hf.model import load_for_reference, load_model  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer import functional as F  # noqa: E402
from gemma4_trace.replayer.core import read_reference  # noqa: E402
from gemma4_trace.replayer.ops import chunk_plan  # noqa: E402
from gemma4_trace.replayer.runtime import StaticGemma4Runtime  # noqa: E402
from gemma4_trace.replayer.runtimes import executorch as ET  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

PROMPT = [2, 17, 33, 40, 51, 60, 71]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.support import tiny_models

    S, F = tiny_models.S, tiny_models.F
    d = tmp_path_factory.mktemp("et-chunk")
    return load_model(
        tiny_models.build(d / "model", num_hidden_layers=3, layer_types=[S, F, S], num_kv_shared_layers=1)
    )


class _Probe:
    def __init__(self):
        self.got = {}

    def tensor(self, kind, value, layer=None):
        assert (kind, layer) not in self.got, (kind, layer)  # one block of rows per kind and step
        self.got[(kind, layer)] = value.clone()


def _eager(loaded, max_seq: int, chunk: int | None):
    """An ExecuTorch runtime whose programs are the exported graphs run by PyTorch; counts the runs."""
    rt = ET.ExecuTorchRuntime(loaded, max_seq, "executorch")
    rt.host.__dict__.pop("encode_images", None)  # images by the host's port in PyTorch too, not vision.pte
    rt.prefill_chunk = chunk
    rt.runs = []

    def step(name):
        def run(args, phase=None):
            rt.runs.append(name)
            with torch.no_grad():
                return list(ET._graph(rt.host, name)(*args))

        return run

    rt.steps = {n: step(n) for n in ET.PROGRAMS}
    return rt


def _prefill(rt, ids, extra=None):
    probe = _Probe()
    logits = rt.prefill(torch.tensor(ids), extra or {}, probe)
    return logits, probe.got


@pytest.mark.parametrize("max_seq, chunk", [(16, 3), (16, 4), (8, 5)])  # (8, 5): the last chunk starts at 3
def test_chunked_prefill_runs_once_per_chunk_and_stitches_the_rows_by_position(tiny, max_seq, chunk):
    whole_logits, whole = _prefill(_eager(tiny, max_seq, None), PROMPT)
    rt = _eager(tiny, max_seq, chunk)
    logits, got = _prefill(rt, PROMPT)
    assert rt.runs == ["prefill"] * math.ceil(len(PROMPT) / chunk)
    assert got.keys() == whole.keys()
    static = StaticGemma4Runtime(tiny, max_seq, prefill_chunk=chunk)  # the static runtime's chunks
    s_logits, s_got = _prefill(static, PROMPT)
    for key, value in whole.items():
        assert got[key].shape == value.shape == (len(PROMPT), *value.shape[1:]), key
        assert torch.allclose(got[key].float(), value.float(), rtol=0, atol=2e-5), key  # only rounding
        assert torch.allclose(got[key].float(), s_got[key].float(), rtol=0, atol=1e-6), key
    assert torch.allclose(logits, whole_logits, rtol=0, atol=2e-5)
    assert torch.allclose(logits, s_logits, rtol=0, atol=1e-6)
    # the decode after a chunked prefill reads every chunk's K/V rows
    rt.runs.clear()
    assert torch.allclose(rt.decode(5, len(PROMPT), None), static.decode(5, len(PROMPT), None), rtol=0, atol=1e-5)
    assert rt.runs == ["decode"]


def test_an_image_is_never_split_across_prefill_runs():
    ref = read_reference(golden_path("image"))  # 76 tokens with an image, bidirectional vision masks
    loaded = load_for_reference(ref.provenance)
    extra = {k: torch.as_tensor(v) for k, v in ref.extra.items()}
    max_seq, chunk = 96, 66  # the image's 64 soft tokens are positions 4 to 67
    rt = _eager(loaded, max_seq, chunk)
    logits, got = _prefill(rt, ref.prompt_ids, extra)
    plan = chunk_plan(len(ref.prompt_ids), chunk, max_seq, rt.host.prepare_prefill(ref.prompt_ids, extra)[4])
    assert [(c0, rows.stop - rows.start) for c0, rows in plan] == [(0, 4), (4, 66), (30, 6)]  # 1st: up to the image
    assert rt.runs == ["prefill"] * len(plan)
    s_logits, s_got = _prefill(StaticGemma4Runtime(loaded, max_seq, prefill_chunk=chunk), ref.prompt_ids, extra)
    assert got.keys() == s_got.keys()
    for key, value in s_got.items():
        assert torch.allclose(got[key].float(), value.float(), rtol=0, atol=1e-5), key
    assert torch.allclose(logits, s_logits, rtol=0, atol=1e-5)


def test_int8_calibrates_the_prefill_program_on_the_prompts_chunks(tiny):
    host = F.FunctionalKV(tiny, 16, 3)
    calibration = ET._calibration(host, PROMPT, {})
    pre = calibration["prefill"]
    assert len(pre) == 3 and len(calibration["decode"]) == len(PROMPT)
    assert [int(a[6]) for a in pre] == [0, 3, 6]  # the start positions
    assert all(a[0].shape == (1, 3) for a in pre)  # the chunk program's rows
    # the rows past the prompt hold its tokens again (not padding, which would set the int8 ranges)
    assert [a[0][0].tolist() for a in pre] == [PROMPT[0:3], PROMPT[3:6], [PROMPT[6], PROMPT[0], PROMPT[1]]]
    n = 2 * len(host.owners())
    assert all(not c.any() for c in pre[0][7 : 7 + n])  # empty caches first, then what the chunks wrote
    assert pre[2][7][0, :, :6].abs().sum() > 0 and not pre[2][7][0, :, 6:].any()


def test_the_cache_key_and_the_lowering_line_hold_the_prefill_chunk(tiny, monkeypatch):
    keys = [
        ET.artifact_key(SimpleNamespace(model_dir=tiny.model_dir), "executorch", 16, prefill_chunk=c)
        for c in (None, 3, 4)
    ]
    assert [k["prefill_chunk"] for k in keys] == [None, 3, 4] and all(k["format"] == ET.FORMAT for k in keys)
    seen = []
    monkeypatch.setattr(ET, "artifact_folder", lambda *a, **k: seen.append((a, k)))
    ET.cached_programs(tiny, "executorch", 16, prefill_chunk=3)
    (kind, key, _), kw = seen[0]
    assert (kind, key) == ("executorch", keys[1])
    assert kw["what"] == "lowering the prefill (3-row chunk) and decode programs to ExecuTorch XNNPACK, float32"
    ET.cached_programs(tiny, "executorch", 16)  # no chunk: one program over max_seq
    assert seen[1][0][1] == keys[0] and "prefill (max_seq 16)" in seen[1][1]["what"]


def test_the_runtime_follows_the_replays_prefill_chunk(tiny):
    rt = ET.ExecuTorchRuntime(tiny, 16, "executorch")
    assert rt.prefill_chunk is None  # resolve_prefill_chunk: whole below max_seq 1024
    assert ET.ExecuTorchRuntime(tiny, 1024, "executorch").prefill_chunk == 256
    rt.steps = {"prefill": None, "decode": None}  # programs built for one chunk...
    rt.prefill_chunk = 4
    assert rt.steps is None and rt.host.prefill_chunk == 4  # ...are dropped for another


@pytest.mark.parametrize("value, words", [("-1", "-1"), ("x", "'x' is not a valid integer")])
def test_export_pte_refuses_a_bad_prefill_chunk_in_one_line(tmp_path, value, words):
    r = invoke("export-pte", "--max-seq", "16", "--prefill-chunk", value, "-o", tmp_path / "p")
    one_line_error(r, "--prefill-chunk", words)
    assert not (tmp_path / "p").exists()


def test_a_failed_quantization_is_one_line_and_leaves_no_output(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("the exporter's own message\nand its second line")

    monkeypatch.setattr(ET, "_quantized", fail)
    out = tmp_path / "o.h5"
    cache = tmp_path.parent / f"{tmp_path.name}-cache"  # its own: a converted program cached by any run would be used
    r = invoke(
        "replay", golden_path("short"), "--runtime", "executorch-int8-reference", "-o", out, "--cache-dir", cache
    )
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    said = r.stderr.splitlines()  # the phase it got through, the build it started, then the error
    assert said[0].startswith("replaying: loading the model: "), said
    assert said[1].startswith("quantizing the prefill and decode programs (PT2E"), said
    assert said[2:] == ["error: quantizing the programs (PT2E) failed: RuntimeError: the exporter's own message"]
    assert not any(tmp_path.iterdir())  # no output, partial or whole
