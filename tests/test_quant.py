"""Quantized static runtimes (replayer/quant.py) and `trace calibrate` (diff/calibrate.py).

The quantized weights are checked against a direct numpy quantize-dequantize; the runtimes
against the float static runtime on the embedded model; calibrated tolerances against the
errors read straight from the traces.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import tomllib
import torch

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.diff.calibrate import calibrate, round_up
from gemma4_trace.replayer.quant import (
    SCHEMES,
    QuantizedWeight,
    hold_quantized,
    make_quantized,
    quantize_activation,
    quantize_weight,
)
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.reader import TraceReader
from tests.support import tiny_models
from tests.support.bug_zoo import reference_path
from tests.support.cli import invoke, one_line_error, site_of

pytest.importorskip("torchao")


def np_fake_quant(w: np.ndarray, bits: int, group: int | None) -> np.ndarray:
    """Symmetric quantize-dequantize, one scale per row and group: the textbook formula
    (float32, times the reciprocal of the scale as torchao computes it: ties round alike)."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    out = np.empty_like(w)
    g = w.shape[1] if group is None else group
    for c0 in range(0, w.shape[1], g):
        blk = w[:, c0 : c0 + g]
        scale = np.maximum(np.abs(blk).max(axis=1, keepdims=True) / ((qmax - qmin) / 2), np.finfo(np.float32).eps)
        out[:, c0 : c0 + g] = np.clip(np.round(blk * (np.float32(1) / scale)), qmin, qmax) * scale
    return out


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_weight_quantization_is_the_textbook_formula(bits, group):
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(0))  # 80 = 2 groups of 32 + one of 16
    got = quantize_weight(w, bits, group).numpy()
    want = np_fake_quant(w.numpy(), bits, group)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    g = 80 if group is None else group
    for c0 in range(0, 80, g):  # at most 2^bits levels per row and group
        levels = max(len(np.unique(r)) for r in got[:, c0 : c0 + g])
        assert levels <= 2**bits
    assert not np.array_equal(got, w.numpy())


