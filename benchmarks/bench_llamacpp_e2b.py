"""llama.cpp at E2B width: conversion, quantization, a Q4_K_M replay and llama.cpp's own speed.

    python benchmarks/make_e2b_random.py /tmp/e2b/f32/e2b-random --dtype float32
    python benchmarks/bench_llamacpp_e2b.py /tmp/e2b/f32/e2b-random --prompt 64 --new 8
    python benchmarks/bench_llamacpp_e2b.py MODEL --prompt 32 --new 8   # any float32 Gemma 4 text checkpoint

Every measured command runs in a fresh process of its own (one at a time), with the GGUF cache
in --work (empty at the start, so the first export really converts):

  record      trace record --input-ids (a seeded random prompt) --max-new-tokens  -> REF.h5 (not in the table)
  convert     trace export-gguf --type F32     the project's writer (its own "built in" time, and the wall time)
  quantize    trace export-gguf --type Q4_K_M  llama.cpp's llama_model_quantize on the cached F32 file
  replay      trace replay REF --runtime llama.cpp:Q4_K_M (teacher-forced): wall time, peak RSS of
              the trace process and of its llama.cpp child (getrusage of each: SELF and CHILDREN)
  speed       llama.cpp alone on the Q4_K_M file (the replay's settings: CPU, F32 KV cache, the
              whole prompt as one batch), after an untimed pass that pages the memory-mapped
              file in: prompt and decode tokens/s without an eval callback
              and with the replay's capture callback (every canonical node copied out and
              pickled; written to /dev/null, not a pipe)

The table is printed at the end. On a busy machine every figure is a bound, not a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root

ROOT = repo_root.ROOT
PY = sys.executable

# a `trace` command in this process's child, reporting its own peak RSS and its children's
RUN_CLI = (
    "import resource, runpy, sys\n"
    "sys.argv = ['trace'] + sys.argv[1:]\n"
    "code = 0\n"
    "try:\n    runpy.run_module('gemma4_trace', run_name='__main__')\n"
    "except SystemExit as e:\n    code = e.code\n"
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
    " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def cli(env, *args) -> dict:
    """One `trace` command in a fresh process: wall seconds, its output, peak RSS (MiB) of the
    trace process and of its largest child (the llama.cpp process, for a llama.cpp replay)."""
    t0 = time.perf_counter()
    p = subprocess.run([PY, "-c", RUN_CLI, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"trace {' '.join(map(str, args))} failed (exit {p.returncode}):\n{p.stdout}{p.stderr}")
    rss = [line.split()[1:] for line in p.stderr.splitlines() if line.startswith("PEAK_RSS_KB")]
    self_kb, children_kb = (int(x) for x in rss[-1]) if rss else (0, 0)
    return dict(wall=wall, out=p.stdout.strip(), rss=self_kb / 1024, child_rss=children_kb / 1024)


def diff_first_line(env, ref, run, *more) -> str:
    """The first line `trace diff REF RUN [more]` prints (its verdict or first divergence); when it
    prints nothing, its exit status and the last line of its error output."""
    p = subprocess.run(
        [PY, "-m", "gemma4_trace", "diff", ref, run, *more], capture_output=True, text=True, env=env, cwd=ROOT
    )
    return (p.stdout.splitlines() or [f"(exit {p.returncode}) {(p.stderr.strip().splitlines() or [''])[-1]}"])[0]


def print_table(rows, diffs) -> None:
    """The command table (wall time, peak RSS of the trace process and of its child), each
    command's last output line, then each diff's first line."""
    print(f"\n{'command':46s} {'wall s':>8s} {'peak RSS MiB':>13s} {'child MiB':>10s}")
    for name, r in rows:
        print(f"{name:46s} {r['wall']:8.1f} {r['rss']:13.0f} {r['child_rss']:10.0f}")
    for name, r in rows:
        print(f"  {name}: {r['out'].splitlines()[-1][:240] if r['out'] else ''}")
    for name, line in diffs:
        print(f"diff REF {name}: {line}")


def seconds_in(note: str) -> float:
    """The seconds of export-gguf's "built in N s" (its own time, model load excluded)."""
    m = re.search(r"(?:built|quantized) in ([0-9.]+) s", note)
    return float(m.group(1)) if m else float("nan")


# ------------------------------------------------------------------ llama.cpp's own speed (a child)
def _decode(L, ctx, capture, tokens: list[int], first: int, vocab: int) -> int:
    """One llama_decode of `tokens` from position `first`; the greedy next token."""
    import numpy as np

    batch = L.llama_batch_init(len(tokens), 0, 1)
    for j, tok in enumerate(tokens):
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, first + j, 1
        batch.seq_id[j][0] = 0
        batch.logits[j] = j == len(tokens) - 1
    batch.n_tokens = len(tokens)
    if capture is not None:
        capture.first, capture.mask_rows, capture.on = first, {}, True
    rc = L.llama_decode(ctx, batch)
    if capture is not None:
        capture.on = False
    L.llama_batch_free(batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(vocab,)).argmax())


