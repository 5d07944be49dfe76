"""generate() against `trace record --shared-kv-prefill last` with the writer's encoder as it is and
as it was (zlib Z_RLE per byte plane), in one process, alternating.

    python benchmarks/bench_record_ab.py MODEL_DIR [--rounds 4] [--prompt-len 600] [--new-tokens 32]

The model is loaded once (bf16, 2 threads) and one untimed generate() warms it; then each round
times generate(), record-last with encode_chunk as it is, and record-last with the encoder of
benchmarks/bench_encode.py's zlib_rle. Separate processes (benchmarks/bench_e2b.py) see the
machine's speed drift between them by as much as this change; alternating in one process does not.
Prints each round and the medians.
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

from benchmarks.bench_e2b import prompt_ids
from benchmarks.bench_encode import zlib_rle
from gemma4_trace.hf.model import load_model
from gemma4_trace.recorder.record import PromptInputs, eos_ids, record_loaded
from gemma4_trace.traces import writer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(a.model_dir, dtype="bfloat16")
    ids = prompt_ids(a.prompt_len, lm.text_config.vocab_size)
    tmp = tempfile.TemporaryDirectory()  # removed at exit
    out = Path(tmp.name) / "last.h5"
    current = writer.encode_chunk

    def generate() -> float:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            lm.model.generate(
                x, max_new_tokens=a.new_tokens, do_sample=False, num_beams=1,  # EOS ends it as it ends a recording
                eos_token_id=eos_ids(lm), pad_token_id=0, top_k=None, top_p=None, temperature=None,
            )  # fmt: skip
        return time.perf_counter() - t0

    def record_last(encoder) -> float:
        writer.encode_chunk = encoder
        try:
            t0 = time.perf_counter()
            record_loaded(lm, PromptInputs(ids), out, max_new_tokens=a.new_tokens, force=True, shared_kv_prefill="last")
            return time.perf_counter() - t0
        finally:
            writer.encode_chunk = current

    runs = {"generate()": generate, "record-last, ISA-L": lambda: record_last(current),
            "record-last, zlib Z_RLE": lambda: record_last(zlib_rle)}  # fmt: skip
    generate()
    times: dict = {name: [] for name in runs}
    for k in range(a.rounds):
        for name, fn in runs.items():
            times[name].append(fn())
        print(f"round {k + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    g = statistics.median(times["generate()"])
    for name, t in times.items():
        ratio = "" if name == "generate()" else f"  {statistics.median(t) / g:.3f}x generate()"
        print(f"{name:26s} median {statistics.median(t):6.2f} s{ratio}")


if __name__ == "__main__":
    main()