def torchao_fake_quant(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """torchao's own quantize-dequantize of the zero-padded rows: what a held weight must equal."""
    from torchao.quantization import quant_primitives as qp

    k = w.shape[-1]
    g = k if group is None else group
    rows = torch.nn.functional.pad(w.reshape(-1, k).float(), (0, (-k) % g))
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    s, z = qp.choose_qparams_affine(rows, qp.MappingType.SYMMETRIC, (1, g), torch.int8, lo, hi)
    q = qp.quantize_affine(rows, (1, g), s, z, torch.int8, lo, hi)
    out = qp.dequantize_affine(q, (1, g), s, z, torch.int8, lo, hi, output_dtype=torch.float32)
    return out[:, :k].reshape(w.shape).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_a_held_weight_is_torchaos_values_bit_for_bit(bits, group, dtype):
    gen = torch.Generator().manual_seed(2)
    experts = torch.randn(3, 24, 80, generator=gen).to(dtype)  # (experts, out, in), 80: a short last group
    held = hold_quantized(experts, bits, group)
    want = torchao_fake_quant(experts, bits, group)
    assert isinstance(held, QuantizedWeight) and held.q.dtype == torch.int8 and held.scale.dtype == torch.float32
    assert (held.shape, held.dtype, held.dim(), held.numel()) == (experts.shape, dtype, 3, experts.numel())
    bits_of = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(held.dequantize().view(bits_of), want.view(bits_of))
    x = torch.randn(5, 80, generator=gen).to(dtype)
    assert torch.equal(torch.nn.functional.linear(x, held[1]), torch.nn.functional.linear(x, want[1]))
    assert torch.equal(held[torch.tensor([2, 0])], want[torch.tensor([2, 0])])  # an expert slice: only its rows
    v = torch.randn(2, 80, generator=gen).to(dtype)
    pick = torch.tensor([0, 2])
    assert torch.equal(torch.einsum("khi,ki->kh", held[pick], v), torch.einsum("khi,ki->kh", want[pick], v))
    assert torch.equal(held.sum(), want.sum())  # any other torch function sees the dequantized values


def _mapping_rss_kb(address: int) -> int:
    """Resident kB of the mapping (/proc/self/smaps) holding `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_replays_quantized_runtime_holds_each_weight_once(tmp_path):
    """`trace replay` owns its model (single_use): each float weight's memory is freed once
    quantized (checkpoint pages mapped in place are dropped, read back from the file if touched);
    the logits are those of a runtime that keeps the float weights."""
    from gemma4_trace.hf.model import load_model

    model = tiny_models.build(tmp_path / "m", "moe")
    ids = [2, 10, 11, 12, 13, 14]
    kept = make_quantized(load_model(model), 16, "static-w8a8")
    owned = load_model(model)
    owned.single_use = True
    hf = owned.model.model.layers[0]
    q_proj = hf.self_attn.q_proj.weight
    values = q_proj.detach().clone()
    quantized = [p for n, p in owned.model.named_parameters() if n.endswith(("_proj.weight", "_proj"))]
    assert len(quantized) > 10
    address = q_proj.untyped_storage().data_ptr()
    for p in owned.model.parameters():
        p.detach().sum()  # every page resident, as after a float replay
    before = _mapping_rss_kb(address)
    freed = make_quantized(owned, 16, "static-w8a8")
    after = _mapping_rss_kb(address)
    whole_pages = sum(p.numel() * p.element_size() // 4096 for p in quantized) * 4  # kB
    assert before - after >= whole_pages // 2 > 0, (before, after, whole_pages)
    assert torch.equal(q_proj.detach(), values)  # dropped pages read back from the file
    assert hf.input_layernorm.weight.untyped_storage().nbytes() > 0
    for L in freed.layers:
        assert all(isinstance(L._buffers[n], QuantizedWeight) for n in ("q_proj", "o_proj", "gate_proj", "down_proj"))
    with torch.no_grad():
        assert torch.equal(kept.prefill(ids), freed.prefill(ids))
        assert torch.equal(kept.decode(5, len(ids)), freed.decode(5, len(ids)))


def test_activation_quantization_is_per_token_int8():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    got = quantize_activation(x).numpy()
    xs = x.numpy()
    scale = np.abs(xs).max(-1, keepdims=True) / np.float32(127)
    np.testing.assert_allclose(
        got, np.clip(np.round(xs * (np.float32(1) / scale)), -127, 127) * scale, rtol=1e-6, atol=1e-7
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="module")
def runs(workdir):
    """REF (prompt5: decodes past the window) and one replay per runtime, each made once."""
    ref = reference_path("prompt5", workdir)
    out = {}
    for name in ("static", *SCHEMES):
        out[name] = workdir / f"{name}.h5"
        replay_trace(ref, out[name], runtime=name, force=True)
    return ref, out


def test_runtime_name_is_recorded_and_numbers_differ_by_scheme(runs):
    ref, out = runs
    logits = {}
    for name, path in out.items():
        with TraceReader(path) as r:
            assert r.provenance["runtime"] == name
            logits[name] = r.read("logits")
            emb = r.read("embeddings")
    with TraceReader(ref) as r:
        ref_logits, ref_emb = r.read("logits"), r.read("embeddings")
    np.testing.assert_allclose(emb, ref_emb, rtol=1e-6)  # embeddings are not quantized

    def rel(a):
        return float(np.linalg.norm(a - ref_logits) / np.linalg.norm(ref_logits))

    # float32 round-off < int8 noise < int4 noise; w8a8 differs from w8 (activations quantized)
    assert rel(logits["static"]) < 1e-5 < rel(logits["static-w8"]) < rel(logits["static-w4g32"])
    assert not np.array_equal(logits["static-w8a8"], logits["static-w8"])


def test_quantized_run_fails_the_float_defaults(runs):
    ref, out = runs
    assert not diff_traces(ref, out["static-w8"]).match


def test_a_quantized_run_diffed_without_a_baseline_gets_one_note_pointing_to_it(runs):
    ref, out = runs
    r = invoke("diff", ref, out["static-w8a8"], "--json")
    assert r.exit_code == 1
    notes = [n for n in json.loads(r.stdout)["notes"] if "a quantized runtime" in n]
    assert len(notes) == 1 and "RUN ran static-w8a8" in notes[0] and "--baseline BASE" in notes[0]
    assert "trace calibrate" in notes[0] and "docs/quantized.md" in notes[0]
    r = invoke("diff", ref, out["static-w8a8"], "--baseline", out["static-w8"])  # a baseline given: no note
    assert "a quantized runtime:" not in r.stdout, r.output
    r = invoke("diff", out["static-w8"], out["static-w4g32"])  # the note follows RUN's runtime
    assert "RUN ran static-w4g32, a quantized runtime" in r.stdout
    r = invoke("diff", ref, out["static"])
    assert "a quantized runtime" not in r.stdout, r.output


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_calibrated_tolerances_match_the_base_by_construction(runs, workdir, scheme):
    ref, out = runs
    toml = workdir / f"{scheme}.toml"
    r = invoke("calibrate", str(ref), str(out[scheme]), "-o", str(toml), "--margin", "1")
    assert r.exit_code == 0, r.output
    result = diff_traces(ref, out[scheme], toml)
    assert result.match, result.first_divergence and result.first_divergence.sentence
    # margin 1: each rule's threshold is the worst error rounded up, so some tensor sits close to it
    rules = tomllib.loads(toml.read_text())["rule"]
    by_key = {(r["kind"], r.get("layer"), r["step"]): r["rel_l2"] for r in rules}
    worst = _worst_rel(ref, out[scheme], "layer_out", 3)
    for phase, value in worst.items():
        t = by_key[("layer_out", 3, phase)]
        assert value <= t <= max(1e-4, value * 1.01)


def _worst_rel(ref, run, kind, layer) -> dict:
    """Worst per-row rel-L2 by phase, straight from the two traces (l2 floor 1e-6 as float32)."""
    with TraceReader(ref) as a, TraceReader(run) as b:
        x, y, T = a.read(kind, layer).astype(np.float64), b.read(kind, layer).astype(np.float64), a.prompt_len
    x, y = x.reshape(len(x), -1), y.reshape(len(y), -1)
    rel = np.linalg.norm(y - x, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-6 * np.sqrt(x.shape[1]))
    n0 = 1 if kind == "logits" else T  # logits: one row per step; others one per position
    return {"prefill": rel[:n0].max(), "decode": rel[n0:].max()}


def test_calibration_over_several_bases_takes_the_worst(runs):
    ref, out = runs
    text, summary = calibrate(ref, [out["static-w8"], out["static-w8a8"]], margin=2.0)
    rules = {(r["kind"], r.get("layer"), r["step"]): r["rel_l2"] for r in tomllib.loads(text)["rule"]}
    for kind, layer in (("q", 0), ("layer_out", 7), ("logits", None)):
        for phase in ("prefill", "decode"):
            w = max(_worst_rel(ref, out[s], kind, layer)[phase] for s in ("static-w8", "static-w8a8"))
            assert rules[(kind, layer, phase)] == max(1e-4, round_up(2 * w))
    assert summary["bases"] == 2 and summary["rules"] == len(rules)


def test_round_up_never_rounds_down():
    for x in (1.23456e-3, 0.1, 9.999e-5, 1.0 / 3, 7.0, 123456.0):
        v = round_up(x)
        assert v >= x and v <= x * 1.01 and float(repr(v)) == v and len(f"{v:.2e}") <= 9


def test_calibrate_bad_input_is_one_line(runs, workdir, tmp_path):
    ref, out = runs
    golden = reference_path("short", workdir)  # another prompt: incompatible
    cases = [
        [str(ref), str(out["static-w8"]), "-o", str(tmp_path / "a.toml"), "--margin", "0.5"],
        [str(ref), str(golden), "-o", str(tmp_path / "b.toml")],
        [str(ref), str(tmp_path / "missing.h5"), "-o", str(tmp_path / "c.toml")],
        [str(ref), str(out["static-w8"]), "-o", str(ref)],  # exists: never replaced without --force
    ]
    for args in cases:
        one_line_error(invoke("calibrate", *args))
    assert not any(tmp_path.iterdir())


def test_logit_metrics_equal_a_direct_numpy_computation(runs):
    ref, out = runs
    result = diff_traces(ref, out["static-w4g32"])
    with TraceReader(ref) as a, TraceReader(out["static-w4g32"]) as b:
        x, y = a.read("logits").astype(np.float64), b.read("logits").astype(np.float64)
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = np.exp(y - y.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    kl = np.array([np.sum(pi[pi > 0] * np.log(pi[pi > 0] / qi[pi > 0])) for pi, qi in zip(p, q)])
    top1 = (x.argmax(1) == y.argmax(1)).astype(float)
    top5 = np.array([len(set(np.argsort(-xi)[:5]) & set(np.argsort(-yi)[:5])) / 5 for xi, yi in zip(x, y)])
    t = x.argmax(1)
    drop = p[np.arange(len(t)), t] - q[np.arange(len(t)), t]
    m = result.logits
    np.testing.assert_allclose(m.kl, kl, rtol=1e-9, atol=1e-15)
    np.testing.assert_array_equal(m.top1, top1)
    np.testing.assert_array_equal(m.top5, top5)
    np.testing.assert_allclose(m.drop, drop, rtol=1e-9, atol=1e-15)
    s = m.summary
    assert s.kl_mean == pytest.approx(kl.mean()) and s.kl_max == pytest.approx(kl.max())
    assert s.kl_p99 == pytest.approx(np.percentile(kl, 99)) and s.kl_max_step == int(kl.argmax())
    assert s.top1_agreement == pytest.approx(top1.mean()) and s.top5_overlap == pytest.approx(top5.mean())
    assert s.drop_max == pytest.approx(drop.max()) and s.drop_max_step == int(drop.argmax())
    assert top1.mean() < 1 and kl.max() > 1e-4  # int4 flips tokens: the figures are not trivially zero
    j = result.to_json()["logit_metrics"]
    assert set(j) == {"kl", "top1", "top5", "ref_token_prob_drop", "summary"} and len(j["kl"]) == len(kl)
    assert "KL(REF||RUN) mean" in format_text(result)


def test_incompatible_baseline_is_one_line_exit_2(runs, workdir, tmp_path):
    ref, out = runs
    other = reference_path("short", workdir)  # another prompt
    iso = workdir / "w8-iso.h5"
    if not iso.exists():
        replay_trace(ref, iso, runtime="static-w8", isolate=True)
    for base, words in (
        (other, "cannot be a baseline"),
        (iso, "replayed the same way"),
        (tmp_path / "missing.h5", "no such file"),
    ):
        r = invoke("diff", str(ref), str(out["static-w4g32"]), "--baseline", str(base))
        one_line_error(r, words)
    r = invoke("diff", str(ref), str(out["static-w8"]), "--baseline", str(out["static-w8"]), "--baseline-factor", "0.5")
    one_line_error(r, "--baseline-factor")


def test_baseline_json_figures(runs):
    """int4 judged by an int8 BASE: outside its envelope; the JSON carries both errors."""
    ref, out = runs
    result = diff_traces(ref, out["static-w4g32"], baseline_path=out["static-w8"])
    j = result.to_json()
    b = j["first_divergence"]["baseline"]
    assert j["baseline"]["runtime"] == "static-w8" and j["baseline"]["factor"] == 4.0
    assert b["ratio"] > 4 and b["base_value"] * b["ratio"] == pytest.approx(j["first_divergence"]["value"])
    assert b["run_vs_base"] > b["run_vs_base_threshold"]
    assert "x the baseline" in j["first_divergence"]["sentence"]


def test_one_bad_row_below_base_worst_fails_when_run_tracks_base(tmp_path):
    """RUN is BASE's quantization (it tracks BASE row by row) with one prefill row wrong: its
    error is 0.9x BASE's worst row in the step but over 4x BASE's on that row. Check 3 of the
    envelope (BASE's worst in the step) must not excuse it."""
    import shutil

    import h5py

    from gemma4_trace.recorder.golden import GOLDEN_DIR
    from gemma4_trace.traces import schema as S
    from gemma4_trace.traces.reader import TraceReader

    ref, base, run = GOLDEN_DIR / "short.h5", tmp_path / "base.h5", tmp_path / "run.h5"
    replay_trace(ref, base, runtime="static-w8")
    shutil.copy(base, run)
    with TraceReader(ref) as r, TraceReader(base) as b:
        T = r.prompt_len
        for kind, layer in ((k, l) for l in range(len(r.layers)) for k in ("q", "attn_out", "layer_out")):
            a = r.read(kind, layer, slice(0, T)).astype(np.float64).reshape(T, -1)
            c = b.read(kind, layer, slice(0, T)).astype(np.float64).reshape(T, -1)
            err = np.linalg.norm(a - c, axis=1) / np.linalg.norm(a, axis=1)
            if 0.9 * err.max() > 4.5 * err.min():  # a step whose BASE errors spread that far
                break
        else:
            pytest.fail("no prefill tensor of the int8 BASE spreads its row errors 5x")
        shape = r.dataset(kind, layer).shape[1:]
    row = int(np.argmin(err))
    u = np.random.default_rng(0).standard_normal(a.shape[1])
    bad = a[row] + 0.9 * err.max() * np.linalg.norm(a[row]) * u / np.linalg.norm(u)
    with h5py.File(run, "r+") as f:
        f[S.tensor_path(kind, layer)][row] = bad.reshape(shape).astype(np.float32)
    d = diff_traces(ref, run, baseline_path=base).to_json()["first_divergence"]
    assert site_of(d) == (0, layer, kind, row), d
