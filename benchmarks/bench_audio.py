"""The audio tower's record cost: `trace record` of one clip against a plain forward of the tower and
generate() without hooks, at E2B's audio tower size, side by side.

    python benchmarks/bench_audio.py [--seconds 10] [--rounds 3] [--work DIR]
    python benchmarks/bench_audio.py --tiny --seconds 2 --rounds 1      # E2B's structure at tiny widths

A random Gemma4ForConditionalGeneration with E2B's audio tower (transformers' Gemma4AudioConfig
defaults, google/gemma-4-e2b-it's: 12 conformer layers, hidden 1024, 8 heads, subsampling channels
[128, 32], output_proj_dims 1536: about 305 M parameters; `--tiny`: the embedded audio model's 2
layers of 32) over the embedded model's text tower (so the text tower's share of the time is
negligible), saved with the embedded audio model's tokenizer and processor; one clip of `--seconds`
(the embedded speech clip repeated). Each round times, alternating: the tower's own forward
(get_audio_features: the subsampling, every conformer layer, output_proj, embed_audio), generate()
of one token (the tower and a prefill; no hooks), and `trace record` of the same (every audio site,
the text tower's too, written to HDF5). The ratios that count: record / generate and the audio
sites' cost over the tower's forward, (record - generate) / tower (goal: record <= 1.15x a plain
forward of the tower: docs/benchmarks.md). Also the audio sites' bytes on disk per second of audio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

try:  # `python benchmarks/NAME.py`: benchmarks/repo_root.py puts the repository root on sys.path and PYTHONPATH
    import repo_root  # noqa: F401
except ModuleNotFoundError:  # imported as benchmarks.NAME
    from benchmarks import repo_root  # noqa: F401

import numpy as np
import torch

from gemma4_trace.hf.audio import Clip, load_clip
from gemma4_trace.hf.model import DEMO_AUDIO, embedded_audio_model_dir, load_model
from gemma4_trace.recorder.record import eos_ids, prepare_inputs, record_loaded

E2B_AUDIO: dict = {}  # Gemma4AudioConfig's defaults are E2B's audio_config
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build(out: Path, tiny: bool) -> Path:
    """A random checkpoint: E2B's audio tower (or the embedded one's) on the embedded model's text tower."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    src = embedded_audio_model_dir()
    if tiny:
        shutil.copytree(src, out, dirs_exist_ok=True)
        return out
    cfg = json.loads((src / "config.json").read_text())
    cfg["audio_config"] = dict(E2B_AUDIO)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(Gemma4Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    model.save_pretrained(out)
    for name in (*COPIED, "processor_config.json"):
        shutil.copy(src / name, out / name)
    return out


def clip(seconds: float, rate: int) -> np.ndarray:
    """The embedded speech clip, repeated to `seconds`."""
    one = load_clip(str(DEMO_AUDIO), rate).samples
    return np.tile(one, int(np.ceil(seconds * rate / one.size)))[: int(seconds * rate)]


def audio_bytes(path: Path) -> int:
    """Bytes on disk of the trace's audio tower datasets."""
    import h5py

    total = 0

    def add(name, obj):
        nonlocal total
        if isinstance(obj, h5py.Dataset) and "/audio/" in f"/{name}":
            total += obj.id.get_storage_size()

    with h5py.File(path, "r") as f:
        f.visititems(add)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the clip (at most 30)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the embedded audio model's tower (a quick check)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the checkpoint and traces (default: temporary)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-audio-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    lm = load_model(build(work / "model", args.tiny))
    rate = lm.processor.feature_extractor.sampling_rate
    wave = clip(args.seconds, rate)
    inputs = prepare_inputs(lm, "Transcribe the audio.", None, [], chat=True, clips=[Clip(wave, None)])
    feats, mask = inputs.extra["input_features"], inputs.extra["input_features_mask"]
    tower = lm.model.model.audio_tower
    n_params = sum(p.numel() for p in tower.parameters())
    ac = lm.config.audio_config
    print(
        f"audio tower: {ac.num_hidden_layers} layers, hidden {ac.hidden_size}, {n_params / 1e6:.0f} M parameters; "
        f"clip: {args.seconds:g} s, {feats.shape[1]} mel frames; prompt {len(inputs.input_ids)} tokens; "
        f"torch threads {torch.get_num_threads()}"
    )
    ids = torch.tensor([inputs.input_ids])
    times: dict[str, list[float]] = {"tower": [], "generate": [], "record": []}
    size = 0
    for r in range(args.rounds):
        with torch.no_grad():
            t = time.perf_counter()
            lm.model.model.get_audio_features(feats, mask)
            times["tower"].append(time.perf_counter() - t)
            t = time.perf_counter()
            lm.model.generate(
                ids, **inputs.extra, max_new_tokens=1, do_sample=False, eos_token_id=eos_ids(lm),
                pad_token_id=lm.text_config.pad_token_id, top_k=None, top_p=None, temperature=None,
            )  # fmt: skip
            times["generate"].append(time.perf_counter() - t)
        out = work / f"rec{r}.h5"
        t = time.perf_counter()
        record_loaded(lm, inputs, out, max_new_tokens=1, force=True)
        times["record"].append(time.perf_counter() - t)
        size = audio_bytes(out)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'':<28}{'median s':>10}{'x tower':>10}")
    for name, label in (("tower", "tower forward"), ("generate", "generate() 1 token"), ("record", "trace record")):
        print(f"{label:<28}{med[name]:>10.4f}{med[name] / med['tower']:>10.2f}")
    print(f"record / generate: {med['record'] / med['generate']:.2f}x over {args.rounds} round(s)")
    print(f"tower + audio sites / tower: {1 + (med['record'] - med['generate']) / med['tower']:.2f}x")
    print(f"audio sites on disk: {size / 2**20:.2f} MiB, {size / 2**10 / args.seconds:.0f} KiB per second of audio")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
