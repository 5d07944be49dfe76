"""`--runtime llama.cpp[:TYPE]` and `trace export-gguf` (extra gemma4-trace[llamacpp]): the
project's GGUF writer, llama.cpp in a child process, its capture and its failures."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.diff.tolerances import resolve_tolerances  # noqa: E402
from gemma4_trace.hf.model import embedded_model_dir  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.artifacts import CACHE_ENV, cache_dir  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp import gguf_writer as GW  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp.runtime import GGUF_NAME, conversion_key  # noqa: E402
from gemma4_trace.replayer.runtimes.registry import BY_NAME  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error, plant_gguf  # noqa: E402

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

PROFILE = resolve_tolerances(BY_NAME["llama.cpp"].profile)
TEXT_GOLDENS = ("short", "window", "eos")


def _rel(x, y):
    x, y = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
    return np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)


@pytest.mark.parametrize("name", TEXT_GOLDENS)
def test_f32_replay_matches_under_the_llamacpp_profile(tmp_path, name):
    ref, run = golden_path(name), tmp_path / "llama.h5"
    summary = replay_trace(ref, run, runtime="llama.cpp")
    assert "llama.cpp:F32 (llama-cpp-python 0.3.36, CPU)" in summary
    res = diff_traces(ref, run, str(PROFILE))
    assert res.match, res.to_json()["first_divergence"]
    with TraceReader(ref) as a, TraceReader(run) as b:
        # (the kinds it holds, at which layers: its capture map's, tests/runtimes/test_conformance.py)
        # the masks (read as the attention nodes' mask operand) are REF's, every layer; a row is
        # max_seq wide, REF's as wide as the run's positions: the columns past them allow nothing
        for i in range(len(a.layers)):
            x, y = a.read("mask", i), b.read("mask", i)
            assert np.array_equal(x, y[:, : x.shape[1]]) and not y[:, x.shape[1] :].any(), i
        # real, GELU-table-sized differences: not a copy of REF, not far from it
        worst = max(_rel(a.read("layer_out", i), b.read("layer_out", i)).max() for i in range(len(a.layers)))
        assert 1e-5 < worst < 2e-3, worst
    # the default tolerances (float32: 1e-4) see llama.cpp's FP16 GELU table: a divergence
    assert not diff_traces(ref, run).match


def test_second_replay_reuses_the_cached_conversion(tmp_path):
    ref = golden_path("short")
    replay_trace(ref, tmp_path / "a.h5", runtime="llama.cpp")
    cached = sorted((p.name, p.stat().st_mtime_ns) for p in (cache_dir() / "gguf").iterdir())
    replay_trace(ref, tmp_path / "b.h5", runtime="llama.cpp")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (cache_dir() / "gguf").iterdir()) == cached
    assert any((cache_dir() / "gguf" / n / GGUF_NAME).is_file() for n, _ in cached)


def test_quantized_q8_0_replays_and_is_cached(tmp_path):
    ref, run = golden_path("short"), tmp_path / "q8.h5"
    assert "llama.cpp:Q8_0" in replay_trace(ref, run, runtime="llama.cpp:Q8_0")
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.artifacts import key_digest

    path = cache_dir() / "gguf" / key_digest(conversion_key(load_model(weights=False), "Q8_0")) / GGUF_NAME
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    with TraceReader(ref) as a, TraceReader(run) as b:
        worst = max(_rel(a.read("layer_out", i), b.read("layer_out", i)).max() for i in range(len(a.layers)))
    assert 1e-4 < worst < 0.2, worst  # 8-bit weights: larger than F32's, far from garbage


def test_crash_in_llamacpp_is_one_line_and_leaves_no_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_TRACE_TEST_NATIVE_CRASH", "attn_out@3")
    run = tmp_path / "crash.h5"
    res = invoke("replay", str(golden_path("short")), "--runtime", "llama.cpp", "-o", str(run))
    line = one_line_error(res, out=run)
    assert line == "error: llama.cpp (F32) crashed in prefill after layer 3 attn_out: killed by SIGABRT", line
    assert not run.exists() and not list(tmp_path.iterdir())


def test_malformed_gguf_is_refused_in_one_line(tmp_path, monkeypatch):
    from gemma4_trace.hf.model import load_model

    ref = golden_path("short")
    GW.write_f32(load_model(None), tmp_path / "good.gguf")
    data = bytearray((tmp_path / "good.gguf").read_bytes())
    data[8:16] = (1 << 62).to_bytes(8, "little")  # the tensor count: far beyond the file
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # a malformed conversion in a cache of its own
    plant_gguf(write=lambda p: p.write_bytes(bytes(data)))
    run = tmp_path / "bad.h5"
    res = invoke("replay", str(ref), "--runtime", "llama.cpp", "-o", str(run))
    assert one_line_error(res, out=run) == (
        "error: llama.cpp (F32) failed in loading the GGUF file: llama.cpp could not load the GGUF file "
        "(gguf_init_from_reader: number of tensors is 4611686018427387904 but must be in [0, 53624256028225440])"
    )
    assert not run.exists()


def test_unknown_type_is_refused_before_any_work(tmp_path):
    res = invoke("replay", str(golden_path("short")), "--runtime", "llama.cpp:Q9_X", "-o", str(tmp_path / "r.h5"))
    one_line_error(res, "unknown GGUF type 'Q9_X'; expected one of F32, F16, BF16, Q8_0")


def test_export_gguf_writes_the_metadata_llamacpp_reads(tmp_path):
    out = tmp_path / "tiny.gguf"
    res = invoke("export-gguf", "-o", str(out))
    assert res.exit_code == 0, res.output
    # the summary line, after the conversion's own line where the artifact cache did not hold it yet
    *before, summary = res.output.splitlines()
    assert summary.startswith(f"wrote {out} (1.8 MiB): tiny-gemma4 (embedded), F32"), res.output
    assert before in ([], ["converting tiny-gemma4 (embedded) to GGUF (F32)"]), res.output
    r = gguf.GGUFReader(out)
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("gemma4.")}
    assert meta["gemma4.attention.sliding_window"] == 8
    assert meta["gemma4.attention.sliding_window_pattern"] == [True, True, False, True, False, True, True, False]
    assert meta["gemma4.attention.shared_kv_layers"] == 3
    assert meta["gemma4.feed_forward_length"] == [128] * 5 + [256] * 3  # double-wide MLPs of the KV-sharing layers
    assert (meta["gemma4.attention.key_length"], meta["gemma4.attention.key_length_swa"]) == (32, 16)
    assert (meta["gemma4.rope.freq_base"], meta["gemma4.rope.freq_base_swa"]) == (1e6, 1e4)
    assert meta["gemma4.final_logit_softcapping"] == 30.0
    tensors = {t.name: t for t in r.tensors}
    # proportional RoPE x0.25 over head_dim 32: 4 rotated frequencies, 12 held still
    assert tensors["rope_freqs.weight"].data.tolist() == np.array([1.0] * 4 + [1e30] * 12, np.float32).tolist()
    assert "blk.7.attn_k.weight" not in tensors and "blk.4.attn_k.weight" in tensors  # layer 7 reuses K/V
    assert tensors["blk.5.ffn_gate.weight"].shape.tolist() == [64, 256]  # ggml order: {in, out}
    again = invoke("export-gguf", "-o", str(out))
    one_line_error(again, "already exists")


def test_profile_still_sees_a_conversion_fault(tmp_path, monkeypatch):
    """RMSNorm weights written with the +1 offset earlier Gemmas store: under the llama.cpp profile
    the first divergence is the per-layer inputs, the first tensor a norm weight enters (the
    per-layer projection norm, before layer 0)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # the faulty file in a cache of its own
    plant_gguf(mutate=lambda name, a: a + 1 if name.endswith("norm.weight") else a)
    ref, run = golden_path("short"), tmp_path / "fault.h5"
    replay_trace(ref, run, runtime="llama.cpp")
    first = diff_traces(ref, run, str(PROFILE)).to_json()["first_divergence"]
    assert (first["step"], first["layer"], first["kind"]) == (0, None, "per_layer_inputs"), first


