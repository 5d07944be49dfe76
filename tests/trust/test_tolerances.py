"""A tolerances file (`trace diff --tolerances`) and the files `trace calibrate` writes are
untrusted input: an invalid or hostile file is one line naming it; a file name cannot write
configuration; a tolerances file is bounded in size, in pattern count and in matching cost, and
refuses non-finite values and deep nesting in one line; the fuzzer's tolerance classes
(scripts/fuzz_traces.py --tolerance-cases) end cleanly. (Recipes have no trust test of their own:
scripts/fuzz_inputs.py mutates them, run by tests/trust/test_other.py.)"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

import pytest

from gemma4_trace.diff import tolerances as T
from gemma4_trace.recorder import golden
from tests.support.cli import invoke, one_line_error
from tests.support.diff_fixtures import copy_trace, noise

GOLDEN = golden.golden_path("short")
INJECTED = "\ntokens = {accept_near_ties = true, near_tie_margin = 1e308}\n#"


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tol") / "ref.h5"
    shutil.copyfile(GOLDEN, p)
    return p


def diff_with(ref: Path, tmp_path: Path, text: str):
    tol = tmp_path / "tol.toml"
    tol.write_text(text, encoding="utf-8")
    return invoke("diff", ref, ref, "--tolerances", tol)


# ---------------------------------------------------------------- invalid or hostile files: one line naming the file
@pytest.mark.parametrize(
    "text,needle",
    [
        ("[[rule]\n", "not valid TOML"),
        ('[[rule]]\nkind = "q"\nrel_l2 = -1\n', "rel_l2 must be >= 0"),
        ('[[rule]]\nkind = "nope"\nrel_l2 = 1\n', "matches no kind"),
        ("\xff\xfe", "not valid TOML"),
        ("rule = 3\n", "array of tables"),
    ],
)
def test_invalid_tolerances_file(tmp_path, text, needle):
    p = tmp_path / "tol.toml"
    p.write_bytes(text.encode("latin-1"))
    one_line_error(invoke("diff", GOLDEN, GOLDEN, "--tolerances", p), str(p), needle)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("x = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested too deeply"),
        ("[tokens]\nnear_tie_margin = nan\n", "near_tie_margin must be a number >= 0"),
    ],
)
def test_hostile_tolerances_file(tmp_path, text, needle):
    p = tmp_path / "tol.toml"
    p.write_text(text)
    one_line_error(invoke("diff", GOLDEN, GOLDEN, "--tolerances", p), str(p), needle)


# ---------------------------------------------------------------- calibrate: names are data
def test_calibrate_base_name_with_a_newline_writes_no_configuration(ref, tmp_path):
    plain = tmp_path / "plain"
    odd = tmp_path / "odd"
    plain.mkdir()
    odd.mkdir()
    edit = noise("layer_out", 2, 0, 1e-3, seed=11)
    copy_trace(ref, plain / "base.h5", edit=edit)
    odd_base = odd / f"base{INJECTED}.h5"
    copy_trace(ref, odd_base, edit=edit)
    loaded = []
    for base in (plain / "base.h5", odd_base):
        out = base.parent / "tol.toml"
        r = invoke("calibrate", ref, base, "-o", out)
        assert r.exit_code == 0, r.output
        tol = T.load_tolerances(out)  # parses: the name broke no comment
        loaded.append(
            (
                tol.near_tie_margin,
                tol.accept_near_ties,
                [(x.kind.glob.pattern, x.layer and x.layer.ranges, x.step.ranges, x.values) for x in tol.rules],
            )
        )
    assert loaded[0] == loaded[1]
    assert loaded[1][1] is False and loaded[1][2], loaded[1][:2]  # no injected [tokens]; real rules
    texts = [(d / "tol.toml").read_text(encoding="utf-8").splitlines() for d in (plain, odd)]
    assert [ln for ln in texts[0] if not ln.startswith("#")] == [ln for ln in texts[1] if not ln.startswith("#")]
    assert len(texts[0]) == len(texts[1]) and "\\ntokens = {" in "".join(texts[1])  # the newline is escaped


def test_calibrate_comment_name_escapes_every_control_character():
    from gemma4_trace.diff.calibrate import toml_comment_name

    name = "a\nb\rc\x00d\x1be\x7ff\u2028g\udcff.h5"
    shown = toml_comment_name(Path("/x") / name)
    assert shown.isascii() and shown.isprintable(), shown
    T.tomllib.loads(f"# {shown}\nversion = 1\n")  # TOML accepts it as a comment


# ---------------------------------------------------------------- tolerance files: bounded
def test_oversized_tolerances_file_refused_before_reading(ref, tmp_path):
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.truncate(1 << 31)  # sparse: 2 GiB that would be read whole
    t = time.monotonic()
    one_line_error(invoke("diff", ref, ref, "--tolerances", big), str(big), "bytes, more than the", "allowed")
    assert time.monotonic() - t < 10


def test_tolerances_file_at_the_size_cap_is_read(ref, tmp_path):
    text = "[[rule]]\nrel_l2 = 1e-4\n"
    ok = tmp_path / "ok.toml"
    ok.write_text(text + "#" * (T.MAX_FILE_BYTES - len(text) - 1) + "\n", encoding="utf-8")
    assert ok.stat().st_size == T.MAX_FILE_BYTES
    assert invoke("diff", ref, ref, "--tolerances", ok).exit_code == 0


def test_too_many_pattern_alternatives_refused_quickly(ref, tmp_path):
    kinds = ",".join(["q"] * 40_000)  # made a 3-step diff take about a minute
    t = time.monotonic()
    one_line_error(
        diff_with(ref, tmp_path, f'[[rule]]\nkind = "{kinds}"\nrel_l2 = 1e-4\n'),
        f"more than {T.MAX_ALTERNATIVES} pattern alternatives",
    )
    assert time.monotonic() - t < 10


def test_matching_is_compiled_once(ref, tmp_path):
    """The most alternatives allowed, all distinct globs, in one rule: one regex, not one
    fnmatch per alternative and tensor (whose cache of 32,768 patterns these would thrash)."""
    kinds = ",".join(f"zz{i}*" for i in range(T.MAX_ALTERNATIVES - 1)) + ",layer_out"
    t = time.monotonic()
    r = diff_with(ref, tmp_path, f'[[rule]]\nkind = "{kinds}"\nrel_l2 = 0.5\n')
    assert r.exit_code == 0, r.output
    assert time.monotonic() - t < 30
    tol = T.load_tolerances(tmp_path / "tol.toml")
    assert tol.resolve("layer_out", 1, "float32", 3).limits["rel_l2"].tolist() == [0.5] * 3
    assert tol.resolve("q", 1, "float32", 3).limits["rel_l2"].tolist() == [1e-4] * 3


def test_too_many_rules_refused(ref, tmp_path):
    one_line_error(
        diff_with(ref, tmp_path, "[[rule]]\nrel_l2 = 1e-4\n" * (T.MAX_RULES + 1)),
        f"more than the {T.MAX_RULES} allowed",
    )


# ---------------------------------------------------------------- tolerance files: values
@pytest.mark.parametrize(
    "text, field",
    [
        ("[[rule]]\nl2_floor = inf\n", "l2_floor is inf"),
        ("[[rule]]\nrel_l2 = inf\n", "rel_l2 is inf"),
        ("[[rule]]\nrel_l2 = 1e400\n", "rel_l2 is inf"),
        ("[[rule]]\nmax_abs = nan\n", "max_abs is nan"),
        ("[tokens]\nnear_tie_margin = inf\n", "near_tie_margin is inf"),
    ],
)
def test_non_finite_values_refused(ref, tmp_path, text, field):
    one_line_error(diff_with(ref, tmp_path, text), field, "not a finite number")


@pytest.mark.parametrize(
    "text",
    [
        "[[rule]]\nkind = " + "[" * 300 + '"q"' + "]" * 300 + "\nrel_l2 = 1\n",
        "[[rule]]\nrel_l2 = " + "{a=" * 300 + "1" + "}" * 300 + "\n",
        "version = " + "[" * 300 + "1" + "]" * 300 + "\n",
        "[[rule]]\nkind = " + "[" * 5000 + "\n",
        "[[rule]]\nlayer = " + "9" * 5000 + "\nrel_l2 = 1\n",
        '[[rule]]\nlayer = "' + "9" * 5000 + '-"\nrel_l2 = 1\n',
    ],
)
def test_deep_or_huge_values_are_one_short_line(ref, tmp_path, text):
    line = one_line_error(diff_with(ref, tmp_path, text), "tol.toml")
    assert len(line) < 400, line


@pytest.mark.parametrize("text", ["a" + ".a" * 100_000 + " = 1\n", "[rule" + ".rule" * 100_000 + "]\n"])
def test_deep_dotted_keys_are_refused_before_parsing(ref, tmp_path, text):
    # Python's TOML parser takes memory quadratic in a dotted key's depth (100,000 parts: over 20 GB)
    tol = tmp_path / "deep.toml"
    tol.write_text(text)
    one_line_error(invoke("diff", ref, ref, "--tolerances", tol), "line 1: a key nested more than 64 deep")


# ---------------------------------------------------------------- the fuzzer's tolerance classes
def _fuzzer():
    spec = importlib.util.spec_from_file_location(
        "fuzz_traces", Path(__file__).resolve().parents[2] / "scripts" / "fuzz_traces.py"
    )
    fz = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_traces"] = fz
    spec.loader.exec_module(fz)
    return fz


@pytest.mark.slow
def test_fuzzer_tolerance_classes_end_cleanly():
    """Hostile tolerance files: `trace diff --tolerances` exits 0, 1 or 2 with one line; hostile
    REF/BASE/OUT names: calibrate writes a TOML that resolves to the same thresholds as plain names.
    Nothing outside the inputs opened, no run over 60 s or 2 GiB."""
    fz = _fuzzer()
    for cls in [*fz.TOLERANCE, "calibrate_name"]:
        rep = fz.fuzz_tolerances(2, SEED, only=cls)
        summary = fz.format_tolerance_report(rep, f"fuzz_tolerances(2, {SEED}, only={cls})")
        assert rep.cases == 2 and rep.mutations[cls] == 2, summary
        assert not rep.failures, summary + "\n" + "\n".join(rep.failures)
        assert rep.watch_ok and not rep.outside and not rep.slow and not rep.big, summary


SEED = 3  # a seed whose two cases per class run in seconds (seed 18 draws a 100,000-deep TOML header: 30 s)
