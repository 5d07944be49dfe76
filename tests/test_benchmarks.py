"""Every benchmark runs as docs/benchmarks.md shows it: `python benchmarks/NAME.py ...` from the
repository root, in a process of its own with no PYTHONPATH (as a user's shell starts it: the
script's folder, not the root, is on sys.path; benchmarks/repo_root.py puts the root there and in
its children's PYTHONPATH). Each runs on the embedded tiny model (hf/tiny_model, or the E2B
structure at tiny widths: make_e2b_random.py --tiny) with its smallest arguments, and must exit 0
and print its table or result lines: the figures are parsed, not just looked for. A benchmark of an
optional engine runs where the engine is installed (every extra is, under `make test`).

Also checked on the source: every script in benchmarks/ is run here, and no benchmark imports or
reaches a private name (`_x`) of the project (tests/test_architecture.py's rule for production code),
nor patches one by name."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_architecture import module_name, private_attributes, sources
from tests.test_layering import imports

pytestmark = pytest.mark.slow  # each runs a benchmark: seconds to a minute of processes

ROOT = Path(__file__).resolve().parents[1]
TINY = "hf/tiny_model"
NUM = r"-?[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?"
TIMEOUT = 600  # one script, however loaded the machine (each takes seconds to a minute when it is idle)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def engine(module: str, extra: str):
    return pytest.mark.skipif(not installed(module), reason=f"needs the [{extra}] extra ({module})")


def bench(script: str, *args) -> str:
    """`python benchmarks/SCRIPT ARGS` from the repository root, no PYTHONPATH: its stdout; it must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, f"benchmarks/{script}", *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, f"{' '.join(cmd[1:])}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}"
    return p.stdout


def suite_cache() -> str:
    """The suite's artifact cache (tests/conftest.py), for a benchmark's --cache: its exports are
    built once and found there by the next run (the export code is tested by each runtime's tests)."""
    return os.environ["GEMMA4_TRACE_CACHE"]


# a prompt and new tokens whose max_seq (16) is that of the runtimes' own tests on the embedded model
# (the short golden's, the LiteRT user-files export's): the benchmark finds their export in the suite's
# cache instead of building one of its own (a LiteRT export is about a minute on 2 cores)
SHARED_LENGTHS = ("--prompt", 12, "--new", 4)


def figure(out: str, pattern: str) -> float:
    """The number `pattern` (a regular expression with one group of NUM) finds in `out`."""
    m = re.search(pattern, out, re.MULTILINE)
    assert m, f"no line matching {pattern!r} in:\n{out[-3000:]}"
    return float(m.group(1))


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(NUM, line)]


