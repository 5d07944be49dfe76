"""Dumps written from the static runtime in the layouts NPU toolchains use, for `trace import`.

`make_dumper` is a runtime plug-in: the static runtime, whose probe reports are passed on
unchanged to the driver's probe and also saved as files under $GEMMA4_TRACE_DUMP_DIR, each
kind in another layout (MAP below says which). `trace replay REF --runtime
tests.support.dump_fixture:make_dumper` therefore writes the direct replay and the dump of the same
run; `trace import DUMP --reference REF --map DUMP/map.toml` must give the same tensors.

    GEMMA4_TRACE_DUMP_DIR=/tmp/dump trace replay REF.h5 --runtime tests.support.dump_fixture:make_dumper -o RUN.h5

$GEMMA4_TRACE_DUMP_BUG="LAYER:STEP" perturbs the v rows that layer writes at that step
(+5e-3 at channel 0 rising to +1.5e-2 at the last) in the dump only: a planted bug that trace
diff must localise exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.replayer.runtime import StaticGemma4Runtime

# The layouts: (kind, file pattern, map lines). Every entry is one dump-format feature.
MAP = """\
runtime = "static-dump"

[[tensor]]  # batch axis first (NHWC-like: batch, rows, channels)
kind = "embeddings"
file = "step{step:03d}/embeddings.npy"
axes = ["_", "pos", "d"]

[[tensor]]  # an .npz archive, layer axis before the rows
kind = "per_layer_inputs"
file = "step{step:03d}/ple.npz"
key = "ple"
axes = ["layer", "pos", "d"]

[[tensor]]  # raw float32, shape from the map: "n" is the number of rows fed at the step
kind = "rope_cos_sliding"
file = "step{step:03d}/rope_cos_sliding.bin"
dtype = "float32"
shape = ["n", 16]

[[tensor]]
kind = "rope_sin_sliding"
file = "step{step:03d}/rope_sin_sliding.bin"
dtype = "float32"
shape = ["n", 16]

[[tensor]]  # raw big-endian float32
kind = "rope_cos_full"
file = "step{step:03d}/rope_cos_full.be.bin"
dtype = "float32"
byteorder = "big"
shape = ["n", 32]

[[tensor]]
kind = "rope_sin_full"
file = "step{step:03d}/rope_sin_full.npy"

[[tensor]]  # additive float mask (0 / -inf), rows padded to max_seq
kind = "mask"
file = "step{step:03d}/layer{layer:02d}_mask.npy"
values = "additive"
rows = "padded"

[[tensor]]  # one safetensors file per step holding every layer, NCHW-like (batch, heads, rows, dim)
kind = "q"
file = "step{step:03d}/q.safetensors"
key = "layers.{layer}.q"
axes = ["_", "head", "pos", "d"]

[[tensor]]  # the K cache after the step, transposed (kv_heads, head_dim, slot): rows are positions
kind = "k"
file = "step{step:03d}/layer{layer:02d}_kcache_t.npy"
axes = ["head", "d", "pos"]
rows = "absolute"

[[tensor]]  # V rows padded to max_seq rows
kind = "v"
file = "step{step:03d}/layer{layer:02d}_v.npy"
rows = "padded"

[[tensor]]  # raw float32 with the rows fed at the step
kind = "attn_out"
file = "step{step:03d}/layer{layer:02d}_attn.raw"
dtype = "float32"
shape = ["n", 64]

[[tensor]]  # one file per position
kind = "layer_out"
file = "pos{position:03d}/layer{layer:02d}_out.npy"

[[tensor]]
kind = "final_hidden"
file = "step{step:03d}/head.safetensors"
key = "final_hidden"

