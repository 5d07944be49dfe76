import h5py
import numpy as np
import pytest

from gemma4_trace.traces import (
    KIND_NAMES,
    Provenance,
    TraceFileError,
    TraceHeader,
    TraceReader,
    TraceToolError,
    TraceWriter,
    schema,
)
from tests.support.synth import LAYERS, write_trace


def test_golden_kind_names_in_dataflow_order():
    assert KIND_NAMES == (
        "embeddings",
        "per_layer_inputs",
        "rope_cos_sliding",
        "rope_sin_sliding",
        "rope_cos_full",
        "rope_sin_full",
        "mask",
        "q",
        "k",
        "v",
        "attn_out",
        "layer_out",
        "final_hidden",
        "logits",
        "token",
    )
    assert schema.LAYER_KIND_NAMES == ("mask", "q", "k", "v", "attn_out", "layer_out")
    assert schema.tensor_path("q", 7) == "tensors/L07/q"
    assert schema.tensor_path("logits", None) == "tensors/logits"
    with pytest.raises(ValueError):
        schema.tensor_path("q", None)


def test_round_trip(tmp_path):
    rows = {}

    def keep(kind, layer, step, arr):
        rows.setdefault((kind, layer), []).append(arr)
        return arr

    tokens = write_trace(tmp_path / "t.h5", prompt_len=5, new_tokens=4, edit=keep)
    with TraceReader(tmp_path / "t.h5") as r:
        assert r.prompt_len == 5 and r.n_steps == 4 and r.n_positions == 8
        assert r.step_positions == [(0, 5), (5, 6), (6, 7), (7, 8)]
        assert r.layers == LAYERS
        assert list(r.tokens()) == list(tokens)
        for (kind, layer), parts in rows.items():
            got = r.read(kind, layer)
            if kind == "mask":
                # the key axis grows to the widest row; narrower rows are padded with False
                assert got.shape == (8, 8) and got.dtype == np.bool_
                for step, part in enumerate(parts):
                    a, b = r.step_positions[step]
                    np.testing.assert_array_equal(got[a:b, : part.shape[1]], part)
                    assert not got[a:b, part.shape[1] :].any()
                continue
            want = np.concatenate(
                [
                    np.asarray(p).reshape(-1, *np.asarray(p).shape[1:])
                    if schema.KIND_BY_NAME[kind].index == "position"
                    else np.asarray(p)[None]
                    for p in parts
                ]
            )
            np.testing.assert_array_equal(got, want.astype(got.dtype))
        assert not r.has("k", 3)  # a reusing layer writes no K/V of its own
        ds = r.dataset("q", 0)
        assert ds.compression == "gzip" and ds.shuffle and ds.fletcher32
        assert r.source_dtype("q", 0) == "float64"


def test_same_content_same_hash_different_content_different_hash(tmp_path):
    write_trace(tmp_path / "a.h5", seed=1)
    write_trace(tmp_path / "b.h5", seed=1)
    write_trace(tmp_path / "c.h5", seed=2)
    with TraceReader(tmp_path / "a.h5") as a, TraceReader(tmp_path / "b.h5") as b, TraceReader(tmp_path / "c.h5") as c:
        assert a.content_hash() == b.content_hash() != c.content_hash()


def test_version_mismatch_refused(tmp_path):
    write_trace(tmp_path / "t.h5")
    with h5py.File(tmp_path / "t.h5", "a") as f:
        f.attrs["schema_version"] = 999
    with pytest.raises(TraceFileError, match="schema version 999"):
        TraceReader(tmp_path / "t.h5")


def test_not_a_trace_refused(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(TraceFileError, match="not a readable HDF5"):
        TraceReader(tmp_path / "x.h5")
    with h5py.File(tmp_path / "y.h5", "w") as f:
        f["a"] = 1
    with pytest.raises(TraceFileError, match="not a gemma4-trace"):
        TraceReader(tmp_path / "y.h5")


def test_existing_output_kept_without_force_and_after_failed_force(tmp_path):
    out = tmp_path / "t.h5"
    write_trace(out, seed=3)
    with TraceReader(out) as r:
        before = r.content_hash()
    with pytest.raises(TraceToolError, match="already exists"):
        write_trace(out, seed=4)

    def boom(kind, layer, step, arr):
        if step == 2:
            raise RuntimeError("interrupted")
        return arr

    with pytest.raises(RuntimeError):
        write_trace(out, seed=4, edit=boom, force=True)
    with TraceReader(out) as r:
        assert r.content_hash() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.h5"]  # no partial file left behind


def test_rows_must_match_positions(tmp_path):
    with pytest.raises(ValueError, match="rows for"):
        with TraceWriter(tmp_path / "t.h5") as w:
            from tests.support.synth import provenance

            w.write_header(
                TraceHeader(Provenance.from_dict(provenance()), [1, 2, 3], LAYERS, max_new_tokens=1, eos_token_ids=[1])
            )
            w.begin_step(range(0, 3))
            w.add("embeddings", np.zeros((2, 6)))
    assert not (tmp_path / "t.h5").exists()


def test_docs_list_every_kind():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "trace-format.md").read_text()
    for name in KIND_NAMES:
        assert f"`{name}`" in doc, name
    from gemma4_trace.traces.schema import TOWERS

    encoders = doc[doc.index("## Encoder kinds") : doc.index("## Storage rules")]
    for tower in TOWERS:
        for kind in tower.kinds if tower.name != "text" else ():
            assert f"`{kind.key}`" in encoders or f"`{kind.name}`" in encoders, kind.key
