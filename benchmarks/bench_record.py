"""Wall time of `trace record` vs plain generate() with identical settings, side by side.

    python benchmarks/bench_record.py [--steps 32] [--prompt-len 64] [--repeats 3]

All runs use the same loaded model, prompt and greedy settings; each timing is the
median of --repeats runs, alternating them: generate(), the forward (generate() computing every
prompt row, logits_to_keep an index tensor as trace record asks it: the KV-sharing layers' prompt
rows, which generate() alone skips; no hooks) and trace record, so that `record / forward` is what
the hooks and the trace cost. Also prints trace size per prompt token and per decode step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

import torch

from benchmarks import e2b_shaped
from gemma4_trace.hf.model import DEMO_PROMPT, load_model
from gemma4_trace.recorder.record import PromptInputs, eos_ids, prepare_inputs, record_loaded


def plain_generate(lm, ids, steps, every_row: bool = False):
    """HF's greedy generate(), no hooks; `every_row`: every prompt row of every layer computed, as
    trace record asks for it (logits_to_keep an index tensor: recorder/record.py)."""
    with torch.no_grad():
        return lm.model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=eos_ids(lm),
            pad_token_id=lm.text_config.pad_token_id,
            top_k=None,
            top_p=None,
            temperature=None,
            **({"logits_to_keep": torch.tensor([-1])} if every_row else {}),
        )


def bench(label, lm, ids, steps, repeats, tmp: Path):
    t_gen, t_fwd, t_rec = [], [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = plain_generate(lm, ids, steps)
        t_gen.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain_generate(lm, ids, steps, every_row=True)
        t_fwd.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        record_loaded(lm, PromptInputs(ids), tmp / f"{label}-{i}.h5", max_new_tokens=steps)
        t_rec.append(time.perf_counter() - t0)
    n_new = out.shape[1] - len(ids)
    # size: a prefill-only trace gives bytes per prompt token; the rest is per decode step
    record_loaded(lm, PromptInputs(ids), tmp / f"{label}-prefill.h5", max_new_tokens=1)
    full = (tmp / f"{label}-0.h5").stat().st_size
    pre = (tmp / f"{label}-prefill.h5").stat().st_size
    g, f, r = statistics.median(t_gen), statistics.median(t_fwd), statistics.median(t_rec)
    print(f"{label}: prompt {len(ids)} tokens, {n_new} new tokens")
    print(
        f"  generate() {g:.3f} s   forward (every prompt row) {f:.3f} s   trace record {r:.3f} s   "
        f"ratio {r / g:.2f}x   record / forward {r / f:.2f}x"
    )
    print(
        f"  trace size {full / 2**20:.2f} MiB: {pre / len(ids) / 1024:.1f} KiB per prompt token, "
        f"{(full - pre) / max(1, n_new - 1) / 1024:.1f} KiB per decode step"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-e2b", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tiny = load_model(None)
        ids = prepare_inputs(tiny, DEMO_PROMPT, None, [], chat=True).input_ids
        bench("tiny (embedded)", tiny, ids, args.steps, args.repeats, tmp)
        if not args.skip_e2b:
            e2b = load_model(e2b_shaped.build(tmp / "e2b"))
            ids = e2b_shaped.random_prompt(args.prompt_len, e2b.text_config.vocab_size)
            bench("E2B-shaped (10 layers, vocab 16384, float32)", e2b, ids, args.steps, args.repeats, tmp)


if __name__ == "__main__":
    main()
