"""Minimal repro: litert-torch 0.10.0's Gemma 4 export leaves out the final logit soft-cap.

Exports a Gemma 4 checkpoint with `litert_torch.generative.export_hf` (float, externalized
embedder), feeds one token through the exported `decode` signature from empty caches and compares
its logits with transformers' logits for the same token.

    python litert_torch_softcap_repro.py [MODEL_DIR] [--exported DIR]

MODEL_DIR: a Gemma 4 save_pretrained folder with its tokenizer (default: this repository's tiny
model, hf/tiny_model). --exported DIR: the export's model.tflite / embedder.tflite /
per_layer_embedder.tflite already written there (skips the export, about a minute). Needs torch,
transformers 5.24, litert-torch 0.10.0 and ai-edge-litert 2.3.0; nothing else. Prints the largest
difference from transformers' logits as they are and after applying the cap, and exits 1 while the
bug is there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from ai_edge_litert.interpreter import Interpreter
from transformers import AutoModelForImageTextToText

TOKEN = 42  # any token id of the vocabulary


def export(model_dir: Path, out: Path) -> None:
    cmd = [sys.executable, "-m", "litert_torch.generative.export_hf", str(model_dir), str(out)]
    cmd += ["--prefill_lengths=8", "--cache_length=16", "--quantization_recipe=none"]
    cmd += ["--externalize_embedder=True", "--keep_temporary_files=True"]
    subprocess.run(cmd, check=True, cwd=out, capture_output=True)


def signature(path: Path, name: str):
    return Interpreter(model_path=str(path)).get_signature_runner(name)


def litert_logits(files: Path, token: int) -> np.ndarray:
    ids = {"token_ids": np.array([[token]], np.int32)}
    emb = next(iter(signature(files / "embedder.tflite", "decode_embedder")(**ids).values()))
    ple = next(iter(signature(files / "per_layer_embedder.tflite", "decode_per_layer_embedder")(**ids).values()))
    decode = signature(files / "model.tflite", "decode")
    feed = {}
    for name, d in decode.get_input_details().items():
        if name.startswith("kv_cache_"):
            feed[name] = np.zeros(d["shape"], np.float32)  # empty caches
    keys = decode.get_input_details()["mask"]["shape"][-1]
    mask = np.full((1, 1, 1, keys), -1e30, np.float32)
    mask[..., 0] = 0.0  # position 0 sees itself only
    feed.update(embeddings=emb, per_layer_embeddings=ple, input_pos=np.array([0], np.int32), mask=mask)
    return decode(**feed)["logits"].reshape(-1)


def main() -> int:
    here = Path(__file__).resolve()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, default=here.parents[2] / "hf" / "tiny_model")
    ap.add_argument("--exported", type=Path)
    args = ap.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    cap = config.get("text_config", config)["final_logit_softcapping"]
    with torch.no_grad():
        hf = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32).eval()
        want = hf(input_ids=torch.tensor([[TOKEN]])).logits[0, -1].numpy()
    with tempfile.TemporaryDirectory() as tmp:
        files = args.exported
        if files is None:
            files = Path(tmp)
            export(args.model, files)
        got = litert_logits(files, TOKEN)
    raw = float(np.abs(got - want).max())
    capped = float(np.abs(cap * np.tanh(got / cap) - want).max())
    print(f"final_logit_softcapping {cap}: max |litert - transformers| {raw:.3g}")
    print(f"after applying the cap to litert's logits: {capped:.3g}")
    bug = raw > 1e-3 and capped < 1e-4
    print("the exported decode signature leaves out the soft-cap" if bug else "the logits agree: fixed")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
