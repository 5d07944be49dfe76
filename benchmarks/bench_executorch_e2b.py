"""ExecuTorch at full E2B dimensions: what lowering and replaying costs as the layers grow, and how
many layers fit in this machine's memory.

    python benchmarks/bench_executorch_e2b.py /tmp/et-e2b --layers 2,4,6 --modes executorch,executorch-int8

For each layer count L, a random checkpoint with every E2B dimension but L layers (vocabulary
262,144, hidden 1536, per-layer embeddings of 256 per layer, MLP 6144, double-wide on the layers
that reuse K/V; layer_config) in float32, a REF recorded from it, then for each mode `trace replay
REF --runtime MODE` in a fresh process with an empty artifact cache (so it really exports,
calibrates and lowers; --cache DIR uses that cache as it is instead): wall time, peak RSS of the
trace process (where the programs are exported and lowered) and of its ExecuTorch child (where they
run). A least-squares line through the peaks in L gives the projection to E2B's 35 layers and the
largest L under --budget GiB.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

from benchmarks.bench_llamacpp_e2b import cli  # a trace command in a fresh process
from benchmarks.e2b_shaped import CACHE_OPTION, artifact_env
from benchmarks.make_e2b_random import E2B_TEXT, TINY

S, F = "sliding_attention", "full_attention"


def layer_config(n: int, tiny: bool = False) -> dict:
    """E2B's text config with n layers: the last round(4n/7) reuse K/V (E2B: the last 20 of 35),
    each part E2B's pattern of 4 sliding + 1 full cut to its length and ending full (transformers
    wants a layer of each type among the layers that own K/V when some reuse it); `tiny`: at the
    widths of make_e2b_random.py's TINY."""
    shared = min(round(n * 20 / 35), n - 2) if n > 1 else 0

    def part(k: int) -> list[str]:
        return ([S, S, S, S, F] * 8)[: k - 1] + [F] if k else []

    return {
        **E2B_TEXT,
        **(TINY if tiny else {}),
        "num_hidden_layers": n,
        "layer_types": part(n - shared) + part(shared),
        "num_kv_shared_layers": shared,
    }


def build(out: Path, n: int, tiny: bool = False) -> Path:
    """The float32 checkpoint of n layers (in a child process: its memory is not the benchmark's)."""
    if not (out / "config.json").exists():
        code = (
            "import sys, json, torch\n"
            "from transformers import Gemma4ForCausalLM, Gemma4TextConfig\n"
            "cfg = json.loads(sys.argv[2])\n"
            "torch.manual_seed(0)\n"
            "m = Gemma4ForCausalLM(Gemma4TextConfig(**cfg, initializer_range=0.02))\n"
            "m.generation_config.eos_token_id = [1]\n"
            "m.save_pretrained(sys.argv[1], safe_serialization=True)\n"
        )
        import json

        subprocess.run([sys.executable, "-c", code, str(out), json.dumps(layer_config(n, tiny))], check=True)
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line peak = a + b * L."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--layers", default="2,4,6")
    ap.add_argument("--modes", default="executorch,executorch-int8")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--budget", type=float, default=24.0, help="memory to fit in, GiB")
    ap.add_argument("--tiny", action="store_true", help="E2B's structure at tiny widths (a quick check, not E2B)")
    ap.add_argument("--cache", **CACHE_OPTION)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    vocab = layer_config(1, a.tiny)["vocab_size"]
    ids = ",".join(str(10 + 997 * i % (vocab - 10)) for i in range(a.prompt))  # E2B: the ids it always used
    rows, peaks = [], {}
    for n in (int(x) for x in a.layers.split(",")):
        tag = f"{n}-tiny" if a.tiny else str(n)
        model = build(a.work / f"model-{tag}", n, a.tiny)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30
        ref = a.work / f"ref-{tag}.h5"
        if not ref.exists():
            cli(None, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref)
        for mode in a.modes.split(","):
            env = artifact_env(a.cache, a.work / f"cache-{tag}-{mode}")
            run = a.work / f"run-{tag}-{mode}.h5"
            r = cli(env, "replay", ref, "--model", model, "--runtime", mode, "-o", run, "--force")
            rows.append((n, weights, mode, r["wall"], r["rss"] / 1024, r["child_rss"] / 1024))
            peaks.setdefault(mode, []).append((n, max(r["rss"], r["child_rss"]) / 1024))
            print(
                f"L={n:2d} {weights:5.1f} GiB  {mode:16s} {r['wall']:7.0f} s  parent {r['rss'] / 1024:5.1f} GiB"
                f"  child {r['child_rss'] / 1024:5.1f} GiB",
                flush=True,
            )
    print("\n| layers | checkpoint (float32) | runtime | export + lower + replay | peak RSS, trace process ", end="")
    print("| peak RSS, ExecuTorch child |")
    print("|---|---|---|---|---|---|")
    for n, w, mode, wall, p, c in rows:
        print(f"| {n} | {w:.1f} GiB | {mode} | {wall:.0f} s | {p:.1f} GiB | {c:.1f} GiB |")
    for mode, pts in peaks.items():
        if len(pts) > 1:
            a0, b = fit(pts)
            fits = int((a.budget - a0) // b) if b > 0 else None
            print(
                f"{mode}: peak ~ {a0:.1f} + {b:.2f} GiB x L; at 35 layers {a0 + 35 * b:.1f} GiB; "
                f"largest L under {a.budget:g} GiB: {fits}"
            )


if __name__ == "__main__":
    main()