[[tensor]]  # logits only: the token is their argmax
kind = "logits"
file = "step{step:03d}/logits.npy"
"""


def _safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A float32 safetensors file, written by hand (the format: a JSON header, then the bytes)."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


class _Tee:
    """Passes every report on to the driver's probe and keeps a float32 copy."""

    def __init__(self, probe):
        self.probe, self.got = probe, {}

    def tensor(self, kind, value, layer=None):
        if self.probe is not None:
            self.probe.tensor(kind, value, layer=layer)
        self.got[(kind, layer)] = value.detach().float().cpu().numpy().copy()


class Dumper(StaticGemma4Runtime):
    name = "static-dumper"

    def __init__(self, loaded, max_seq: int):
        super().__init__(loaded, max_seq)
        self.dir = Path(os.environ["GEMMA4_TRACE_DUMP_DIR"])
        bug = os.environ.get("GEMMA4_TRACE_DUMP_BUG")
        self.bug = tuple(int(x) for x in bug.split(":")) if bug else None
        self.step, self.start = 0, 0
        self.kcache: dict[int, np.ndarray] = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "map.toml").write_text(MAP)

    def prefill(self, input_ids, extra_inputs, probe):
        tee = _Tee(probe)
        logits = super().prefill(input_ids, extra_inputs, tee)
        self._dump(tee.got, logits, 0, len(input_ids))
        return logits

    def decode(self, token_id, position, probe):
        tee = _Tee(probe)
        logits = super().decode(token_id, position, tee)
        self.step += 1
        self._dump(tee.got, logits, position, 1)
        return logits

    def _dump(self, got: dict, logits, start: int, n: int) -> None:
        d = self.dir / f"step{self.step:03d}"
        d.mkdir(exist_ok=True)
        S = self.max_seq

        def padded(a, fill=0.0):
            out = np.full((S, *a.shape[1:]), fill, dtype=np.float32)
            out[: len(a)] = a
            return out

        np.save(d / "embeddings.npy", got[("embeddings", None)][None])
        np.savez(d / "ple.npz", ple=got[("per_layer_inputs", None)].transpose(1, 0, 2))
        got[("rope_cos_sliding", None)].astype("<f4").tofile(d / "rope_cos_sliding.bin")
        got[("rope_sin_sliding", None)].astype("<f4").tofile(d / "rope_sin_sliding.bin")
        got[("rope_cos_full", None)].astype(">f4").tofile(d / "rope_cos_full.be.bin")
        np.save(d / "rope_sin_full.npy", got[("rope_sin_full", None)])
        q = {}
        for (kind, layer), a in got.items():
            if layer is None:
                continue
            if kind == "mask":
                np.save(d / f"layer{layer:02d}_mask.npy", padded(np.where(a > 0, 0.0, -np.inf), -np.inf))
            elif kind == "q":
                q[f"layers.{layer}.q"] = a.transpose(1, 0, 2)[None]
            elif kind == "k":
                cache = self.kcache.setdefault(layer, np.zeros((a.shape[1], a.shape[2], S), np.float32))
                cache[:, :, start : start + n] = a.transpose(1, 2, 0)
                np.save(d / f"layer{layer:02d}_kcache_t.npy", cache)
            elif kind == "v":
                if self.bug == (layer, self.step):  # 5e-3 at channel 0 to 1.5e-2 at the last: one worst channel
                    a = a + np.linspace(5e-3, 1.5e-2, a.shape[-1], dtype=np.float32)
                np.save(d / f"layer{layer:02d}_v.npy", padded(a))
            elif kind == "attn_out":
                a.astype("<f4").tofile(d / f"layer{layer:02d}_attn.raw")
            elif kind == "layer_out":
                for r in range(n):
                    p = self.dir / f"pos{start + r:03d}"
                    p.mkdir(exist_ok=True)
                    np.save(p / f"layer{layer:02d}_out.npy", a[r])
        _safetensors(d / "q.safetensors", q)
        _safetensors(d / "head.safetensors", {"final_hidden": got[("final_hidden", None)]})
        np.save(d / "logits.npy", torch.as_tensor(logits).float().numpy())


def make_dumper(loaded, max_seq: int):
    return Dumper(loaded, max_seq)
