"""Tolerance files and the files `trace calibrate` writes are untrusted input (issue 18, items 2
and 7): a file name cannot write configuration, a tolerances file is bounded in size, in pattern
count and in matching cost, and refuses non-finite values and deep nesting in one line. Each
test here failed before the change it covers."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from gemma4_trace.diff import tolerances as T
from gemma4_trace.recorder import golden
from tests.support import invoke, one_line_error

from .diff_fixtures import copy_trace, noise

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