def test_prompt_longer_than_a_ubatch_is_stitched_by_position(tmp_path, monkeypatch):
    """13 prompt tokens in ubatches of 4 (4+4+4+1 graphs): every row lands at its position, the
    same values as one ubatch gives (bit for bit where the ubatch shapes agree), and a match."""
    ref = golden_path("window")
    whole, split = tmp_path / "whole.h5", tmp_path / "split.h5"
    replay_trace(ref, whole, runtime="llama.cpp")
    monkeypatch.setenv("GEMMA4_TRACE_LLAMACPP_UBATCH", "4")
    replay_trace(ref, split, runtime="llama.cpp")
    assert diff_traces(ref, split, str(PROFILE)).match
    with TraceReader(whole) as a, TraceReader(split) as b:
        for kind, layer in (("q", 0), ("per_layer_inputs", None), ("layer_out", 7), ("final_hidden", None)):
            x, y = a.read(kind, layer), b.read(kind, layer)
            assert x.shape == y.shape and np.array_equal(x[:8], y[:8]), (kind, layer)
            assert np.abs(x - y).max() < 1e-4, (kind, layer)


# ---------------------------------------------------------------- conversion faults, localised
# Each fault is one mistake the project's writer makes on purpose; the expected first divergence
# (step, layer, kind, position) follows from the model's structure: tiny model layers
# [S,S,F,S,F,S,S,F], window 8, sliding head_dim 16 (all rotated), full head_dim 32 with 4 of 16
# frequencies rotated, layers 5-7 reuse the K/V of layers 3 (sliding) and 4 (full).
def _swap_qk_norm():
    from gemma4_trace.hf.model import load_model

    arrays = dict(GW.tensors(load_model(None)))
    swap = {"attn_q_norm": "attn_k_norm", "attn_k_norm": "attn_q_norm"}

    def mutate(name, a):
        for this, other in swap.items():
            if this in name and name.replace(this, other) in arrays:
                return arrays[name.replace(this, other)]
        return a

    return dict(mutate=mutate)