def row(out: str, start: str) -> str:
    """The first output line that starts with `start` (leading blanks aside), stripped."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(start)]
    assert lines, f"no line starting {start!r} in:\n{out[-3000:]}"
    return lines[0]


def after(out: str, start: str) -> list[float]:
    """The numbers of the line that starts with `start`, after `start`."""
    return numbers(row(out, start)[len(start) :])


# ---- on the source -----------------------------------------------------------------------


def scripts() -> list[str]:
    """The benchmarks/ files that run as scripts (they have a __main__ block)."""
    return sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text())


RUN_HERE = {  # script -> the test below that runs it
    "bench_capture.py": "test_bench_capture",
    "bench_child_stream.py": "test_bench_child_stream",
    "bench_compression.py": "test_record_cost_on_the_e2b_structure",
    "bench_desktop_e2b.py": "test_bench_desktop_e2b",
    "bench_diff.py": "test_bench_diff",
    "bench_e2b.py": "test_record_cost_on_the_e2b_structure",
    "bench_encode.py": "test_record_cost_on_the_e2b_structure",
    "bench_executorch_e2b.py": "test_bench_executorch_e2b",
    "bench_litert_e2b.py": "test_bench_litert_e2b",
    "bench_llamacpp_callback.py": "test_bench_llamacpp",
    "bench_llamacpp_e2b.py": "test_bench_llamacpp",
    "bench_long_run.py": "test_bench_long_run",
    "bench_openvino_outputs.py": "test_bench_openvino_outputs",
    "bench_prefill_chunk.py": "test_bench_prefill_chunk",
    "bench_quant_replay.py": "test_bench_quant_replay",
    "bench_record.py": "test_bench_record",
    "bench_record_ab.py": "test_bench_record_ab",
    "bench_replay.py": "test_bench_replay",
    "bench_sweep.py": "test_bench_sweep",
    "bench_vision.py": "test_bench_vision",
    "bench_audio.py": "test_bench_audio",
    "bench_writer.py": "test_bench_writer",
    "make_e2b_random.py": "test_record_cost_on_the_e2b_structure",
    "profile_record.py": "test_profile_record",
}


def test_every_script_is_run_here():
    assert scripts() == sorted(RUN_HERE), "a script in benchmarks/ that no test here runs (or one that is gone)"
    assert all(name in globals() for name in RUN_HERE.values())


def private_names_of_the_project() -> set[str]:
    """Every `_x` a production module defines (functions, classes, their methods, module names)."""
    names = set()
    for path in sources(ROOT):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if re.fullmatch(r"_[A-Za-z]\w*", n) and not n.startswith("__")}


def test_no_benchmark_uses_a_private_name_of_the_project():
    modules = {module_name(p, ROOT) for p in sources(ROOT)}
    private = private_names_of_the_project()
    bad = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        where = path.relative_to(ROOT)
        for line, module, names in imports(path, ROOT):
            if module.startswith("gemma4_trace"):
                bad += [f"{where}:{line} imports {module}.{n}" for n in names if n.startswith("_") and n[1:2] != "_"]
        bad += private_attributes(path, ROOT, modules)
        for node in ast.walk(ast.parse(path.read_text())):  # a private name patched by name: setattr(m, "_x", ...)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
                bad.append(f"{where}:{node.lineno} names {node.value!r}, a private name of the project")
    assert not bad, "\n".join(bad)


# ---- the record cost (trace record against generate() and the forward over every prompt row) ----


def test_record_cost_on_the_e2b_structure(tmp_path):
    """make_e2b_random.py --tiny (E2B's 35 layers, 20 reusing K/V, at tiny widths), then bench_e2b.py
    on it (every step: REF in float32 from the same weights too), then bench_encode.py and
    bench_compression.py on the traces bench_e2b.py wrote."""
    model, work = tmp_path / "e2b-tiny", tmp_path / "run"
    out = bench("make_e2b_random.py", model, "--tiny")
    assert re.search(rf"wrote .*: {NUM} M parameters, {NUM} MiB in 1 shards \(bfloat16\)", out), out
    out = bench("bench_e2b.py", "--bf16", model, "--f32", model, "--prompt-len", 8, "--new-tokens", 2, "--work", work)
    for name in ("generate", "forward", "record", "record-last", "replay", "diff", "ref-f32"):
        timed, process, peak_gib = after(out, name + " ")[:3]
        assert timed > 0 and process > 0 and peak_gib > 0, name
    for name in ("record / generate", "record / forward", "record-last / generate"):
        assert figure(out, rf"^{re.escape(name)} = ({NUM})x") > 0, name
    # the forward does the recording's work without its hooks: the same tokens; so do record-last and generate()
    assert "tokens equal: True" in row(out, "record / forward =")
    assert "tokens equal: True" in row(out, "record-last / generate =")
    assert "(goal <= 1.10x)" in row(out, "record / forward =") and "(goal <= 1.05x)" in row(out, "record-last /")
    assert "trace diff BASE LAST: exit 0: match" in out
    assert figure(out, rf"^replay / record = ({NUM})x") > 0
    assert "prefill layer_out rel-L2 vs REF (float32), layers 0 / 5 / 10 / 20 / 34" in out
    for name in ("BASE (HF bf16):", "RUN (static bf16):"):
        rel = numbers(row(out, name).split(":", 1)[1])
        assert len(rel) == 5 and all(0 <= x < 1 for x in rel), row(out, name)

    out = bench("bench_encode.py", work / "LAST.h5", "--repeats", 1)
    assert figure(out, rf"LAST.h5: ({NUM}) stored chunks") > 0
    for way in ("zlib Z_RLE per plane", "encode_chunk (ISA-L", "one zlib level-1 stream"):
        seconds, mib = numbers(row(out, way).split(")")[-1])
        assert seconds > 0 and mib >= 0, row(out, way)

    out = bench("bench_compression.py", work / "BASE.h5", "--repeats", 1)
    assert "dtype bfloat16" in out
    for storage in ("float32", "bf16"):
        for setting in ("gzip1+shuffle", "gzip1 ", "gzip4+shuffle", "none", "writer chunks"):
            cells = after(out, f"{storage:<8} {setting}")  # MiB and seconds of the hidden rows, logits, mask
            assert len(cells) == 6 and all(x >= 0 for x in cells), (storage, setting)
        assert after(out, f"{storage:<8} none")[0] > 0  # the hidden rows, stored raw


def test_bench_record():
    out = bench("bench_record.py", "--steps", 2, "--prompt-len", 8, "--repeats", 1, "--skip-e2b")
    line = row(out, "generate()")
    gen, fwd, rec, ratio, per_forward = numbers(line.replace("generate()", ""))
    assert min(gen, fwd, rec) > 0  # the ratios are of the unrounded medians
    assert ratio == pytest.approx(rec / gen, rel=0.05, abs=0.01) and per_forward == pytest.approx(rec / fwd, rel=0.05)
    assert figure(out, rf"trace size ({NUM}) MiB") > 0


def test_bench_record_ab():
    out = bench("bench_record_ab.py", TINY, "--rounds", 1, "--prompt-len", 8, "--new-tokens", 2)
    for name in ("record-last, ISA-L", "record-last, zlib Z_RLE"):
        assert figure(out, rf"^{re.escape(name)}\s+median\s+{NUM} s\s+({NUM})x generate\(\)") > 0


def test_bench_audio():
    out = bench("bench_audio.py", "--tiny", "--seconds", 2, "--rounds", 1)
    assert "audio tower: 2 layers, hidden 32" in out and "clip: 2 s, 199 mel frames" in out
    tower, gen, rec = (after(out, label)[0] for label in ("tower forward", "generate() 1 token", "trace record"))
    assert min(tower, gen, rec) > 0
    assert figure(out, rf"record / generate: ({NUM})x") == pytest.approx(rec / gen, rel=0.05, abs=0.01)
    assert figure(out, rf"tower \+ audio sites / tower: ({NUM})x") == pytest.approx(1 + (rec - gen) / tower, abs=0.02)
    assert figure(out, rf"audio sites on disk: {NUM} MiB, ({NUM}) KiB per second of audio") > 0


def test_bench_vision():
    out = bench("bench_vision.py", "--tiny", "--tokens", 64, "--rounds", 1)
    assert "vision tower: 2 layers, hidden 32" in out and "64 soft tokens" in out
    tower, gen, rec = (after(out, label)[0] for label in ("tower forward", "generate() 1 token", "trace record"))
    assert min(tower, gen, rec) > 0
    ratio = figure(out, rf"record / generate: ({NUM})x")
    assert ratio == pytest.approx(rec / gen, rel=0.05, abs=0.01)
    assert figure(out, rf"trace size: ({NUM}) MiB") > 0


def test_bench_writer():
    out = bench("bench_writer.py", "--prompt-len", 8, "--steps", 2, "--repeats", 1, "--model-dir", TINY)
    for name in ("generate()", "record (before", "record + writer thread ", "+ whole chunks encoded"):
        assert figure(out, rf"^\s+{re.escape(name)}.*? median\s+{NUM} s\s+({NUM})x") > 0, name
    assert len(re.findall(rf"trace ({NUM}) MiB", out)) == 5


def test_profile_record():
    out = bench("profile_record.py", "--model", "tiny", "--steps", 2, "--top", 3)
    assert figure(out, rf"generate\(\) ({NUM}) s, record {NUM} s under cProfile") > 0
    assert "Ordered by: cumulative time" in out and "record_loaded" in out


# ---- trace diff, long runs, replay --------------------------------------------------------------


def test_bench_diff(tmp_path):
    out = bench("bench_diff.py", "--prefill", 16, "--decode", 2, "--dir", tmp_path, "--rounds", 1, "--baseline")
    assert "exit code 0" in out and row(out, "match: no divergence")
    assert figure(out, rf"^b/a = ({NUM})") > 0
    assert 0 < figure(out, rf"workers: ({NUM}) MB PSS") < 500


def test_bench_long_run():
    out = bench("bench_long_run.py", "--steps", 2)
    steps, *figures = numbers(row(out, "2 "))
    assert steps == 2 and len(figures) == 7 and all(x > 0 for x in figures)
    assert "diff exit" not in out


def test_bench_prefill_chunk():
    out = bench("bench_prefill_chunk.py", "--max-seqs", 32, "--chunk", 8, "--prompt", 4, "--new-tokens", 2)
    assert out.count("| match |") == 2
    assert figure(out, rf"chunked / whole \| ({NUM})x") > 0


def test_bench_replay():
    out = bench("bench_replay.py", "--new-tokens", 4, "--models", "tiny")
    assert figure(out, rf"HF generate\s+({NUM}) tok/s") > 0
    assert figure(out, rf"static eager\s+({NUM}) tok/s") > 0
    figure(out, rf"HF generate ({NUM}) MiB, static replay {NUM} MiB")  # peak RSS above the loaded model


def test_bench_sweep():
    """w1 on the shipped prompts and on a checkpoint folder (--e2b); --workers 2 and Ray left out
    (tests/test_sweep.py and test_sweep_ray.py run them; Ray's start alone is 15-20 s here)."""
    args = ("--prompts", 1, "--max-new-tokens", 2, "--skip", "w2,ray", "--e2b", TINY, "--e2b-prompts", 1)
    out = bench("bench_sweep.py", *args)
    assert figure(out, rf"^\s+w1\s+{NUM} s\s+({NUM}) prompts/min") > 0
    assert figure(out, rf"^\s+e2b-w1\s+{NUM} s\s+({NUM}) prompts/min") > 0
    assert figure(out, rf"K=64\s+({NUM}) h") > 0


@engine("torchao", "quant")
def test_bench_quant_replay(tmp_path):
    out = bench(
        "bench_quant_replay.py", tmp_path, "--model", TINY, "--prompt", 4, "--new", 2, "--runtimes", "static,static-w8"
    )
    wall, times, rss, times_rss = after(out, "static ")
    assert wall > 0 and rss > 0 and times == times_rss == 1.0  # the float replay: the ratios' 1.00
    assert all(x > 0 for x in after(out, "static-w8 "))
    assert row(out, "diff REF static:").split(": ", 1)[1].startswith("match")


# ---- the runtimes' capture, and the engines ---------------------------------------------------


def capture_rows(out: str, names) -> None:
    for name in names:  # prefill and decode: alone, capture, ratio (2 decimals: 0.00 on a hiccup); the trace's start
        cells = after(out, name + " ")
        assert len(cells) == 7 and all(cells[i] > 0 for i in (0, 1, 3, 4)) and min(cells) >= 0, row(out, name + " ")


def test_bench_capture(tmp_path):
    names = ["static"] + (["llama.cpp:F32:layer_out"] if installed("llama_cpp") else [])
    args = ("--model", TINY, "--prompt", 4, "--new", 2, "--repeats", 1, "--runtimes", ",".join(names))
    capture_rows(bench("bench_capture.py", tmp_path, *args), names)


@engine("llama_cpp", "llamacpp")
def test_bench_child_stream(tmp_path):
    args = ("--model", TINY, "--prompt", 4, "--new", 2, "--repeats", 1, "--runtimes", "llama.cpp:F32")
    cells = after(bench("bench_child_stream.py", tmp_path, *args), "llama.cpp:F32 ")
    # prompt, decode: alone, then each, in band, batched, ratios (2 decimals: a tiny time or ratio reads 0.00)
    assert len(cells) == 14 and cells[0] > 0 and all(x >= 0 for x in cells), cells


@engine("llama_cpp", "llamacpp")
def test_bench_llamacpp(tmp_path):
    """bench_llamacpp_e2b.py (export, quantize, replay, llama.cpp's own speed), then
    bench_llamacpp_callback.py on the Q4_K_M file it wrote."""
    out = bench("bench_llamacpp_e2b.py", TINY, "--prompt", 4, "--new", 2, "--work", tmp_path)
    for name in ("F32 GGUF: convert (writer)", "Q4_K_M: quantize (llama.cpp)", "replay llama.cpp:Q4_K_M"):
        assert figure(out, rf"^{re.escape(name)}\s+({NUM}) s") > 0, name
    for name in ("prompt, no callback", "prompt, capture callback", "decode, no callback", "decode, capture callback"):
        assert figure(out, rf"^llama.cpp {name}\s+({NUM}) tok/s") > 0, name
    out = bench("bench_llamacpp_callback.py", tmp_path / "q4_k_m.gguf", "--rounds", 1, "--steps", 2)
    for label in ("no callback", "trivial callback", "asked, none", "layer_out", "every kind"):
        best, median, ratio, asked = after(out, label)
        assert best > 0 and median > 0 and ratio > 0 and asked >= 0, label
    assert after(out, "every kind")[-1] > 0  # the callback is asked about every node


@engine("openvino", "openvino")
def test_bench_openvino_outputs(tmp_path):
    args = ("--model", TINY, "--prompt", 4, "--new", 2, "--modes", "openvino", "--repeats", 1)
    out = bench("bench_openvino_outputs.py", tmp_path, *args)
    for part in ("infer", "kernels", "child 1st", "child"):  # prefill, decode: none, then layer_out, every and ratios
        cells = after(out, f"{'openvino':16s} {part:9s} ")
        assert len(cells) == 10 and all(x >= 0 for x in cells), part


@pytest.mark.parametrize(
    "family, modes",
    [
        pytest.param("openvino", "openvino", marks=engine("openvino", "openvino")),  # the export, a replay, a diff
        pytest.param("mlx", "mlx-q8,mlx-q8-dq", marks=engine("mlx", "mlx")),  # replays, a diff with its baseline
        pytest.param("own-file", "onnx,mobius,mlx-q4", marks=(engine("mobius", "mobius"), engine("mlx", "mlx"))),
    ],
)
def test_bench_desktop_e2b(tmp_path, family, modes):
    args = (family, tmp_path, "--model", TINY, *SHARED_LENGTHS, "--modes", modes, "--cache", suite_cache())
    out = bench("bench_desktop_e2b.py", *args)
    if family == "own-file":  # the own export, mobius's graph and an mlx-lm folder passed back: the built-in traces
        for mode in modes.split(","):
            m = re.search(
                rf"^own file == built-in, (\S+) own-{mode} vs --runtime {mode}: (\d+)/(\d+) datasets", out, re.M
            )
            assert m, (mode, out)
            option, equal, total = m.group(1), int(m.group(2)), int(m.group(3))
            assert equal == total > 40, (mode, equal, total)
            assert after(out, f"replay {option} own-{mode} ")[0] > 0, mode
            assert re.search(rf"^diff REF {option} own-{mode}: (match|first divergence)", out, re.M), out
            assert re.search(rf"^worst error / tolerance, REF {option} own-{mode}: .*logits [0-9.e+-]+", out, re.M), out
        return
    for mode in modes.split(","):
        wall, rss, child = after(out, f"replay --runtime {mode} ")
        assert wall > 0 and rss > 0 and child > 0, mode
    if family == "openvino":
        assert after(out, "export-openvino --runtime openvino ")[0] > 0
    for line in (ln for ln in out.splitlines() if ln.startswith("diff REF ")):
        assert re.match(r"diff REF [^:]+: (match|first divergence)", line), line
    assert out.count("diff REF ") == (1 if family == "openvino" else 2)
    worst = re.findall(r"^worst error / tolerance, REF (\S+): (.+)$", out, re.MULTILINE)
    if family == "openvino":  # the family's float runtime: each kind's worst rel-L2 over its threshold
        ((name, cells),) = worst
        ratios = dict(c.rsplit(" ", 1) for c in cells.split(", "))
        assert name == "openvino" and {"layer_out", "logits"} <= set(ratios), cells
        assert all(float(v) >= 0 for v in ratios.values()), cells
    else:
        assert worst == []


@engine("litert_torch", "litert")
def test_bench_litert_e2b(tmp_path):
    args = ("--model", TINY, *SHARED_LENGTHS, "--modes", "litert", "--cache", suite_cache())
    out = bench("bench_litert_e2b.py", tmp_path, *args)
    for name in ("export-litert --runtime litert ", "replay --runtime litert "):
        wall, rss, child = after(out, name)
        assert wall > 0 and rss > 0, name
    assert re.search(r"^diff REF litert: (match|first divergence)", out, re.MULTILINE), out


@engine("executorch", "executorch")
def test_bench_executorch_e2b(tmp_path):
    args = ("--tiny", "--layers", 2, "--modes", "executorch", "--prompt", 4, "--new", 2, "--cache", suite_cache())
    out = bench("bench_executorch_e2b.py", tmp_path, *args)
    assert figure(out, rf"^\| 2 \| {NUM} GiB \| executorch \| ({NUM}) s \|") > 0
