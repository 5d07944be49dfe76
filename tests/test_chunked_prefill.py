"""Chunked static prefill (`trace replay --prefill-chunk N`): the same trace as one step over
max_seq, on goldens that cross the sliding window and hold an image, and a static exported chunk."""

from __future__ import annotations

import pytest
import torch

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.hf.model import load_model
from gemma4_trace.recorder import golden
from gemma4_trace.replayer.ops import chunk_plan, resolve_prefill_chunk
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.replayer.runtime import StaticGemma4Runtime
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error


@pytest.mark.parametrize(
    "name, chunk, max_seq",
    [
        ("window", 4, None),  # 13-token prompt in chunks 0-3, 4-7, 8-11, 12: window 8 crossed inside the prefill
        ("window", 6, 16),  # 13 + 3 steps: chunks 0-5, 6-11, then 10-15 (overlaps; rows 12-15 new)
        ("image", 64, None),  # the 64-token image would straddle chunk 0: it is recomputed whole in chunk 1
    ],
)
def test_chunked_equals_whole(tmp_path, name, chunk, max_seq):
    ref = golden.golden_path(name)
    whole, chunked = tmp_path / "whole.h5", tmp_path / "chunked.h5"
    if max_seq is not None:  # a shorter teacher-forced run so prompt + steps fit max_seq 16
        with TraceReader(ref) as r:
            assert len(r.prompt_ids) == 13
        from gemma4_trace.recorder.record import record_trace

        ref = tmp_path / "ref.h5"
        record_trace(output=ref, max_new_tokens=3)
    replay_trace(ref, whole, max_seq=max_seq, prefill_chunk=0)
    replay_trace(ref, chunked, max_seq=max_seq, prefill_chunk=chunk)
    res = diff_traces(whole, chunked)
    assert res.match, format_text(res)
    assert diff_traces(ref, chunked).match
    with TraceReader(whole) as a, TraceReader(chunked) as b:
        assert b.kinds_present() == a.kinds_present()
        T = len(a.prompt_ids)
        for layer in (0, 1):  # masks exactly equal, over the same max_seq keys
            assert (a.read("mask", layer)[:T] == b.read("mask", layer)[:T]).all()


def test_chunk_plan():
    assert chunk_plan(13, 4, 40) == [(0, slice(0, 4)), (4, slice(0, 4)), (8, slice(0, 4)), (12, slice(0, 1))]
    assert chunk_plan(13, 8, 16) == [(0, slice(0, 8)), (8, slice(0, 5))]
    assert chunk_plan(11, 8, 12) == [(0, slice(0, 8)), (4, slice(4, 7))]  # the last chunk starts at 12 - 8
    blocks = torch.tensor([-1] * 4 + [0] * 64 + [-1] * 28)
    assert chunk_plan(76, 64, 96, blocks) == [(0, slice(0, 4)), (4, slice(0, 64)), (32, slice(36, 44))]
    with pytest.raises(TraceToolError, match="shorter than an image of 64 soft tokens"):
        chunk_plan(76, 16, 96, blocks)


def test_default_rule():
    assert resolve_prefill_chunk(None, 512) is None and resolve_prefill_chunk(None, 1024) == 256
    assert resolve_prefill_chunk(0, 8192) is None and resolve_prefill_chunk(4096, 2048) is None
    assert resolve_prefill_chunk(128, 2048) == 128


def test_chunk_shorter_than_image_is_one_line(tmp_path):
    res = invoke("replay", str(golden.golden_path("image")), "--prefill-chunk", "16", "-o", str(tmp_path / "run.h5"))
    one_line_error(res, "shorter than an image of 64 soft tokens")


def test_exported_chunk_step_is_static_and_equal():
    """torch.export of one chunk step (N=8, max_seq 32): same logits and K/V as the eager step."""
    lm = load_model()
    rt = StaticGemma4Runtime(lm, max_seq=32, prefill_chunk=8)
    ids = list(range(2, 14))  # 12 tokens: chunks 0-7, 8-11
    args = rt.prepare_prefill(ids, {})
    ids_p, ple_ids, mm_embeds, mm_slots, block_ids, n_valid = args

    class Chunk(torch.nn.Module):
        def __init__(self, rt):
            super().__init__()
            self.rt = rt

        def forward(self, ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid, input_pos):
            return self.rt.prefill_chunk_step(ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid, input_pos)

    sl = slice(8, 16)
    second = (ids_p[:, sl], ple_ids[:, sl], mm_embeds[:, sl], mm_slots[:, sl], block_ids, n_valid, torch.arange(8, 16))
    with torch.no_grad():
        ep = torch.export.export(Chunk(rt), second, strict=False)
    for node in ep.graph.nodes:  # static: no symbolic sizes anywhere
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert all(isinstance(d, int) for d in val.shape), node
    want = rt.prefill(torch.tensor(ids))  # eager chunked prefill: caches hold rows 0..11
    k_want = rt.layers[0].k_cache.clone()
    rt.layers[0].k_cache.zero_()
    with torch.no_grad():  # the first chunk eagerly, the second through the exported graph
        rt.prefill_chunk_step(
            ids_p[:, :8], ple_ids[:, :8], mm_embeds[:, :8], mm_slots[:, :8], block_ids, n_valid, torch.arange(8)
        )
        got = ep.module()(*second)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rt.layers[0].k_cache, k_want, rtol=1e-5, atol=1e-6)