ZOO = {
    # RoPE does nothing at position 0: the first row it changes is position 1 of the first sliding layer's q
    "sliding RoPE base 1e6 instead of 1e4": (dict(metadata={"gemma4.rope.freq_base_swa": 1e6}), (0, 0, "q", 1)),
    # a window of 9: the first query that sees one key too many is position 8, in layer 0's
    # attention: its mask (compared before the attention's tensors) is the first to differ
    "sliding window off by one (9)": (dict(metadata={"gemma4.attention.sliding_window": 9}), (0, 0, "mask", 8)),
    # the first full layer (2) is the first with proportional RoPE; position 0 is not rotated. The
    # extra frequencies are slow (1e6^-0.25 rad per position and less): position 1 is only just past
    # the profile (7e-3 > 6e-3), so any early position is the right site
    "proportional RoPE fraction 0.5": (
        dict(
            mutate=lambda n, a: (
                np.where(np.arange(a.size) < 8, 1.0, a).astype(a.dtype) if n == "rope_freqs.weight" else a
            )
        ),
        (0, 2, "q", range(1, 4)),
    ),
    # the per-layer embedding table with its layer blocks in reverse order: per_layer_inputs, row 0
    "per-layer embeddings permuted": (
        dict(
            mutate=lambda n, a: (
                a.reshape(a.shape[0], 8, -1)[:, ::-1].reshape(a.shape).copy()
                if n == "per_layer_token_embd.weight"
                else a
            )
        ),
        (0, None, "per_layer_inputs", 0),
    ),
    # the per-layer embedding table transposed inside each token's row: its (layer, channel)
    # blocks written channel-major (the tiny model's 8 layers x 8 channels keep the shape, so
    # llama.cpp loads it). The per-layer embeddings are first read by per_layer_inputs: row 0
    "per-layer embeddings transposed (layer x channel)": (
        dict(
            mutate=lambda n, a: (
                a.reshape(a.shape[0], 8, -1).transpose(0, 2, 1).reshape(a.shape).copy()
                if n == "per_layer_token_embd.weight"
                else a
            )
        ),
        (0, None, "per_layer_inputs", 0),
    ),
    # q_norm and k_norm swapped (same width in every layer): layer 0's q, from position 0
    "q_norm and k_norm swapped": (_swap_qk_norm, (0, 0, "q", 0)),
    # a softcap of 15: only the logits change
    "final logit softcap 15 instead of 30": (
        dict(metadata={"gemma4.final_logit_softcapping": 15.0}),
        (0, None, "logits", 12),
    ),
}


@pytest.mark.parametrize("fault", ZOO)
def test_conversion_fault_is_localised_under_the_profile(tmp_path, monkeypatch, fault):
    how, expected = ZOO[fault]
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # the faulty file in a cache of its own
    plant_gguf(**(how() if callable(how) else how))
    ref, run = golden_path("short"), tmp_path / "fault.h5"
    replay_trace(ref, run, runtime="llama.cpp")
    first = diff_traces(ref, run, str(PROFILE)).to_json()["first_divergence"]
    step, layer, kind, position = expected
    assert (first["step"], first["layer"], first["kind"]) == (step, layer, kind), first
    assert first["position"] in (position if isinstance(position, range) else [position]), first


