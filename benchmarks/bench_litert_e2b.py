"""LiteRT at E2B width: litert-torch's export, a float32 and an int8 replay, and what the diff finds.

    python benchmarks/bench_litert_e2b.py /tmp/litert-e2b --prompt 32 --new 8

Builds (once) an E2B-shaped Gemma4ForConditionalGeneration checkpoint in WORK/model (every E2B
text width, 10 layers [S,S,S,S,F] x 2 with the last 5 reusing K/V, vocabulary 16,384, float32; a
one-layer vision tower, as litert-torch's Gemma 4 path exports ConditionalGeneration checkpoints;
the embedded model's tokenizer, which the export bundles), records REF on a seeded random prompt,
then runs each command in a fresh process with the artifact cache in WORK/cache, empty at the start
(--cache DIR: that cache as it is, so an export found there is a cache hit):

  export        trace export-litert --max-seq (prompt + new)   litert-torch's export (wall, peak RSS
                of the trace process and of its export child)
  quantize      trace export-litert --runtime litert-int8      litert-quantizer on the cached export
  replay        trace replay REF --runtime litert / litert-int8 / litert-int8-dq (teacher-forced):
                wall time with start-up, peak RSS of the trace process and of its LiteRT child
  diff          trace diff REF RUN (and INT8 --baseline INT8_DQ): the first line

The table is printed at the end. On a busy machine every time is a bound, not a speed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

from benchmarks.bench_llamacpp_e2b import cli, diff_first_line, print_table  # a trace command in a fresh process
from benchmarks.e2b_shaped import CACHE_OPTION, E2B_TEXT, artifact_env, bench_setup, token_ids

VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    patch_size=16,
    pooling_kernel_size=2,
    position_embedding_size=64,
)


def build(out: Path) -> Path:
    """The E2B-shaped ConditionalGeneration checkpoint with the embedded model's tokenizer, once."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from gemma4_trace.hf.model import resolve_model_dir

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=dict(E2B_TEXT), vision_config=VISION, audio_config=None)
    model = Gemma4ForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = [1]
    model.save_pretrained(out, safe_serialization=True)
    embedded = resolve_model_dir(None)[0]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded / name).exists():
            shutil.copyfile(embedded / name, out / name)
    return out


MODES = ("litert", "litert-int8", "litert-int8-dq")


def main() -> None:
    a, model = bench_setup(
        __doc__,
        __file__,
        build,
        modes=dict(default=",".join(MODES), help="comma-separated, some of MODES (default: all)"),
        cache=CACHE_OPTION,
    )
    modes = tuple(a.modes.split(","))
    if not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: some of {', '.join(MODES)}")
    env = artifact_env(a.cache, a.work / "cache")
    ids = token_ids(a.prompt, model, high=600)
    ref = a.work / "ref.h5"
    cli(env, "record", "--model", model, "--input-ids", ids, "--max-new-tokens", a.new, "-o", ref, "--force")
    max_seq = a.prompt + a.new
    rows = []
    for mode in dict.fromkeys(m.removesuffix("-dq") for m in modes):  # a -dq baseline replays the int8 export
        out = a.work / mode
        r = cli(env, "export-litert", "--model", model, "--runtime", mode, "--max-seq", max_seq, "-o", out, "--force")
        rows.append((f"export-litert --runtime {mode}", r))
    runs = {}
    for mode in modes:
        runs[mode] = a.work / f"{mode}.h5"
        r = cli(env, "replay", ref, "--model", model, "--runtime", mode, "-o", runs[mode], "--force")
        rows.append((f"replay --runtime {mode}", r))
    # each run against REF (not the -dq baseline), then the int8 run against its -dq baseline
    pairs = [(name, ()) for name in modes if not name.endswith("-dq")]
    pairs += [(name, ("--baseline", runs[name + "-dq"])) for name, _ in pairs if name + "-dq" in runs]
    diffs = [
        (name + (f" --baseline {name}-dq" if more else ""), diff_first_line(env, ref, runs[name], *more))
        for name, more in pairs
    ]
    print_table(rows, diffs)


if __name__ == "__main__":
    main()
