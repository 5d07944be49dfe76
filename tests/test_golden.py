"""Golden traces as a regression gate: the static runtime and the installed transformers
must both still reproduce them."""

import shutil

import pytest

from gemma4_trace.diff import diff_traces, format_text
from gemma4_trace.hf.model import DEMO_IMAGE_PROMPT
from gemma4_trace.recorder import golden
from gemma4_trace.recorder.rerecord import rerecord_trace
from gemma4_trace.traces import TraceReader

pytestmark = pytest.mark.slow  # the pytest plug-in replaying every golden; make test-fast skips it


def test_goldens_are_small_and_hashed():
    assert set(golden.recorded_hashes()) == set(golden.GOLDENS)
    assert golden.content_hashes() == golden.recorded_hashes(), "run scripts/make_golden.py and review the change"
    for name, g in golden.GOLDENS.items():
        limit = 5 << 19 if g.images or g.audios else 1 << 20  # 2.5 MiB with an encoder tower's rows, else 1 MiB
        assert golden.golden_path(name).stat().st_size <= limit, name


def test_goldens_cover_what_they_claim():
    with TraceReader(golden.golden_path("window")) as r:
        window = r.model_config["text_config"]["sliding_window"]
        assert r.n_positions > 3 * window
    with TraceReader(golden.golden_path("eos")) as r:
        assert int(r.tokens()[-1]) in r.eos_token_ids and r.n_steps < r.max_new_tokens
    with TraceReader(golden.golden_path("image")) as r:
        assert "pixel_values" in r.extra_inputs() and r.prompt_text == DEMO_IMAGE_PROMPT


def test_static_runtime_matches_golden(gemma4_golden_case):
    """One item per golden x mode (parametrized by the plug-in): pytest -n runs them in parallel."""
    res = gemma4_golden_case.check("static")
    assert res.match and res.to_json()["tokens"]["accuracy"] == 1.0


def test_cases_are_every_golden_and_mode():
    from gemma4_trace.pytest_plugin import gemma4_golden_cases

    ids = [c.id for c in gemma4_golden_cases()]
    assert ids == [f"{n}-{m}" for n in sorted(golden.GOLDENS) for m in ("teacher-forced", "free-running")]
    assert [c.id for c in gemma4_golden_cases(modes=("teacher-forced",))] == [
        f"{n}-teacher-forced" for n in sorted(golden.GOLDENS)
    ]


@pytest.mark.parametrize("name", list(golden.GOLDENS))
def test_rerecording_with_installed_transformers_matches(name, tmp_path):
    """A transformers upgrade that changes Gemma 4 numerics fails here, at its first divergence."""
    out = tmp_path / f"{name}.h5"
    rerecord_trace(golden.golden_path(name), out)
    res = diff_traces(golden.golden_path(name), out)
    assert res.match, format_text(res)


USER_TEST = """
def test_my_runtime(gemma4_golden):
    gemma4_golden.check("{runtime}", modes=("teacher-forced",))
"""


CASE_TEST = """
import pytest

@pytest.mark.gemma4_modes("teacher-forced")
def test_my_runtime(gemma4_golden_case):
    gemma4_golden_case.check("{runtime}")
"""


@pytest.fixture
def _gemma4_imported():
    import transformers

    transformers.Gemma4ForCausalLM, transformers.Gemma4ForConditionalGeneration  # noqa: B018 (lazy imports)


@pytest.fixture
def pytester(_gemma4_imported, pytester):
    """pytester, with transformers' Gemma 4 imported before it snapshots sys.modules: an
    in-process run unloads the modules it imported, and torch's operator libraries cannot be
    imported twice in one process (whichever test runs first in a process, with -k or under
    xdist, would break the next)."""
    return pytester


def test_plugin_cases_one_item_per_golden(pytester):
    pytester.makepyfile(test_bad=CASE_TEST.format(runtime="tests.support.plugin_runtime:make_no_softcap"))
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-v")
    res.assert_outcomes(failed=len(golden.GOLDENS))  # the soft-cap bug shows in every golden
    res.stdout.fnmatch_lines(
        [
            "*test_my_runtime?short-teacher-forced? FAILED*",
            "*runtime diverges from golden short.h5 (teacher-forced): first divergence: *logits*",
        ]
    )


