"""`trace diff` through the click CLI: exit codes, --json contract, --report, one-line errors."""

import dataclasses
import json
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from tests.support.cli import invoke, one_line_error
from tests.support.synth import LAYERS, write_trace


@pytest.fixture
def traces(tmp_path):
    ref, same, bad = tmp_path / "ref.h5", tmp_path / "same.h5", tmp_path / "bad.h5"
    write_trace(ref)
    write_trace(same, mode="teacher-forced")

    def edit(k, l, s, rows):
        if (k, l, s) == ("attn_out", 1, 2):
            rows[0, 3] += 2.0
        return rows

    write_trace(bad, mode="teacher-forced", edit=edit)
    return ref, same, bad


def test_exit_codes_and_text(traces):
    ref, same, bad = traces
    r = invoke("diff", ref, same)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("match: no divergence")
    r = invoke("diff", ref, bad)
    assert r.exit_code == 1
    assert r.output.splitlines()[0].startswith(
        "first divergence: decode step 2, layer 1 (full_attention, stores K/V for later layers), kind attn_out, "
        "position 6, channel 3: rel-L2"
    )


def test_json_contract(traces):
    ref, same, bad = traces
    for path, code in ((same, 0), (bad, 1)):
        r = invoke("diff", ref, path, "--json")
        assert r.exit_code == code
        j = json.loads(r.output)
        assert set(j) >= {"match", "first_divergence", "tokens"}
        assert j["match"] is (code == 0)
        assert set(j["tokens"]) >= {"reference", "candidate", "accuracy", "first_mismatch_step"}
    d = j["first_divergence"]
    assert {k: d[k] for k in ("step", "phase", "layer", "kind", "position", "metric")} == {
        "step": 2,
        "phase": "decode",
        "layer": 1,
        "kind": "attn_out",
        "position": 6,
        "metric": "rel_l2",
    }
    assert isinstance(d["value"], float) and d["threshold"] == 1e-4


def test_report_written_and_not_overwritten(traces, tmp_path):
    ref, _, bad = traces
    out = tmp_path / "r.html"
    r = invoke("diff", ref, bad, "--report", out)
    assert r.exit_code == 1 and out.is_file()
    HTMLParser().feed(out.read_text())
    assert "<link" not in out.read_text() and "https://" not in out.read_text()
    r = invoke("diff", ref, bad, "--report", out)
    one_line_error(r, "already exists")
    assert invoke("diff", ref, bad, "--report", out, "--force").exit_code == 1


def test_bad_input_exits_2_with_one_line(traces, tmp_path):
    ref, same, _ = traces
    other = tmp_path / "other.h5"
    write_trace(other, layers=[dataclasses.replace(li, num_kv_heads=2) for li in LAYERS])
    for args in ((ref, other), (ref, tmp_path / "missing.h5"), (ref, same, "--tolerances", tmp_path / "none.toml")):
        one_line_error(invoke("diff", *args))
    r = invoke("diff", ref, other)
    assert "different model architectures" in r.output and "num_kv_heads 1 vs 2" in r.output
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nkind = "q"\nrel_l2 = -1\n')
    r = invoke("diff", ref, same, "--tolerances", bad)
    one_line_error(r, bad, "rel_l2 must be >= 0")


def test_tolerances_option(traces, tmp_path):
    ref, _, bad = traces
    tol = tmp_path / "t.toml"
    tol.write_text('[[rule]]\nkind = "attn_out"\nlayer = "1"\nrel_l2 = 1.0\n')
    assert invoke("diff", ref, bad, "--tolerances", tol).exit_code == 0


def test_no_torch_imported(traces):
    ref, _, bad = traces
    code = (
        "import sys, gemma4_trace.diff, gemma4_trace.cli\n"
        "from click.testing import CliRunner\n"
        "from gemma4_trace.cli import main\n"
        "r = CliRunner().invoke(main, ['diff', '--help'])\n"
        "assert r.exit_code == 0 and 'REF.h5' in r.output, r.output\n"
        f"r = CliRunner().invoke(main, ['diff', {str(ref)!r}, {str(bad)!r}, '--json'])\n"
        "assert r.exit_code == 1, r.output\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_generated_text_shown_when_the_tokenizer_is_known():
    from gemma4_trace.recorder import golden

    path = str(golden.golden_path("short"))
    res = invoke("diff", path, path)
    assert res.exit_code == 0, res.output
    assert 'REF text: "Once upon"' in res.output and 'RUN text: "Once upon"' in res.output


def test_each_file_written_is_said_on_stderr_and_stdout_stays_the_report(traces, tmp_path):
    ref, _, bad = traces
    html = tmp_path / "r.html"
    r = invoke("diff", ref, bad, "--json", "--report", html)
    assert r.exit_code == 1 and html.is_file()
    json.loads(r.stdout)  # stdout: the JSON alone
    assert r.stderr.strip().splitlines() == [f"wrote {html} (the HTML report)"]


def test_the_shipped_profiles_are_listed_and_named_not_pathed(tmp_path):
    """`--help` lists every shipped profile, a name that is no file and no profile says which
    profiles there are, and the report names a profile, not its path inside the install."""
    from gemma4_trace.diff.tolerances import profile_names
    from gemma4_trace.recorder import golden

    names = profile_names()
    assert len(names) >= 5
    text = " ".join(invoke("diff", "--help").stdout.split())
    assert all(n in text for n in names), text
    ref = golden.golden_path("short")
    r = invoke("diff", ref, ref, "--tolerances", "llamacpp-f3")
    line = one_line_error(r, "no such file, nor a shipped profile")
    assert all(n in line for n in names), line
    r = invoke("diff", ref, ref, "--tolerances", "llamacpp-f32")
    assert r.exit_code == 0 and "tolerances: profile llamacpp-f32" in r.stdout and "/profiles/" not in r.stdout