def test_a_real_llamacpp_abort_is_one_line_with_ggmls_message(tmp_path, monkeypatch):
    """KV sharing written as 4 layers instead of 3: llama.cpp's KV cache finds no cache for a
    sharing layer's source and aborts (GGML_ASSERT) while loading. One line names the runtime,
    TYPE, phase and ggml's message; exit 2; no trace."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    plant_gguf(metadata={"gemma4.attention.shared_kv_layers": 4})
    run = tmp_path / "run.h5"
    res = invoke("replay", str(golden_path("short")), "--runtime", "llama.cpp", "-o", str(run))
    line = one_line_error(res, out=run)
    assert line.startswith(
        "error: llama.cpp (F32) crashed in loading the GGUF file before reporting anything: killed by SIGABRT ("
    ), line
    assert "GGML_ASSERT(" in line and line.endswith(" failed)"), line
    assert "/" not in line.split("SIGABRT")[1].split("GGML_ASSERT")[0], line  # ggml's source file, not its build folder


# ---------------------------------------------------------------- K-quant fixture (widths of 256)
KQ_WIDTHS = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    head_dim=64,
    global_head_dim=128,
    vocab_size=256,
    vocab_size_per_layer_input=256,
)


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    """A random Gemma 4 (tests/support/tiny_models.py, no tokenizer) whose matrix widths are multiples of
    256, so llama.cpp's K-quants are really K-quants; two KV-sharing layers, the layout llama.cpp reads."""
    from tests.support import tiny_models

    d = tmp_path_factory.mktemp("kquant")
    model = tiny_models.build(d / "model", num_kv_shared_layers=2, **KQ_WIDTHS)
    ref = d / "ref.h5"
    res = invoke(
        "record",
        "--model",
        str(model),
        "--input-ids",
        "2,17,33,40,51,60,71,80,90,100",
        "--max-new-tokens",
        "4",
        "-o",
        str(ref),
    )
    assert res.exit_code == 0, res.output
    return model, ref