def test_plugin_passes_a_correct_runtime_and_fails_a_buggy_one(pytester):
    pytester.makepyfile(test_ok=USER_TEST.format(runtime="static"))
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.makepyfile(test_bad=USER_TEST.format(runtime="tests.support.plugin_runtime:make_no_softcap"))
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "test_bad.py")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(
        ["*runtime diverges from golden traces*", "*short.h5 (teacher-forced): first divergence: *logits*"]
    )


def test_update_golden_rerecords_with_hf(pytester, tmp_path):
    folder = tmp_path / "goldens"
    folder.mkdir()
    shutil.copy(golden.golden_path("short"), folder / "short.h5")
    # make the file in the folder something other than an HF recording
    from gemma4_trace.replayer.replay import replay_trace

    replay_trace(golden.golden_path("short"), folder / "short.h5", force=True)
    with TraceReader(folder / "short.h5") as r:
        assert r.provenance["runtime"] == "static"
    pytester.makepyfile(test_ok=USER_TEST.format(runtime="static"))
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--golden-dir", str(folder), "--update-golden")
    res.assert_outcomes(passed=1)
    with TraceReader(folder / "short.h5") as r:
        assert r.provenance["runtime"].startswith("hf-transformers")
    # the same recording as the shipped golden (bit-exact only on the CPU that recorded it)
    res = diff_traces(golden.golden_path("short"), folder / "short.h5")
    assert res.match and res.reference.runtime == res.candidate.runtime, format_text(res)


def _with_extra(src, dst, name, value):
    import h5py

    from gemma4_trace.traces.schema import input_extra_path

    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        f.create_dataset(input_extra_path(name), data=value)


@pytest.mark.parametrize("name", ["suppress_tokens", "max_new_tokens"])
def test_update_golden_refuses_extra_inputs_the_forward_does_not_take(pytester, tmp_path, name):
    """An extra input is passed to generate() by name on a re-record: suppress_tokens would
    silently change the tokens, max_new_tokens would crash the update. Both are refused, in one
    line, before any golden is rewritten."""
    import numpy as np

    folder = tmp_path / "goldens"
    folder.mkdir()
    shutil.copy(golden.golden_path("short"), folder / "a.h5")  # re-recorded first if nothing is checked
    with TraceReader(golden.golden_path("short")) as r:
        first = int(r.tokens()[0])
    _with_extra(golden.golden_path("short"), folder / "b.h5", name, np.array([first]))
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}
    pytester.makepyfile(test_ok=USER_TEST.format(runtime="static"))
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--golden-dir", str(folder), "--update-golden")
    res.assert_outcomes(errors=1)
    lines = [line for line in res.stdout.lines if "not an input of" in line]
    assert len(lines) >= 1 and f"extra input '{name}'" in lines[0] and "b.h5" in lines[0], res.stdout.str()
    assert "Traceback" not in res.stdout.str()
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()} == before


def test_extra_input_shapes_are_checked(tmp_path):
    import numpy as np

    from gemma4_trace.recorder.rerecord import check_extra_inputs
    from gemma4_trace.traces.errors import TraceToolError

    with TraceReader(golden.golden_path("image")) as r:
        check_extra_inputs(r)  # the shipped image golden: pixel_values, image_position_ids, mm_token_type_ids
    _with_extra(golden.golden_path("short"), tmp_path / "s.h5", "mm_token_type_ids", np.zeros((1, 5), np.int64))
    with (
        TraceReader(tmp_path / "s.h5") as r,
        pytest.raises(TraceToolError, match=r"mm_token_type_ids has shape \(1, 5\), expected \(1, 13\)"),
    ):
        check_extra_inputs(r)


def test_plugin_escapes_golden_names(pytester, tmp_path):
    """A golden's file name is printed as the CLI prints names: no terminal escape codes pass."""
    folder = tmp_path / "goldens"
    folder.mkdir()
    evil = "short\x1b]0;owned\x07\x1b[2J"
    shutil.copy(golden.golden_path("short"), folder / f"{evil}.h5")
    pytester.makepyfile(
        test_bad=USER_TEST.format(runtime="tests.support.plugin_runtime:make_no_softcap"),
        test_case=CASE_TEST.format(runtime="tests.support.plugin_runtime:make_no_softcap"),
    )
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-v", "--golden-dir", str(folder))
    res.assert_outcomes(failed=2)
    out = res.stdout.str()
    assert "\x1b" not in out and "\x07" not in out
    assert "short\\x1b]0;owned\\x07\\x1b[2J.h5 (teacher-forced): first divergence" in out, out
