"""Static runtime decode speed vs HF generate(), side by side in one run.

    python benchmarks/bench_replay.py [--new-tokens 32] [--models tiny,e2b] [--compile]

Per model: HF generate() decode tokens/s (greedy, min_new_tokens = max_new_tokens so both
run the same number of steps; decode rate = (N - 1) / (t(N) - t(1)), i.e. prefill
excluded), the static runtime's eager decode tokens/s, optionally torch.compile of the
decode step, the probe's cost when disabled, and the peak RSS of a process doing only
HF generate() vs only the static replay (each in a fresh subprocess).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

REPEATS = 3


def build(which: str):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from benchmarks.e2b_shaped import E2B_TEXT
    from gemma4_trace.hf.model import LoadedModel, load_model

    if which == "tiny":
        return load_model(None)  # the embedded tiny model
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**E2B_TEXT)).eval()
    return LoadedModel(model, None, "e2b-shaped (random)", Path("."), "float32", "cpu")


def hf_decode_rate(lm, ids, n):
    import torch

    def run(k):
        t = time.perf_counter()
        with torch.no_grad():
            lm.model.generate(
                torch.tensor([ids]),
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    run(2)  # warm-up
    t1 = min(run(1) for _ in range(2))
    return (n - 1) / (run(n) - t1)


def static_decode_rate(rt, ids, n, step=None, probe=None):
    import torch

    def run():
        rt.prefill(ids)
        tok, t = 5, time.perf_counter()
        with torch.no_grad():
            for s in range(n - 1):
                pos = len(ids) + s
                if step is None:
                    logits = rt.decode(tok, pos, probe)
                else:
                    logits = step(torch.tensor([[tok]]), torch.tensor([pos]))
                tok = int(logits.argmax())
        return time.perf_counter() - t

    return (n - 1) / run()


class NullProbe:
    def tensor(self, kind, value, layer=None):
        pass


def probe_check_cost(rt) -> float:
    """Seconds that the `if probe is not None` checks of one decode step cost."""
    n_checks = 2 + 5 * rt.n_layers  # _decoder: 2, _layer: up to 5 (k/v, mask/q, attn_out, layer_out) + final
    probe, k = None, 200_000
    t = time.perf_counter()
    for _ in range(k):
        if probe is not None:
            pass
    return (time.perf_counter() - t) / k * n_checks


def child(which: str, what: str, n: int) -> None:
    """Run one side alone and print its peak RSS (MiB)."""
    import torch

    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    lm = build(which)
    ids = list(range(3, 35))
    loaded = _rss_mib()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: measure the run, not the load
    if what == "hf":
        with torch.no_grad():
            lm.model.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
                pad_token_id=0,
            )
    else:
        rt = StaticGemma4Runtime(lm, max_seq=len(ids) + n)
        tok = int(rt.prefill(ids).argmax())
        for s in range(n - 1):
            tok = int(rt.decode(tok, len(ids) + s).argmax())
    print(json.dumps({"peak_rss_mib": _hwm_mib() - loaded}))


def _rss_mib() -> float:
    return _status("VmRSS")


def _hwm_mib() -> float:
    return _status("VmHWM")


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(key)


def peak_rss(which: str, what: str, n: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", which, what, str(n)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--models", default="tiny,e2b")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the decode step")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], int(a.child[2]))

    import torch

    from gemma4_trace.replayer.runtime import StaticGemma4Runtime

    print(
        f"command: python benchmarks/bench_replay.py --new-tokens {a.new_tokens} --models {a.models}"
        f"{' --compile' if a.compile else ''}"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    n = a.new_tokens
    ids = list(range(3, 35))  # 32-token prompt
    for which in a.models.split(","):
        lm = build(which)
        rt = StaticGemma4Runtime(lm, max_seq=len(ids) + n)
        static_decode_rate(rt, ids, n)  # warm-up
        hf = st = null = 0.0
        for _ in range(REPEATS):  # interleaved, best of REPEATS: the machine may be shared
            hf = max(hf, hf_decode_rate(lm, ids, n))
            st = max(st, static_decode_rate(rt, ids, n))
            null = max(null, static_decode_rate(rt, ids, n, probe=NullProbe()))
        check = probe_check_cost(rt) * st * 100
        row = [f"{which}: HF generate {hf:8.1f} tok/s | static eager {st:8.1f} tok/s ({st / hf:.2f}x)"]
        if a.compile:
            t = time.perf_counter()
            step = torch.compile(rt.decode_step, fullgraph=True, dynamic=False)
            with torch.no_grad():
                step(torch.tensor([[5]]), torch.tensor([len(ids)]))
            compile_s = time.perf_counter() - t
            co = static_decode_rate(rt, ids, n, step=step)
            row.append(f"compiled {co:8.1f} tok/s ({co / hf:.2f}x, compile {compile_s:.0f} s)")
        print(" | ".join(row))
        print(
            f"   probe disabled: {check:.3f}% of a decode step (branch checks); "
            f"enabled with a no-op probe: {st / null:.3f}x step time"
        )
        print(
            f"   peak RSS above the loaded model, {n} new tokens: HF generate {peak_rss(which, 'hf', n):.1f} MiB, "
            f"static replay {peak_rss(which, 'static', n):.1f} MiB"
        )


if __name__ == "__main__":
    main()