def child_speed(gguf_path: str, ids: list[int], n_new: int) -> dict:
    """Prompt and decode tokens/s of llama.cpp on the file, without and with the capture callback."""
    import ctypes

    from gemma4_trace.replayer.child import send_msg
    from gemma4_trace.replayer.runtimes.llamacpp.engine import GGML_TYPE_F32, LlamaCppEngine

    sink = open(os.devnull, "wb")  # noqa: SIM115 - lives as long as the process
    send = lambda kind, layer, arr: send_msg(sink, ("tensors", [(kind, layer, arr)]))  # noqa: E731  (pickled as the child does)
    # the replay's engine: llama.cpp's backend started, its log kept quiet, and the replay's capture
    # callback (engine.cap); the engine lives as long as this function, as its log callback must
    engine = LlamaCppEngine(send)
    L = engine.L
    mp = L.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts = 0, False
    model = L.llama_model_load_from_file(gguf_path.encode(), mp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    engine.cap.ask_for(None, L.llama_model_n_layer(model))  # every kind, as a replay without --kinds asks
    threads = max(1, min(4, os.cpu_count() or 1))
    n_ctx = len(ids) + n_new
    result = {"threads": threads}
    # a first pass pages the file in (the weights are memory-mapped): not timed
    for label, capture in (("warm-up", None), ("plain", None), ("capture", engine.cap)):
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = GGML_TYPE_F32
        if capture is not None:
            capture.n_ctx = n_ctx
            cp.cb_eval = ctypes.cast(capture.c_callback, type(cp.cb_eval))
        ctx = L.llama_init_from_model(model, cp)

        t0 = time.perf_counter()
        tok = _decode(L, ctx, capture, ids, 0, vocab)
        t1 = time.perf_counter()
        for k in range(n_new):
            tok = _decode(L, ctx, capture, [tok], len(ids) + k, vocab)
        t2 = time.perf_counter()
        if label != "warm-up":
            result[label] = dict(prompt_tps=len(ids) / (t1 - t0), decode_tps=n_new / (t2 - t1))
        L.llama_free(ctx)
    return result


# ------------------------------------------------------------------ the parent
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a float32 Gemma 4 text checkpoint folder")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (a seeded random prompt)")
    ap.add_argument("--new", type=int, default=8, help="new tokens (REF's, replayed teacher-forced)")
    ap.add_argument("--work", help="folder for REF, the GGUF files and the cache (default: a temporary one)")
    ap.add_argument("--child-speed", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_speed:
        path, ids, n_new = args.child_speed
        print(json.dumps(child_speed(path, json.loads(ids), int(n_new))))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GEMMA4_TRACE_CACHE": str(work / "cache")}  # PYTHONPATH: repo_root put the root there
    config = json.loads((Path(args.model) / "config.json").read_text())
    text = config.get("text_config", config)
    import random

    rng = random.Random(0)
    ids = [2] + [rng.randrange(3, int(text["vocab_size"])) for _ in range(args.prompt - 1)]
    ref, f32, q4, run = work / "ref.h5", work / "f32.gguf", work / "q4_k_m.gguf", work / "run.h5"
    for p in (ref, f32, q4, run):
        p.unlink(missing_ok=True)
    print(
        f"model {args.model}: {text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
        f"vocab {text['vocab_size']}; prompt {args.prompt}, new {args.new}; work {work}",
        flush=True,
    )
    rec = cli(
        env,
        "record",
        "--model",
        args.model,
        "--input-ids",
        ",".join(map(str, ids)),
        "--max-new-tokens",
        args.new,
        "-o",
        ref,
    )
    print(f"record: {rec['wall']:.1f} s", flush=True)
    conv = cli(env, "export-gguf", "--model", args.model, "--type", "F32", "-o", f32)
    print(conv["out"], flush=True)
    quant = cli(env, "export-gguf", "--model", args.model, "--type", "Q4_K_M", "-o", q4)
    print(quant["out"], flush=True)
    rep = cli(env, "replay", ref, "--model", args.model, "--runtime", "llama.cpp:Q4_K_M", "-o", run)
    print(rep["out"], flush=True)
    p = subprocess.run(
        [PY, __file__, args.model, "--child-speed", str(q4), json.dumps(ids), str(args.new)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    if p.returncode != 0:
        sys.exit(f"the speed child failed (exit {p.returncode}):\n{p.stderr}")
    speed = json.loads(p.stdout.strip().splitlines()[-1])
    mib = 2**20
    rows = [
        (
            "F32 GGUF: convert (writer)",
            f"{seconds_in(conv['out']):.1f} s",
            f"wall {conv['wall']:.1f} s with model load, peak RSS {conv['rss']:.0f} MiB",
        ),
        ("F32 GGUF: size", f"{f32.stat().st_size / mib:.1f} MiB", ""),
        (
            "Q4_K_M: quantize (llama.cpp)",
            f"{seconds_in(quant['out']):.1f} s",
            f"wall {quant['wall']:.1f} s with model load",
        ),
        ("Q4_K_M: size", f"{q4.stat().st_size / mib:.1f} MiB", ""),
        (
            "replay llama.cpp:Q4_K_M",
            f"{rep['wall']:.1f} s",
            f"{args.prompt} + {args.new} tokens, teacher-forced, wall with start-up",
        ),
        ("replay peak RSS", f"{rep['rss']:.0f} MiB", f"trace process; llama.cpp child {rep['child_rss']:.0f} MiB"),
        ("llama.cpp prompt, no callback", f"{speed['plain']['prompt_tps']:.1f} tok/s", f"{speed['threads']} threads"),
        ("llama.cpp prompt, capture callback", f"{speed['capture']['prompt_tps']:.1f} tok/s", ""),
        ("llama.cpp decode, no callback", f"{speed['plain']['decode_tps']:.1f} tok/s", f"{args.new} tokens"),
        ("llama.cpp decode, capture callback", f"{speed['capture']['decode_tps']:.1f} tok/s", ""),
    ]
    w = max(len(r[0]) for r in rows)
    v = max(len(r[1]) for r in rows)
    print()
    print(f"{'step'.ljust(w)}  {'figure'.rjust(v)}  notes")
    for name, value, note in rows:
        print(f"{name.ljust(w)}  {value.rjust(v)}  {note}".rstrip())


if __name__ == "__main__":
    main()
