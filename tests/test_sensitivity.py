"""`trace sensitivity` / `trace precision` / `trace replay --recipe` on the embedded model.

The planted weak layer is the quant bug zoo's one-layer-at-lower-precision bug
(tests.support.quant_bugs:make_low_precision_layer__static_w8: layer LOW_LAYER at int4, groups of
32, among int8 layers), written as a recipe; the recipe runtime is checked to be that bug
bit for bit. Metrics are recomputed here with numpy from written traces.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_trace.analysis.precision import Target
from gemma4_trace.analysis.recipe import Recipe, load_recipe, recipe_factory
from gemma4_trace.analysis.runner import Runner
from gemma4_trace.analysis.sensitivity import sensitivity
from gemma4_trace.recorder.golden import GOLDEN_DIR
from gemma4_trace.replayer.replay import replay_trace
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke
from tests.support.quant_bugs import LOW_LAYER, runtime_spec

pytest.importorskip("torchao")

REF = GOLDEN_DIR / "short.h5"  # 13 prompt tokens, 3 steps
WEAK = f'runtime = "static-w8"\n\n[units]\n"layer.{LOW_LAYER}" = "static-w4g32"\n'


def kl_top1(ref_path, run_path) -> tuple[float, float]:
    with TraceReader(ref_path) as a, TraceReader(run_path) as b:
        x, y = a.read("logits").astype(np.float64), b.read("logits").astype(np.float64)
        tokens = np.asarray(a.tokens())

    def lsm(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    p, q = lsm(x), lsm(y)
    return float(np.mean(np.sum(np.exp(p) * (p - q), -1))), float(np.mean(q.argmax(-1) == tokens))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("sens")
    (d / "weak.toml").write_text(WEAK)
    return d


@pytest.fixture(scope="module")
def weak_trace(work):
    rec = work / "weak.h5"
    res = invoke("replay", str(REF), "--runtime", "static-w8", "--recipe", str(work / "weak.toml"), "-o", str(rec))
    assert res.exit_code == 0, res.output
    return rec


def test_recipe_runtime_is_the_zoo_low_precision_layer(work, weak_trace):
    """The weak recipe over static-w8 is the zoo bug exactly (same logits, bit for bit)."""
    zoo, rec = work / "zoo.h5", weak_trace
    replay_trace(REF, zoo, runtime=runtime_spec("low_precision_layer", "static-w8"))
    with TraceReader(zoo) as a, TraceReader(rec) as b:
        assert b.provenance["runtime"] == "static-w8+recipe"
        np.testing.assert_array_equal(a.read("logits"), b.read("logits"))
        np.testing.assert_array_equal(a.read("layer_out", LOW_LAYER), b.read("layer_out", LOW_LAYER))


def test_sensitivity_ranks_the_planted_weak_layer_first(work, weak_trace):
    runner = Runner(REF, "static-w8", base=load_recipe(work / "weak.toml"))
    s = sensitivity(runner, "layer", replays=2)
    assert s.replays == {"isolated": 1, "full": 1 + 2 * 2}  # all quantized, then 2 per measured unit
    top = s.units[0]
    assert top.unit == f"layer.{LOW_LAYER}" and top.precision == "static-w4g32"
    assert top.isolated == max(u.isolated for u in s.units if u.isolated is not None)
    second = s.units[1]
    assert top.only_quantized["kl_mean"] > 5 * second.only_quantized["kl_mean"]
    assert top.only_float["kl_mean"] < second.only_float["kl_mean"]  # keeping it float helps most
    assert {u.unit for u in s.units} == {f"layer.{i}" for i in range(8)} | {"ple_model_proj"}
    # the all-quantized figures are those of the written trace of the same configuration
    kl, top1 = kl_top1(REF, weak_trace)
    assert s.all_quantized["kl_mean"] == pytest.approx(kl, rel=1e-6)
    assert s.all_quantized["top1"] == top1


def test_cli_sensitivity_json_by_module(work):
    import json

    res = invoke(
        "sensitivity",
        str(REF),
        "--runtime",
        "static-w8",
        "--recipe",
        str(work / "weak.toml"),
        "--unit",
        "module",
        "--replays",
        "1",
        "--json",
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["replays"] == {"full": 3, "isolated": 1}
    assert out["ranking"][0]["unit"].startswith(f"layer.{LOW_LAYER}.")
    assert out["ranking"][0]["only_quantized"] is not None and out["ranking"][1]["only_quantized"] is None
    assert len(out["ranking"]) == 8 * 4 + 1


def test_cli_precision_reaches_the_target_and_replay_verifies_it(work):
    out = work / "recipe.toml"
    res = invoke(
        "precision",
        str(REF),
        "--runtime",
        "static-w8",
        "--recipe",
        str(work / "weak.toml"),
        "--target",
        "kl_mean<=1e-6 and top1>=0.98",
        "-o",
        str(out),
    )
    assert res.exit_code == 0, res.output
    assert f"reached with 1 unit(s) at float: layer.{LOW_LAYER}" in res.output
    assert "warning" not in res.output  # the rest stays quantized
    assert load_recipe(out) == Recipe("static-w8", {f"layer.{LOW_LAYER}": "float"})
    run = work / "kept.h5"
    res = invoke("replay", str(REF), "--runtime", "static-w8", "--recipe", str(out), "-o", str(run))
    assert res.exit_code == 0, res.output
    kl, top1 = kl_top1(REF, run)
    assert kl <= 1e-6 and top1 >= 0.98
    again = invoke("precision", str(REF), "--runtime", "static-w8", "--target", "kl_mean<=1e-6", "-o", str(out))
    assert again.exit_code == 2 and "--force" in again.output  # never over an existing recipe without --force


def test_cli_precision_warns_when_the_recipe_it_reaches_quantizes_nothing(work):
    out = work / "all-float.toml"
    res = invoke(
        "precision", str(REF), "--runtime", "static-w8", "--unit", "layer", "--target", "kl_mean<=1e-12",
        "-o", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[1].startswith("warning: every unit is at float: the recipe quantizes nothing and static-w8 "), lines
    units = load_recipe(out).units
    assert units and set(units.values()) == {"float"}


def test_cli_precision_refuses_a_fallback_that_is_the_runtime(work):
    out = work / "never.toml"
    res = invoke(
        "precision",
        str(REF),
        "--runtime",
        "static-w8",
        "--target",
        "kl_mean<0",
        "--fallback",
        "static-w8",
        "-o",
        str(out),
    )
    assert res.exit_code == 2 and "--fallback static-w8 is the runtime itself" in res.output
    assert not out.exists()


@pytest.mark.parametrize(
    "text,clauses",
    [
        ("kl_mean<=0.01 and top1>=0.98", (("kl_mean", "<=", 0.01), ("top1", ">=", 0.98))),
        ("  kl_p99 < 1e-3 ", (("kl_p99", "<", 1e-3),)),
        ("layer_out<.5", (("layer_out", "<", 0.5),)),
    ],
)
def test_target_parser(text, clauses):
    t = Target.parse(text)
    assert t.clauses == clauses
    assert t.holds({"kl_mean": 0, "kl_p99": 0, "top1": 1, "layer_out": 0})
    assert not t.holds({"kl_mean": 1, "kl_p99": 1, "top1": 0, "layer_out": 1})


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "kl_mean<=0.01 or top1>=0.9",
        "kl_mean",
        "top1>=",
        "kl_mean<=nan",
        "bogus<=1",
        "kl_mean<=1 and",
        "kl_mean==1",
        "",
        "x" * 600,
    ],
)
def test_target_parser_refuses(text):
    with pytest.raises(TraceToolError, match="--target"):
        Target.parse(text)


@pytest.mark.parametrize(
    "body,message",
    [
        ('runtime = "static"\n', "not a quantized runtime"),
        ('runtime = "static-w8"\n[units]\n"layer.x" = "float"\n', "expected layer.N"),
        ('runtime = "static-w8"\n[units]\n"layer.1" = "int3"\n', "unknown precision"),
        ('runtime = "static-w8"\nunits = 3\n', "[units] table"),
        ('runtime = "static-w8"\nextra = 1\n', "unknown key"),
        ("runtime = \n", "not valid TOML"),
    ],
)
def test_recipe_loader_refuses(tmp_path, body, message):
    p = tmp_path / "r.toml"
    p.write_text(body)
    with pytest.raises(TraceToolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_recipe(p)


def test_replay_recipe_refusals(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text('runtime = "static-w8"\n[units]\n"layer.99" = "float"\n')
    res = invoke("replay", str(REF), "--runtime", "static-w8", "--recipe", str(p), "-o", str(tmp_path / "o.h5"))
    assert res.exit_code == 2 and "not a quantizable unit of this model" in res.output
    res = invoke("replay", str(REF), "--runtime", "static-w4g32", "--recipe", str(p), "-o", str(tmp_path / "o.h5"))
    assert res.exit_code == 2 and "the recipe is for --runtime static-w8" in res.output
    res = invoke("sensitivity", str(REF), "--runtime", "static")
    assert res.exit_code == 2 and "quantized static runtime" in res.output
    assert not (tmp_path / "o.h5").exists()


DOC_SECTION = "## From a failing port to a fix"


@pytest.mark.parametrize("qrt", ["static-w4g32", "static-w8a8"])
def test_sensitivity_other_schemes_match_the_written_replay(tmp_path, qrt):
    """The in-process all-quantized replay is `trace replay --runtime QRT` (KL and top-1 from
    its trace), int4 groups and dynamic int8 activations included; keeping the top unit in
    float lowers the KL."""
    runner = Runner(REF, qrt)
    s = sensitivity(runner, "layer", replays=1)
    assert s.replays == {"isolated": 1, "full": 3}
    run = tmp_path / "run.h5"
    replay_trace(REF, run, runtime=qrt)
    kl, top1 = kl_top1(REF, run)
    assert s.all_quantized["kl_mean"] == pytest.approx(kl, rel=1e-6) and s.all_quantized["top1"] == top1
    assert s.units[0].only_float["kl_mean"] < s.all_quantized["kl_mean"]
    assert s.units[0].only_quantized["kl_mean"] < s.all_quantized["kl_mean"]


def test_w8a8_recipe_with_every_unit_float_is_the_float_runtime(tmp_path):
    """A unit kept in float under -a8 takes float activations too: all float == the static runtime."""
    units = {f"layer.{i}": "float" for i in range(8)} | {"ple_model_proj": "float"}
    p = tmp_path / "float.toml"
    p.write_text(Recipe("static-w8a8", units).to_toml())
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    replay_trace(REF, a, runtime="static-w8a8", make=recipe_factory("static-w8a8", load_recipe(p)))
    replay_trace(REF, b, runtime="static")
    with TraceReader(a) as x, TraceReader(b) as y:
        np.testing.assert_array_equal(x.read("logits"), y.read("logits"))
        np.testing.assert_array_equal(x.read("layer_out", 7), y.read("layer_out", 7))


def test_precision_by_module_prunes_what_the_target_does_not_need(tmp_path):
    """By module: the weak layer's modules tie in the isolated ranking and go back in order;
    pruning keeps only those the target needs, all of the weak layer; a replay verifies."""
    from gemma4_trace.analysis.precision import precision_search
    from gemma4_trace.analysis.recipe import write_recipe

    p = tmp_path / "weak.toml"
    p.write_text(WEAK)
    base = load_recipe(p)
    runner = Runner(REF, "static-w8", base=base)
    target = Target.parse("kl_mean<=2e-6")
    res = precision_search(runner, target, "float", "module", base)
    assert res.kept and len(res.kept) < 4 and all(u.startswith(f"layer.{LOW_LAYER}.") for u in res.kept)
    assert not target.holds(res.before) and target.holds(res.verified)
    assert res.bytes_all < res.bytes_recipe
    write_recipe(res.recipe, tmp_path / "r.toml")
    run = tmp_path / "run.h5"
    replay_trace(REF, run, runtime="static-w8", make=recipe_factory("static-w8", load_recipe(tmp_path / "r.toml")))
    kl, _ = kl_top1(REF, run)
    assert kl == pytest.approx(res.verified["kl_mean"], rel=1e-6) and kl <= 2e-6


@pytest.fixture(scope="module")
def w8_base(work):
    """BASE: the all-int8 replay, the envelope the planted int4 layer leaves."""
    base = work / "base-w8.h5"
    replay_trace(REF, base, runtime="static-w8")
    return base


def test_precision_target_baseline_keeps_the_weak_layer_and_the_diff_passes(work, weak_trace, w8_base):
    """--target baseline: the weak configuration fails `trace diff --baseline BASE`; the recipe
    keeps the planted layer in float and its replay passes the same diff (exit 0)."""
    assert invoke("diff", str(REF), str(weak_trace), "--baseline", str(w8_base)).exit_code == 1
    out = work / "baseline-recipe.toml"
    res = invoke(
        "precision",
        str(REF),
        "--runtime",
        "static-w8",
        "--recipe",
        str(work / "weak.toml"),
        "--target",
        "baseline and top1>=0.98",
        "--baseline",
        str(w8_base),
        "-o",
        str(out),
    )
    assert res.exit_code == 0, res.output
    assert f"reached with 1 unit(s) at float: layer.{LOW_LAYER}" in res.output
    assert "warning" not in res.output  # the rest stays quantized
    assert "trace diff --baseline fails" in res.output and "trace diff --baseline passes" in res.output
    assert load_recipe(out) == Recipe("static-w8", {f"layer.{LOW_LAYER}": "float"})
    run = work / "baseline-kept.h5"
    assert invoke("replay", str(REF), "--runtime", "static-w8", "--recipe", str(out), "-o", str(run)).exit_code == 0
    res = invoke("diff", str(REF), str(run), "--baseline", str(w8_base))
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "target,base,message",
    [
        ("baseline", None, "--target baseline needs --baseline BASE.h5"),
        ("top1>=0.9 and baseline", None, "--target baseline needs --baseline BASE.h5"),
        ("top1>=0.9", "w8", "--baseline is used only by a target with the word baseline"),
        ("baseline", "image", "cannot be a baseline here: traces have different prompts"),
        ("baseline", "missing", "no such file"),
    ],
)
def test_precision_target_baseline_refusals(work, w8_base, target, base, message):
    out = work / "never-baseline.toml"
    paths = {"w8": str(w8_base), "image": str(GOLDEN_DIR / "image.h5"), "missing": str(work / "nope.h5")}
    args = ["precision", str(REF), "--runtime", "static-w8", "--target", target, "-o", str(out)]
    res = invoke(*args, *(["--baseline", paths[base]] if base else []))
    assert res.exit_code == 2 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()


def test_target_parser_baseline_word():
    t = Target.parse("baseline and kl_mean<=0.01")
    assert t.uses_baseline and str(t) == "baseline and kl_mean<=0.01"
    assert t.holds({"baseline": True, "kl_mean": 0.0}) and not t.holds({"baseline": False, "kl_mean": 0.0})
    assert not Target.parse("kl_mean<=0.01").uses_baseline
    for bad in ("baseline and", "baseline baseline", "baseline or top1>=1", "baseline<=1"):
        with pytest.raises(TraceToolError, match="--target"):
            Target.parse(bad)


def test_cli_sensitivity_html_report_holds_every_unit_and_the_json_numbers(work):
    """--report: a self-contained page whose row per unit holds the JSON's numbers (as the
    page prints them, 3 significant digits as the text summary does) and a bar; an existing report needs --force."""
    import html
    import json
    import re

    page = work / "sens.html"
    res = invoke(
        "sensitivity", str(REF), "--runtime", "static-w8", "--recipe", str(work / "weak.toml"), "--replays", "2",
        "--json", "--report", str(page),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    out, text = json.loads(res.output), page.read_text(encoding="utf-8")
    assert "<script" not in text and "http" not in text and "<link" not in text
    rows = dict(re.findall(r'<tr id="([^"]+)">(.*?)</tr>', text))
    assert list(rows) == [u["unit"] for u in out["ranking"]]  # every unit, in rank order
    for u in out["ranking"]:
        cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>([^<]*)</td>", rows[u["unit"]])]
        want = [u["precision"], f"{u['isolated_layer_out']:.2e}"]
        for run in (u["only_quantized"], u["only_float"]):
            if run is not None:
                want += [f"{run['kl_mean']:.2e}", f"{run['kl_p99']:.2e}", f"{run['top1']:.3f}"]
                want.append(f"{run['layer_out']:.2e}")
        for w in want:
            assert w in cells, (u["unit"], w, cells)
        assert rows[u["unit"]].count("<svg") == 2
        assert all(int(w) <= 82 for w in re.findall(r'<svg width="(\d+)"', rows[u["unit"]]))  # bars fit the page
    assert "td{white-space:nowrap}" in text and "body{max-width:none}" in text  # no number wrapped mid-number
    measured = [u for u in out["ranking"] if u["only_quantized"]]
    assert len(measured) == 2 and all(f"{u['only_quantized']['kl_mean']:.2e}" in text for u in measured)
    for m in ("kl_mean", "kl_p99", "layer_out"):
        assert f"{out['all_quantized'][m]:.2e}" in text
    again = invoke("sensitivity", str(REF), "--runtime", "static-w8", "--report", str(page))
    assert again.exit_code == 2 and "--force" in again.output
