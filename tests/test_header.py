"""The typed trace header: what the writer takes whole and the reader gives back.

A trace copied through `TraceReader.header()` and the writer is the same trace (same content
hash) for the golden recordings of the embedded model, extra inputs (the image trace) included.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.traces import Provenance, TraceHeader, TraceReader
from tests.support.diff_fixtures import copy_trace
from tests.support.synth import LAYERS, provenance


@pytest.mark.parametrize("name", ["short", "image"])
def test_a_copy_through_the_header_is_the_same_trace(tmp_path, name):
    out = tmp_path / "copy.h5"
    copy_trace(golden_path(name), out)
    with TraceReader(golden_path(name)) as a, TraceReader(out) as b:
        ha, hb = a.header(), b.header()
        assert ha.provenance == hb.provenance
        assert hb.extra_inputs.keys() == ha.extra_inputs.keys() and (name != "image" or ha.extra_inputs)
        for k, v in ha.extra_inputs.items():
            assert np.array_equal(v, hb.extra_inputs[k]) and v.dtype == hb.extra_inputs[k].dtype
        assert a.content_hash() == b.content_hash()


def test_header_fields_round_trip(tmp_path):
    out = tmp_path / "copy.h5"
    copy_trace(golden_path("short"), out, mode="teacher-forced")
    with TraceReader(golden_path("short")) as a, TraceReader(out) as b:
        ha, hb = a.header(), b.header()
    assert hb.provenance == ha.provenance.replace(mode="teacher-forced") and b.mode == "teacher-forced"
    for f in dataclasses.fields(TraceHeader):
        if f.name not in ("provenance", "prompt_ids", "extra_inputs"):
            assert getattr(ha, f.name) == getattr(hb, f.name), f.name
    assert np.array_equal(ha.prompt_ids, hb.prompt_ids) and hb.prompt_ids.dtype == np.int64
    assert hb.eos_token_ids == tuple(sorted(set(hb.eos_token_ids))) and hb.layers == tuple(a.layers)


def test_provenance_is_checked_where_it_is_built():
    p = provenance(LAYERS)
    assert Provenance.from_dict(p).to_dict() == p
    with pytest.raises(ValueError, match=r"provenance lacks \['device'\]"):
        Provenance.from_dict({k: v for k, v in p.items() if k != "device"})
    with pytest.raises(ValueError, match="mode 'sampled' not in"):
        Provenance.from_dict({**p, "mode": "sampled"})
    with pytest.raises(TypeError, match="must be a Provenance, got dict"):
        TraceHeader(p, [1, 2], LAYERS, max_new_tokens=1, eos_token_ids=[1])
    h = TraceHeader(Provenance.from_dict(p), [3, 1], LAYERS, max_new_tokens=2, eos_token_ids=[7, 1, 7])
    assert h.eos_token_ids == (1, 7) and h.with_provenance({**p, "mode": "isolated"}).provenance.mode == "isolated"
