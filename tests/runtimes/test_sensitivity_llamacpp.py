"""`trace sensitivity` / `trace precision` / `trace replay --recipe` over `--runtime llama.cpp:TYPE`
on the embedded model (Q8_0 and Q4_0 need no K-quant widths): every configuration a GGUF file
built by replayer/gguf_mixed.py, run by llama.cpp. The planted weak layer: layer LOW_LAYER at
Q4_0 among Q8_0 layers. llama.cpp replays cost seconds each: the tests run 8 in all."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")

from gemma4_trace.analysis.recipe import Recipe, load_recipe  # noqa: E402
from gemma4_trace.hf.model import load_model  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp.gguf_mixed import MixedFiles, read_tensors  # noqa: E402
from gemma4_trace.traces.errors import TraceToolError  # noqa: E402
from tests.support.cli import invoke  # noqa: E402
from tests.support.quant_bugs import LOW_LAYER  # noqa: E402
from tests.test_sensitivity import REF, kl_top1  # noqa: E402

pytestmark = pytest.mark.slow  # exports, lowers or converts programs; make test-fast skips it

WEAK = f'runtime = "llama.cpp:Q8_0"\n\n[units]\n"layer.{LOW_LAYER}" = "Q4_0"\n'


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("sens-llama")
    (d / "weak.toml").write_text(WEAK)
    return d


def test_mixed_file_copies_each_units_tensors_from_the_file_of_its_precision(tmp_path):
    """No replay: every unit at TYPE is the TYPE file itself; in a mixed file the float unit's
    tensors are the F32 conversion's, the Q4_0 unit's the Q4_0 file's raw bytes, the rest TYPE's."""
    mixed = MixedFiles(load_model(None), "Q8_0")
    every = {u: "Q8_0" for u in mixed.units}
    assert mixed.path(every) == mixed.file("Q8_0")
    cfg = {**every, "layer.1.qkv": "float", "layer.2.mlp": "Q4_0"}
    got = read_tensors(mixed.path(cfg))
    files = {p: read_tensors(mixed.file(p)) for p in ("float", "Q4_0", "Q8_0")}
    assert list(got) == list(files["Q8_0"])  # same tensors, same order
    for name, t in got.items():
        p = "float" if name.startswith(("blk.1.attn_q.", "blk.1.attn_k.", "blk.1.attn_v.")) else "Q8_0"
        p = "Q4_0" if name.startswith(("blk.2.ffn_gate.", "blk.2.ffn_up.", "blk.2.ffn_down.")) else p
        want = files[p][name]
        assert t.tensor_type == want.tensor_type, name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(want.data))
    assert got["blk.2.ffn_up.weight"].tensor_type.name == "Q4_0"
    assert got["blk.1.attn_q.weight"].tensor_type.name == "F32"
    assert got["blk.1.attn_output.weight"].tensor_type.name == "Q8_0"
    assert mixed.path(cfg) == mixed.path(dict(cfg))  # cached by content: built once
    assert mixed.quantize_options(cfg) == [
        "--tensor-type blk\\.1\\.attn_q\\.weight=f32",
        "--tensor-type blk\\.1\\.attn_k\\.weight=f32",
        "--tensor-type blk\\.1\\.attn_v\\.weight=f32",
        "--tensor-type blk\\.2\\.ffn_gate\\.weight=q4_0",
        "--tensor-type blk\\.2\\.ffn_up\\.weight=q4_0",
        "--tensor-type blk\\.2\\.ffn_down\\.weight=q4_0",
    ]


def test_llamacpp_sensitivity_ranks_the_weak_layer_first_with_full_replays_only(work):
    res = invoke(
        "sensitivity", str(REF), "--runtime", "llama.cpp:Q8_0", "--recipe", str(work / "weak.toml"),
        "--replays", "1", "--json", "--report", str(work / "sens.html"),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    page = (work / "sens.html").read_text(encoding="utf-8")
    assert "<th>weight rel-L2</th>" in page and "isolated" not in page.split("<h2>Units, ranked</h2>")[1]
    assert all(f'<tr id="{u["unit"]}">' in page for u in out["ranking"])
    assert out["replays"] == {"full": 3, "isolated": 0}  # all quantized, then only-quantized and only-float
    assert "llama.cpp cannot isolate layers" in out["note"]
    top = out["ranking"][0]
    # the types in the file llama.cpp runs: blk.N.proj stays F16, per_layer_model_proj F32
    assert top["unit"] == f"layer.{LOW_LAYER}" and top["precision"] == "F16+Q4_0"
    held = {u["unit"]: u["precision"] for u in out["ranking"]}
    assert held["ple_model_proj"] == "F32" and held["layer.0"] == "F16+Q8_0"
    assert top["weight_rel_l2"] > 3 * max(u["weight_rel_l2"] for u in out["ranking"][1:])
    assert top["only_quantized"]["kl_mean"] < out["all_quantized"]["kl_mean"]
    assert top["only_float"]["kl_mean"] < out["all_quantized"]["kl_mean"]  # keeping it float helps


def test_llamacpp_precision_recipe_verified_replayed_and_written_for_llama_quantize(work):
    out = work / "recipe.toml"
    res = invoke(
        "precision", str(REF), "--runtime", "llama.cpp:Q8_0", "--recipe", str(work / "weak.toml"),
        "--target", "kl_mean<=1e-6", "-o", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"reached with 1 unit(s) at float: layer.{LOW_LAYER}" in res.output
    assert "llama.cpp cannot isolate layers" in res.output and "3 replays (0 isolated, 3 full)" in res.output
    assert load_recipe(out) == Recipe("llama.cpp:Q8_0", {f"layer.{LOW_LAYER}": "float"})
    options = (work / "recipe.llama-quantize.txt").read_text().splitlines()
    names = [t for t in read_tensors(MixedFiles(load_model(None), "Q8_0").file("float"))]
    want = [n for n in names if n.startswith(f"blk.{LOW_LAYER}.") and n.split(".")[2] in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "inp_gate", "proj")]  # fmt: skip
    assert [ln for ln in options if not ln.startswith("#")] == [
        f"--tensor-type {n.replace('.', chr(92) + '.')}=f32" for n in want
    ]
    verified = float(res.output.split("after (verified by a full replay of the recipe): KL mean ")[1].split(",")[0])
    run = work / "kept.h5"
    res = invoke("replay", str(REF), "--runtime", "llama.cpp:Q8_0", "--recipe", str(out), "-o", str(run))
    assert res.exit_code == 0, res.output
    assert "llama.cpp:Q8_0+recipe" in res.output
    kl, top1 = kl_top1(REF, run)
    assert kl <= 1e-6 and top1 == 1.0
    assert kl == pytest.approx(verified, rel=1e-2)  # the printed figure (3 digits) of the same file
    again = invoke("precision", str(REF), "--runtime", "llama.cpp:Q8_0", "--target", "kl_mean<=1", "-o", str(out))
    assert again.exit_code == 2 and "--force" in again.output


@pytest.mark.parametrize(
    "body,message",
    [
        ('runtime = "llama.cpp:Q9_X"\n', "not a quantized runtime"),
        ('runtime = "llama.cpp:F32"\n', "not a quantized runtime"),
        ('runtime = "llama.cpp:Q8_0"\n[units]\n"layer.1" = "static-w8"\n', "unknown precision"),
        ('runtime = "static-w8"\n[units]\n"layer.1" = "Q8_0"\n', "unknown precision"),
    ],
)
def test_llamacpp_recipe_refusals(tmp_path, body, message):
    p = tmp_path / "r.toml"
    p.write_text(body)
    with pytest.raises(TraceToolError, match=message):
        load_recipe(p)


def test_llamacpp_recipe_unit_the_gguf_lacks_is_refused_in_one_line(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text('runtime = "llama.cpp:Q8_0"\n[units]\n"layer.99" = "float"\n')
    res = invoke("replay", str(REF), "--runtime", "llama.cpp:Q8_0", "--recipe", str(p), "-o", str(tmp_path / "o.h5"))
    assert res.exit_code == 2 and "is not a unit of this model's GGUF" in res.output
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--runtime", "llama.cpp:Q8_0", "--fallback", "Q8_0"], "--fallback Q8_0 is the runtime's own type"),
        (["--runtime", "llama.cpp:Q8_0", "--fallback", "static-w8"], "--fallback for llama.cpp:Q8_0 must be one of"),
        (["--runtime", "llama.cpp"], "expected llama.cpp:TYPE with a quantized TYPE"),
    ],
)
def test_llamacpp_precision_refusals_before_any_replay(tmp_path, args, message):
    out = tmp_path / "r.toml"
    res = invoke("precision", str(REF), *args, "--target", "kl_mean<=1", "-o", str(out))
    assert res.exit_code == 2 and message in res.output, res.output
    assert not out.exists() and not (tmp_path / "r.llama-quantize.txt").exists()
