"""Porting bugs planted on top of the quantized static runtimes (replayer/quant.py).

Each bug is the quantized runtime plus ONE fault, so the tool has to find the fault under
quantization noise. `runtime_spec(bug, scheme)` is its `--runtime` value, e.g.
`tests.support.quant_bugs:make_decode_rope_offset__static_w8`. Bug classes (docs/design.md):

- decode_rope_offset: decode steps take the RoPE row of position + 1 (prefill is right)
- reuse_own_cache_in_decode: in decode, KV-reusing layers read their own never-written cache
  instead of the storing layer's (a KV-reuse source error; prefill is right)
- stale_ple_in_decode: the per-layer inputs of the first decode step are reused by every later one
- low_precision_layer: one layer's weights at half the bits of the others (int8 -> int4, int4 -> int2)
- window_off_by_one: sliding layers see window + 1 keys (the mask is wrong from position W on)
"""

from __future__ import annotations

from gemma4_trace.replayer.quant import LAYER_WEIGHTS, SCHEMES, quantize_, quantize_weight
from gemma4_trace.replayer.runtime import StaticGemma4Runtime
from tests.support.bug_zoo import ReuseOwnCacheInDecode, WindowOffByOne, _Bug

LOW_LAYER = 1  # early: its input carries little accumulated quantization noise
LOW_GROUP = 32


class DecodeRopeOffset(_Bug):
    name = "bug-decode-rope-offset"

    def _step(self, input_pos, masks, valid, probe, report_rows):
        step = super()._step(input_pos if valid is not None else input_pos + 1, masks, valid, probe, report_rows)
        step.input_pos = input_pos  # only the RoPE rows are off; K/V go to the right slot
        return step


class StalePleInDecode(_Bug):
    name = "bug-stale-ple-in-decode"
    cached = None

    def _per_layer_inputs(self, ple_ids, x):
        if not self.decoding:
            self.cached = None
            return super()._per_layer_inputs(ple_ids, x)
        if self.cached is None:  # computed once, at the first decode step, never refreshed
            self.cached = super()._per_layer_inputs(ple_ids, x)
        return self.cached


def _make(cls, scheme):
    def make(loaded, max_seq):
        return quantize_(cls(loaded, max_seq), scheme)

    return make


def _make_low_precision_layer(scheme):
    def make(loaded, max_seq):
        rt = StaticGemma4Runtime(loaded, max_seq)
        L = rt.layers[LOW_LAYER]
        floats = {n: L._buffers[n] for n in LAYER_WEIGHTS if n in L._buffers}
        quantize_(rt, scheme)
        bits = SCHEMES[scheme].weight_bits // 2
        for n, w in floats.items():
            setattr(L, n, quantize_weight(w, bits, LOW_GROUP))
        rt.name = f"bug-low-precision-layer+{scheme.removeprefix('static-')}"
        return rt

    return make


BUG_CLASSES = {
    "decode_rope_offset": DecodeRopeOffset,
    "reuse_own_cache_in_decode": ReuseOwnCacheInDecode,
    "stale_ple_in_decode": StalePleInDecode,
    "window_off_by_one": WindowOffByOne,
}
BUGS = (*BUG_CLASSES, "low_precision_layer")
WEIGHT_SCHEMES = ("static-w8", "static-w4g32")


def _factory_name(bug: str, scheme: str) -> str:
    return f"make_{bug}__{scheme.replace('-', '_')}"


for _scheme in WEIGHT_SCHEMES:
    for _bug, _cls in BUG_CLASSES.items():
        globals()[_factory_name(_bug, _scheme)] = _make(_cls, _scheme)
    globals()[_factory_name("low_precision_layer", _scheme)] = _make_low_precision_layer(_scheme)


def runtime_spec(bug: str, scheme: str) -> str:
    return f"tests.support.quant_bugs:{_factory_name(bug, scheme)}"
