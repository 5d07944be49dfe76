"""Every built-in runtime's replay holds exactly the sites its capture map declares.

A runtime's capture map (replayer/runtimes/captures.py) is what the registry says it captures (the
README's "kinds captured", RuntimeSpec.not_captured, the refusal of a `--kinds` it cannot capture):
here each registry row whose extra is installed replays a text REF and its trace must hold the
map's kinds at every site the model has, and nothing else. The model's sites are REF's (HF records
every one: K/V only where a layer writes its own, the RoPE tables of its layer types), so a map
that names a kind its adapter never emits, or an adapter that emits a kind its map does not name,
fails here in one line.

The replays share the artifacts the runtimes' own tests build (the suite's artifact cache, keyed by
content): the short golden at its max_seq (16), LiteRT's export at prefill chunks of 3 (as
test_litert.py; LiteRT-LM on that export's bundle replays test_litert.py's plain text prompt), and
the ExecuTorch rows on test_executorch.py's 3-layer model, prompt, max_seq and chunk (an XNNPACK
int8 lowering of the embedded model takes minutes). The rows of third-party engines are slow (they
export, convert or start an engine); the static runtime's rows run in the fast suite."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.replayer.runtimes import registry as R
from gemma4_trace.replayer.runtimes.litert.spec import LITERT
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader
from tests.support.cli import invoke, one_line_error

SHORT = golden_path("short")  # 13 prompt tokens and 3 steps: max_seq 16
LITERT_CHUNK = ("--prefill-chunk", "3")  # test_litert.py's export (max_seq 16, prefill chunks of 3)
# test_executorch.py's model (3 layers: sliding, full, a sliding one reusing layer 0's K/V), prompt and shapes
ET_MAX_SEQ, ET_CHUNK = "16", "3"


def _missing(spec: R.RuntimeSpec) -> list[str]:
    missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
    return missing + [program for program, _ in spec.tools if shutil.which(program) is None]


def _rows() -> list:
    """Every registry row; those of a third-party engine (they export, convert or start one) are slow."""
    return [pytest.param(s.name, id=s.name, marks=[pytest.mark.slow] if s.third_party else []) for s in R.RUNTIMES]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_executorch.py's 3-layer model and its REF (built once here; its .pte files are the cache's)."""
    from tests.support import tiny_models

    model, ref = tiny_models.executorch_case(tmp_path_factory.mktemp("conformance"))
    return ref, ("--model", model, "--max-seq", ET_MAX_SEQ, "--prefill-chunk", ET_CHUNK)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A REF LiteRT-LM can replay (as test_litert.py's: a plain text prompt, whose ids its tokenizer
    makes from the text; the short golden's context outgrows its bundle at max_seq 16)."""
    ref = tmp_path_factory.mktemp("conformance") / "text.h5"
    res = invoke("record", "--prompt", "Once upon a time", "--no-chat", "--max-new-tokens", "4", "-o", ref)
    assert res.exit_code == 0, res.output
    return ref, ("--max-seq", "16", *LITERT_CHUNK)  # the litert rows' export: LiteRT-LM runs its .litertlm


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A REF of a dense model (tests/support/dense_model.py), for the rows that run dense decoders only
    (RuntimeSpec.decoders refuses the embedded model, which has KV sharing and per-layer inputs)."""
    from tests.support.dense_model import dense_ref

    model, ref = dense_ref(tmp_path_factory.mktemp("conformance"), "2,17,33", new_tokens=2)
    return ref, ("--model", model)


def _case(name: str, request) -> tuple:
    """The REF a row replays and its options (those that share the runtime's tests' artifacts)."""
    if R.BY_NAME[name].decoders is not None:
        return request.getfixturevalue("dense")
    if name.startswith("executorch"):
        return request.getfixturevalue("tiny")
    if name == "litert-lm":
        return request.getfixturevalue("text")
    if R.BY_NAME[name].capture_map is LITERT:
        return SHORT, LITERT_CHUNK
    return SHORT, ()


@pytest.mark.parametrize("name", _rows())
def test_a_replay_holds_exactly_the_sites_its_capture_map_declares(name, tmp_path, request):
    spec = R.BY_NAME[name]
    missing = _missing(spec)
    if missing:
        pytest.skip(f"--runtime {name} needs {', '.join(missing)} (pip install -e '.[{spec.extra}]')")
    ref, options = _case(name, request)
    out = tmp_path / "run.h5"
    res = invoke("replay", ref, "--runtime", name, *options, "-o", out)
    assert res.exit_code == 0, res.output
    with TraceReader(ref) as a, TraceReader(out) as b:
        model = set(a.kinds_present())  # every site of the model: HF records them all
        declared = {(s.kind, s.layer) for s in spec.capture_map.sites(len(a.layers))}
        got, want = set(b.kinds_present()), declared & model
    assert got == want, (
        f"{name}: in its trace, not in its capture map: {sorted(got - want, key=str)}; "
        f"in its map, not in its trace: {sorted(want - got, key=str)}"
    )


MAPS = {}  # every map a row uses, named by the first runtime that uses it
for _spec in R.RUNTIMES:
    if all(m is not _spec.capture_map for m in MAPS.values()):
        MAPS[_spec.name] = _spec.capture_map


@pytest.mark.parametrize("name", sorted(MAPS))
def test_a_maps_names_read_back_as_its_sites(name):
    """Every literal name of a map (no `*`, its layer in the name) is read back as the site it names
    (by the map too, where no other row has that name: mlx-lm's RoPE module gives q and k)."""
    m = MAPS[name]
    for row in m.rows:
        gathered = "{layer" in row.native and not S.layered(row.kind)  # HF's per-layer inputs: a slice per layer
        if "*" in row.native or row.layer_from or row.kind == "logits" or gathered:
            continue
        for site in S.sites_of(row.kind, 12):
            native = row.name(site.layer)
            assert row.site_of(native) == site, (name, row, site)
            if not [r for r in m.rows if r is not row and r.matches(native)]:
                assert m.site_of(native) == site, (name, row, site)


def test_every_row_captures_what_its_map_says_and_the_readme_says_it():
    for s in R.RUNTIMES:
        assert (
            s.not_captured
            == s.capture_map.not_captured()
            == tuple(k for k in S.KIND_NAMES if k not in s.capture_map.kinds)
        ), s.name
        assert S.KIND_TOKEN in s.capture_map.kinds  # every runtime chooses a token
    assert R.BY_NAME["llama.cpp"].kinds_text() == "all but RoPE; the vision and audio towers' too"  # mtmd's
    assert R.BY_NAME["static"].kinds_text() == "all kinds; the vision and audio towers' too"  # its ports
    assert R.BY_NAME["mobius"].kinds_text() == "all but mask and RoPE"
    assert R.BY_NAME["mlx"].kinds_text() == "all but mask and RoPE; the vision and audio towers' too"  # mlx-vlm's
    assert R.BY_NAME["litert-lm"].kinds_text() == "tokens only"


def test_a_kind_a_runtime_cannot_capture_is_refused_in_one_line():
    R.check_capture(R.parse_runtime("mobius"), {"q", "layer_out"})
    R.check_capture(R.parse_runtime("my_pkg.rt:make"), {"mask"})  # a plug-in says what it reports
    with pytest.raises(TraceToolError) as e:
        R.check_capture(R.parse_runtime("mobius"), {"layer_out", "mask", "rope_cos_full"})
    line = str(e.value)
    assert line.startswith("--kinds rope_cos_full,mask: runtime mobius cannot capture") and "\n" not in line, line
    assert "all but mask and RoPE" in line
    R.check_capture(R.parse_runtime("static"), {"layer_out", "vision.layer_out", "audio.lconv_out"})  # its ports
    R.check_capture(R.parse_runtime("tico"), {"layer_out", "vision.layer_out"})  # its own vision step, tapped
    with pytest.raises(TraceToolError, match="--kinds vision.layer_out: runtime mobius cannot capture"):
        R.check_capture(R.parse_runtime("mobius"), {"layer_out", "vision.layer_out"})  # token ids only


def test_trace_replay_refuses_kinds_its_runtime_cannot_capture(tmp_path):
    """Before the model loads: one line, nothing written; the kinds always kept are never named."""
    out = tmp_path / "run.h5"
    r = invoke("replay", SHORT, "--runtime", "mobius", "--kinds", "q,mask", "-o", out)
    one_line_error(r, "--kinds mask: runtime mobius cannot capture mask", out=out)
    r = invoke("replay", SHORT, "--runtime", "litert-lm", "--kinds", "layer_out", "-o", out)
    needles = ("--kinds layer_out: runtime litert-lm cannot capture layer_out", "(it captures tokens only)")
    one_line_error(r, *needles, out=out)
