"""record / replay / diff on a full-size E2B-dimension random checkpoint, next to plain generate().

    python benchmarks/make_e2b_random.py /tmp/e2b/bf16/e2b-random
    python benchmarks/make_e2b_random.py /tmp/e2b/f32/e2b-random --dtype float32
    python benchmarks/bench_e2b.py --bf16 /tmp/e2b/bf16/e2b-random --f32 /tmp/e2b/f32/e2b-random
    python benchmarks/bench_e2b.py --bf16 hf/tiny_model --prompt-len 16 --new-tokens 4 --work /tmp/e2b/tiny  # quick

Each measured command runs in its own process (one at a time), which reports the seconds of
its timed part and its own peak RSS (VmHWM). Traces go to --work (kept). Before any timing the
checkpoint's files are read once (into the page cache), so that the first command does not
pay the disk reads the others skip; and the machine's matmul speed (GFLOP/s of one E2B-sized
linear, the MLP's up projection over the prompt, in bf16 and float32) is measured and printed
beside every ratio, so that figures from two machines can be compared. `--rounds N` runs
generate, forward, record and record-last N times, alternating, and prints each ratio's median
(the machine's speed drifts between processes by as much as the changes measured). Steps:

  generate   plain HF generate() (bf16), the same greedy settings as the recorder
  forward    HF computing every prompt row, without the recorder's hooks: the same generate() with
             logits_to_keep an index tensor, as `trace record` calls it, so that the KV-sharing
             layers run over the whole prompt (generate() alone runs them on its last row only:
             on E2B 20 of 35 layers); `record / forward` is what the hooks and the trace cost
  record     trace record (bf16)                      -> BASE.h5   (HF bf16)
  record-last  trace record --shared-kv-prefill last  -> LAST.h5   (generate()'s prefill shortcut)
  replay     trace replay BASE (static runtime, bf16) -> RUN.h5   (the whole command: model load included,
             so replay / record sets it against the record's model load + recording)
  diff       trace diff BASE RUN
  ref        trace record (float32, same weights)     -> REF.h5    (skipped without --f32)
  three-way  trace diff REF RUN --baseline BASE, and rel-L2 of prefill layer_out vs REF

Ratios printed (timed parts, each against the same round's): record / generate, record / forward
(goal <= 1.10x), record-last / generate (goal <= 1.05x). Any Gemma 4 checkpoint folder runs
(hf/tiny_model, or make_e2b_random.py --tiny): the figures are E2B's only on E2B's dimensions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root

ROOT = repo_root.ROOT
PY = sys.executable


def peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompt_ids(n: int, vocab: int = 262_144, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [2] + [rng.randrange(3, vocab) for _ in range(n - 1)]


# ------------------------------------------------------------------ children (one command each)
def child_generate(model_dir: str, dtype: str, n_prompt: int, n_new: int, every_row: bool = False) -> dict:
    """Plain generate(); `every_row`: with logits_to_keep an index tensor, as trace record calls it
    (recorder/record.py), so that HF computes every prompt row of the KV-sharing layers too."""
    import torch

    from gemma4_trace.hf.model import load_model
    from gemma4_trace.recorder.record import eos_ids

    t0 = time.perf_counter()
    lm = load_model(model_dir, dtype=dtype)
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt_ids(n_prompt, lm.text_config.vocab_size)])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = lm.model.generate(
            ids,
            max_new_tokens=n_new,  # no min_new_tokens: it bans EOS, which ends a recording (same tokens, same steps)
            do_sample=False,
            num_beams=1,
            eos_token_id=eos_ids(lm),
            pad_token_id=0,
            top_k=None,
            top_p=None,
            temperature=None,
            **({"logits_to_keep": torch.tensor([-1])} if every_row else {}),
        )
    return dict(load_s=load_s, seconds=time.perf_counter() - t0, tokens=out[0, n_prompt:].tolist())


def child_matmul(n_prompt: int) -> dict:
    """GFLOP/s of one E2B-sized linear: (n_prompt, 1536) x (1536 -> 6144), the best of 5 runs."""
    import torch

    out = {}
    for dtype in ("bfloat16", "float32"):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n_prompt, 1536, generator=g).to(getattr(torch, dtype))
        w = torch.randn(6144, 1536, generator=g).to(getattr(torch, dtype))
        best = float("inf")
        with torch.no_grad():
            for _ in range(5):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                best = min(best, time.perf_counter() - t0)
        out[dtype] = 2 * n_prompt * 1536 * 6144 / best / 1e9
    return dict(seconds=0.0, gflops=out)


def warm_checkpoint(model_dir: str) -> str:
    """Read every file of the checkpoint once, so that it is in the page cache before any timing."""
    t0, total = time.perf_counter(), 0
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                while block := f.read(64 << 20):
                    total += len(block)
    return f"read the checkpoint once before timing ({total / 2**30:.1f} GiB in {time.perf_counter() - t0:.1f} s)"


def child_record(
    model_dir: str, dtype: str, n_prompt: int, n_new: int, out: str, shared_kv_prefill: str = "all"
) -> dict:
    from gemma4_trace.hf.model import load_model
    from gemma4_trace.recorder.record import PromptInputs, record_loaded

    t0 = time.perf_counter()
    lm = load_model(model_dir, dtype=dtype)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = record_loaded(
        lm,
        PromptInputs(prompt_ids(n_prompt, lm.text_config.vocab_size)),
        out,
        max_new_tokens=n_new,
        force=True,
        shared_kv_prefill=shared_kv_prefill,
    )
    return dict(load_s=load_s, seconds=time.perf_counter() - t0, tokens=tokens)


def child_cli(args: list[str]) -> dict:
    from gemma4_trace.cli import main

    t0 = time.perf_counter()
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return dict(seconds=time.perf_counter() - t0, exit=code)


def run_child(name: str, *args) -> dict:
    """Run one child in a fresh process; return its JSON (seconds, peak_mib, wall_s)."""
    t0 = time.perf_counter()
    p = subprocess.run(
        [PY, __file__, "--child", name, json.dumps(list(args))], capture_output=True, text=True, cwd=ROOT
    )
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{name} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    res = json.loads(lines[-1][7:])
    res["wall_s"] = wall
    res["out"] = "\n".join(ln for ln in p.stdout.splitlines() if not ln.startswith("RESULT "))[-3000:]
    return res


def rel_l2_layer_out(ref: str, other: str, layers: list[int], rows: slice) -> list[float]:
    import numpy as np

    from gemma4_trace.traces.reader import TraceReader

    out = []
    with TraceReader(ref) as a, TraceReader(other) as b:
        for layer in layers:
            x, y = (
                a.read("layer_out", layer, rows).astype(np.float64),
                b.read("layer_out", layer, rows).astype(np.float64),
            )
            out.append(float(np.linalg.norm(x - y) / np.linalg.norm(x)))
    return out


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


# (ratio's name, its numerator's row, its denominator's row, the goal printed beside it)
RATIOS = (
    ("record / generate", "record", "generate", ""),
    ("record / forward", "record", "forward", "goal <= 1.10x"),
    ("record-last / generate", "record-last", "generate", "goal <= 1.05x"),
)


def one_round(a, rows: dict, ratios: dict, show, speed: str, base: str, first: bool) -> None:
    """generate(), forward, record and record-last once each, in that order; the round's ratios
    (RATIOS, each of two rows measured in this round) appended to `ratios`."""
    T, n, skip, work = a.prompt_len, a.new_tokens, set(a.skip.split(",")), Path(a.work)
    now: dict = {}  # this round's rows
    if "generate" not in skip:
        now["generate"] = run_child("generate", a.bf16, "bfloat16", T, n)
        show("generate", now["generate"])
    if "forward" not in skip:
        now["forward"] = r = run_child("generate", a.bf16, "bfloat16", T, n, True)
        show("forward", r, "generate() over every prompt row, no hooks")
    if "record" not in skip:
        now["record"] = r = run_child("record", a.bf16, "bfloat16", T, n, base)
        show("record", r, f"trace {os.path.getsize(base) / 2**20:.1f} MiB")
    if "record-last" not in skip:
        last = str(work / "LAST.h5")
        now["record-last"] = r = run_child("record", a.bf16, "bfloat16", T, n, last, "last")
        show("record-last", r, f"trace {os.path.getsize(last) / 2**20:.1f} MiB")
        if first and Path(base).exists():
            d = run_child("cli", "diff", base, last)
            print(
                f"  trace diff BASE LAST: exit {d['exit']}: "
                f"{d['out'].strip().splitlines()[0] if d['out'].strip() else ''}",
                flush=True,
            )
    for name, top, bottom, goal in RATIOS:
        if top in now and bottom in now:
            ratios[name].append(now[top]["seconds"] / now[bottom]["seconds"])
            same = now[top]["tokens"] == now[bottom]["tokens"]
            print(
                f"{name} = {ratios[name][-1]:.2f}x{f' ({goal})' if goal else ''} "
                f"(timed parts: {now[top]['seconds']:.2f} / {now[bottom]['seconds']:.2f} s; {speed}); "
                f"tokens equal: {same}",
                flush=True,
            )


def layers_to_compare(n_layers: int) -> list[int]:
    """Five layers spread over the model for the rel-L2 table: E2B's 35 give 0, 5, 10, 20, 34."""
    return sorted({0, n_layers // 7, 2 * n_layers // 7, 4 * n_layers // 7, n_layers - 1})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", help="the checkpoint folder, loaded in bfloat16 (required but for --child)")
    ap.add_argument("--f32", default=None, help="the float32 checkpoint of the same weights (REF)")
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--ref-prompt-len", type=int, default=None, help="a shorter prompt for the float32 REF (default: the same)"
    )
    ap.add_argument("--work", default="/tmp/e2b/run")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="generate, forward, record and record-last this many times, alternating (the machine's speed drifts)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated steps to skip (generate,forward,record,record-last,replay,diff,ref)",
    )
    ap.add_argument(
        "--writer-before",
        action="store_true",
        help="write traces as before the writer thread and 16-bit bf16 storage (for a before/after)",
    )
    ap.add_argument("--child", default=None)
    ap.add_argument("child_args", nargs="?")
    a = ap.parse_args()
    if a.child:
        import torch

        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        import contextlib

        from benchmarks.writer_variants import before

        fn = {"generate": child_generate, "record": child_record, "cli": child_cli, "matmul": child_matmul}[a.child]
        args = json.loads(a.child_args)
        old = os.environ.get("BENCH_WRITER_BEFORE")  # the trace writer as it was before issue 20's changes
        with before(False, False, False, False) if old else contextlib.nullcontext():
            res = fn(args) if a.child == "cli" else fn(*args)
        res["peak_mib"] = peak_mib()
        print("RESULT " + json.dumps(res), flush=True)
        return

    if not a.bf16:
        ap.error("--bf16 DIR is required")
    if a.writer_before:
        os.environ["BENCH_WRITER_BEFORE"] = "1"
        print("trace writer as before: writes on the model's thread, bf16 upcast and stored as float32", flush=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    base, run, ref = str(work / "BASE.h5"), str(work / "RUN.h5"), str(work / "REF.h5")
    T, n = a.prompt_len, a.new_tokens
    skip = set(a.skip.split(","))
    rows: dict = {}

    def show(name, r, extra=""):
        rows[name] = r
        print(
            f"{name:11s} {r['seconds']:8.2f} s timed  {r['wall_s']:8.1f} s process  peak RSS "
            f"{r['peak_mib'] / 1024:6.2f} GiB  {extra}",
            flush=True,
        )

    print(
        f"checkpoint {a.bf16}; prompt {T} tokens, {n} new tokens; 2 threads; "
        f"available memory {available_gib():.1f} GiB; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    print(warm_checkpoint(a.bf16), flush=True)
    mm = run_child("matmul", T)["gflops"]
    speed = f"matmul {mm['bfloat16']:.0f} GFLOP/s bf16, {mm['float32']:.0f} GFLOP/s float32"
    print(f"{speed} (one ({T}, 1536) x (1536 -> 6144) linear, best of 5)", flush=True)
    ratios: dict = {name: [] for name, *_ in RATIOS}
    for k in range(a.rounds):
        if a.rounds > 1:
            print(f"round {k + 1} of {a.rounds}", flush=True)
        one_round(a, rows, ratios, show, speed, base, k == 0)
    if a.rounds > 1:
        for name, *_, goal in RATIOS:
            if rs := ratios[name]:
                print(
                    f"{name} over {len(rs)} rounds: median {statistics.median(rs):.2f}x"
                    f"{f' ({goal})' if goal else ''} (each round: {', '.join(f'{r:.2f}' for r in rs)})",
                    flush=True,
                )
    if "replay" not in skip:
        r = run_child("cli", "replay", base, "--model", a.bf16, "-o", run, "--force")
        show(
            "replay",
            r,
            f"trace {os.path.getsize(run) / 2**20:.1f} MiB; "
            f"{r['out'].strip().splitlines()[-1] if r['out'].strip() else ''}",
        )
        if "record" in rows:
            # like with like: the replay command's time includes loading the model and reading REF,
            # so it is set against the record's model load + recording (both in their processes)
            rec = rows["record"]["load_s"] + rows["record"]["seconds"]
            print(
                f"replay / record = {r['seconds'] / rec:.2f}x (the replay command, model load included, over "
                f"the record's model load + recording: {r['seconds']:.1f} / {rec:.1f} s; {speed})",
                flush=True,
            )
    if "diff" not in skip:
        r = run_child("cli", "diff", base, run)
        show("diff", r, f"exit {r['exit']}: {r['out'].strip().splitlines()[0] if r['out'].strip() else ''}")
    if a.f32 and "ref" not in skip:
        TR = a.ref_prompt_len or T
        print(f"float32 REF: available memory {available_gib():.1f} GiB", flush=True)
        if TR != T:
            raise SystemExit("a shorter REF prompt needs its own BASE and RUN: rerun with --prompt-len equal to it")
        r = run_child("record", a.f32, "float32", TR, n, ref)
        show("ref-f32", r, f"trace {os.path.getsize(ref) / 2**20:.1f} MiB")
    if a.f32 and Path(ref).exists() and Path(run).exists():
        r = run_child("cli", "diff", ref, run, "--baseline", base)
        print(
            f"\n$ trace diff REF RUN --baseline BASE   (exit {r['exit']}, {r['seconds']:.1f} s)\n{r['out'].strip()}\n",
            flush=True,
        )
        from gemma4_trace.traces.reader import TraceReader

        with TraceReader(ref) as r:
            layers = layers_to_compare(len(r.layers))
        pre = slice(0, T)
        b, c = rel_l2_layer_out(ref, base, layers, pre), rel_l2_layer_out(ref, run, layers, pre)
        print("prefill layer_out rel-L2 vs REF (float32), layers " + " / ".join(map(str, layers)))
        print("  BASE (HF bf16):     " + " / ".join(f"{x:.3f}" for x in b))
        print("  RUN (static bf16):  " + " / ".join(f"{x:.3f}" for x in c))
        for name, other in (("BASE", base), ("RUN", run)):
            r = run_child("cli", "diff", ref, other, "--json")
            try:
                j = json.loads(r["out"][r["out"].index("{") :])
                print(
                    f"  tokens {name} vs REF: accuracy {j['tokens']['accuracy']:.3f}, first mismatch step "
                    f"{j['tokens']['first_mismatch_step']}"
                )
            except (ValueError, KeyError):
                pass


if __name__ == "__main__":
    main()