def test_q4_k_m_of_256_wide_model_is_really_q4_k(tmp_path, kquant_model):
    model, ref = kquant_model
    out = tmp_path / "q4km.gguf"
    res = invoke("export-gguf", "--model", str(model), "--type", "Q4_K_M", "-o", str(out))
    assert res.exit_code == 0, res.output
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    # every matrix whose rows are 256-wide is a K-quant: Q4_K, and Q6_K where Q4_K_M keeps more bits
    for name in (
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.attn_output.weight",
        "blk.0.ffn_gate.weight",
        "blk.0.ffn_up.weight",
        "blk.3.ffn_down.weight",
    ):
        assert types[name] == "Q4_K", (name, types[name])
    assert types["token_embd.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"
    assert sum(t == "Q4_K" for t in types.values()) >= 40 and "Q5_0" not in types.values()
    run = tmp_path / "q4km.h5"
    assert "4/4 tokens agree" in replay_trace(ref, run, model_dir=model, runtime="llama.cpp:Q4_K_M")


def test_f32_of_a_second_model_matches_under_the_profile(tmp_path, kquant_model):
    """The writer on another checkpoint (global_head_dim in the config, no tokenizer: an id-only vocabulary)."""
    model, ref = kquant_model
    run = tmp_path / "f32.h5"
    replay_trace(ref, run, model_dir=model, runtime="llama.cpp")
    res = diff_traces(ref, run, str(PROFILE))
    assert res.match, res.to_json()["first_divergence"]


def test_kv_sharing_llamacpp_cannot_express_is_refused_in_one_line(tmp_path):
    """tests/support/tiny_models.py's base layout [S,S,F,S | F,S,F]: HF's layer 4 reads layer 2's K/V,
    llama.cpp would read layer 3 (the last before the sharing ones), a sliding layer."""
    from tests.support import tiny_models

    model = tiny_models.build(tmp_path / "model")
    res = invoke("export-gguf", "--model", str(model), "-o", str(tmp_path / "x.gguf"))
    assert one_line_error(res, out=tmp_path / "x.gguf") == (
        "error: llama.cpp cannot run this KV sharing: its layer 4 (full_attention) would read layer 3's K/V, "
        "HF reads layer 2's (llama.cpp expects the last layer before the sharing ones to be a full layer and the "
        "one before it sliding)"
    )


def test_q4_k_m_three_way_diff_with_the_dequantized_baseline_is_a_match(tmp_path, kquant_model):
    """Q4_K_M really in Q4_K (widths of 256): RUN (llama.cpp) against REF leaves the llama.cpp
    profile, BASE (the static runtime on the same file's weights, dequantized by gguf) explains
    it: the three-way diff is a match. An F32 static BASE explains nothing: not a match."""
    model, ref = kquant_model
    q4 = tmp_path / "q4km.gguf"
    assert invoke("export-gguf", "--model", model, "--type", "Q4_K_M", "-o", q4).exit_code == 0
    run, base, static = tmp_path / "run.h5", tmp_path / "base.h5", tmp_path / "static.h5"
    replay_trace(ref, run, model_dir=model, gguf=q4)
    replay_trace(ref, base, model_dir=model, weights_from=q4)
    replay_trace(ref, static, model_dir=model)
    assert not diff_traces(ref, run, str(PROFILE)).match
    res = diff_traces(ref, run, str(PROFILE), baseline_path=base)
    assert res.match, res.to_json()["first_divergence"]
    assert not diff_traces(ref, run, str(PROFILE), baseline_path=static).match


def test_masks_past_256_positions_in_small_ubatches_are_refs(tmp_path, monkeypatch):
    """270 prompt tokens in ubatches of 4 (68 graphs), past 256 positions: every layer's mask,
    read from llama.cpp's attention nodes, is REF's row for row (cells stay positions)."""
    import random

    rng = random.Random(1)
    ids = [2] + [rng.randrange(20, 600) for _ in range(269)]  # no image/audio token ids (7-13)
    ref, run = tmp_path / "long.h5", tmp_path / "run.h5"
    res = invoke("record", "--input-ids", ",".join(map(str, ids)), "--max-new-tokens", "2", "-o", str(ref))
    assert res.exit_code == 0, res.output
    monkeypatch.setenv("GEMMA4_TRACE_LLAMACPP_UBATCH", "4")
    replay_trace(ref, run, runtime="llama.cpp")
    with TraceReader(ref) as a, TraceReader(run) as b:
        for i in range(len(a.layers)):
            x, y = a.read("mask", i), b.read("mask", i)
            assert len(x) == 271 and np.array_equal(x, y[:, : x.shape[1]]), i
    assert diff_traces(ref, run, str(PROFILE)).match


def test_no_cache_converts_into_a_folder_removed_after_the_replay(tmp_path):
    import glob
    import tempfile

    cache, run = tmp_path / "cache", tmp_path / "r.h5"
    before = set(glob.glob(f"{tempfile.gettempdir()}/gemma4-trace-gguf-*"))
    res = invoke(
        "replay",
        str(golden_path("short")),
        "--runtime",
        "llama.cpp",
        "--no-cache",
        "--cache-dir",
        str(cache),
        "-o",
        str(run),
    )
    assert res.exit_code == 0, res.output
    assert run.is_file() and not (cache / "gguf").exists()
    assert set(glob.glob(f"{tempfile.gettempdir()}/gemma4-trace-gguf-*")) == before


def test_hf_weights_are_loaded_only_to_convert(tmp_path, monkeypatch):
    """llama.cpp never computes with HF's weights: a replay builds the model without them (a bf16
    checkpoint would take 4 bytes per parameter in float32: 18.5 GB for E2B) and loads them only
    when the GGUF is not cached, to convert it."""
    from gemma4_trace.hf import model as hf_model

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    real, loads = hf_model.load_model, []

    def spy(*args, **kwargs):
        loads.append(kwargs.get("weights", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_model, "load_model", spy)
    ref = golden_path("short")
    for run in ("first", "second"):
        replay_trace(ref, tmp_path / f"{run}.h5", runtime="llama.cpp")
    assert loads == [False, True, False]  # the first replay converts: weights then; the second has none
    assert diff_traces(tmp_path / "first.h5", tmp_path / "second.h5").match
    loaded = real(weights=False)
    assert not loaded.has_weights and all(p.is_meta for p in loaded.model.parameters())


def test_streamed_conversion_of_a_bf16_checkpoint_equals_the_in_memory_float32_one(tmp_path, monkeypatch):
    """The writer streams each tensor, upcast to float32 a block of rows at a time, and a bf16
    checkpoint's weights are loaded in bf16 to convert (half the memory of float32): the file is
    byte for byte the one written from the same checkpoint loaded in float32, every tensor in memory."""
    import shutil

    from gemma4_trace.hf.model import load_model

    bf16 = tmp_path / "bf16"
    shutil.copytree(embedded_model_dir(), bf16)
    load_model(bf16, dtype="bfloat16").model.save_pretrained(bf16)  # the weights (and config) now bf16
    monkeypatch.setattr(GW, "BLOCK_BYTES", 4096)  # many row blocks per tensor
    loaded = GW.with_weights(load_model(bf16, weights=False))
    assert loaded.dtype == "bfloat16" and loaded.has_weights
    GW.write_f32(loaded, tmp_path / "streamed.gguf")
    GW.write_f32(load_model(bf16, dtype="float32"), tmp_path / "in-memory.gguf", mutate=lambda name, a: a)
    assert (tmp_path / "streamed.gguf").read_bytes() == (tmp_path / "in-memory.gguf").read_bytes()


def test_a_model_without_weights_needs_no_accelerate(monkeypatch):
    """Building the model without its weights takes the plain path (no device map): it neither
    checks memory nor asks for accelerate (extra [big]), which a llama.cpp user may not have."""
    import sys

    from gemma4_trace.hf.model import load_model

    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate raises ImportError
    assert not load_model(weights=False).has_weights


def test_capture_reads_only_the_kinds_asked_and_none_gives_the_same_next_tokens(tmp_path, monkeypatch):
    """RuntimeChoice.capture reaches the eval callback: every kind (None), only layer_out (the
    scheduler stops at no other node: nothing else reaches the probe) or none (no eval callback at
    all: bench_capture.py's "runtime alone"); the logits pick the same tokens every way."""
    import torch

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.runtimes.llamacpp.runtime import LlamaCppRuntime

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    loaded, ids = load_model(), [2, 10, 11, 12, 13]

    class Probe:
        def __init__(self):
            self.seen = {}

        def tensor(self, kind, value, layer=None, positions=None):
            self.seen[(kind, layer)] = value.clone()

    logits, seen = {}, {}
    for name, capture in (("all", None), ("layer_out", frozenset({"layer_out"})), ("none", frozenset())):
        rt, probe = LlamaCppRuntime(loaded, 16, "F32", capture=capture), Probe()
        try:
            with torch.no_grad():
                first = rt.prefill(ids, {}, probe)
                logits[name] = (first, rt.decode(int(first.argmax()), len(ids), probe))
        finally:
            rt.close()
        seen[name] = probe.seen
    n_layers = len(loaded.text_config.layer_types)
    assert {k for k, _ in seen["all"]} >= {"embeddings", "q", "k", "v", "attn_out", "layer_out", "mask"}
    assert set(seen["layer_out"]) == {("layer_out", i) for i in range(n_layers)}
    assert seen["none"] == {}
    for key, value in seen["layer_out"].items():  # the same rows as when every node is read
        assert torch.equal(value, seen["all"][key]), key
    for name in ("layer_out", "none"):
        for got, want in zip(logits[name], logits["all"]):
            assert int(got.argmax()) == int(want.argmax())
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kinds", [None, ["layer_out"], ["attn_out", "mask"], ["q", "embeddings"]], ids=str)
def test_the_quick_ask_answers_as_reading_the_node_would(tmp_path, monkeypatch, kinds):
    """Capture.ask (asked about every node, so it reads only the name, and the operands of products
    and attention nodes when attn_out or mask is asked) says yes exactly for the nodes whose full
    reading (_target: name, op and operands) is an asked kind, on every node of a prefill and a
    decode graph (in this process: the engine of the child, without the child)."""
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.replayer.runtimes.llamacpp import engine as E
    from gemma4_trace.replayer.runtimes.llamacpp.runtime import GGUF_NAME, gguf_artifact

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    art = gguf_artifact(load_model(), "F32")
    e, answers = E.LlamaCppEngine(lambda *report: None), []
    quick = e.cap.ask

    def both(ptr):
        target = e.cap._target(E._Tensor.from_address(ptr))
        answers.append((quick(ptr), target is not None and (kinds is None or target[0] in kinds), target))
        return answers[-1][0]

    e.cap.ask = both
    try:
        e.load(str(art.path / GGUF_NAME), 16, kinds)
        e.decode([2, 10, 11, 12, 13], 0)
        e.decode([14], 5)
    finally:
        e.close()
        art.close()
    assert all(q == want for q, want, _ in answers), [a for a in answers if a[0] != a[1]][:3]
    found = {t[0] for q, _, t in answers if q}
    assert found == (
        {"embeddings", "per_layer_inputs", "q", "k", "v", "attn_out", "layer_out", "mask", "final_hidden"}
        if kinds is None
        else set(kinds)
    )
    assert sum(q for q, _, _ in answers) < len(answers) / 4  # most nodes are not read
