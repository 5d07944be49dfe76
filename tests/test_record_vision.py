"""`trace record --image`: the vision tower's sites, recorded where HF computes them (hf/sites.py),
padding patches dropped, image after image. Each kind is checked against what HF does with it next
(the soft tokens are the embeddings' image rows, the pooled rows the last layer pooled, ...), on the
image goldens and on fresh recordings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.traces import TraceReader
from gemma4_trace.traces.selection import Selection
from tests.support.cli import invoke, one_line_error

VISION_KINDS = ["patch_embeddings", "q", "k", "v", "attn_out", "mlp_out", "layer_out", "pooled", "soft_tokens"]


@pytest.fixture(scope="module")
def lm():
    from gemma4_trace.hf.model import load_model

    return load_model()


def vision(r: TraceReader, kind: str, layer: int | None = None) -> np.ndarray:
    return r.read(f"vision.{kind}", layer)


def real_rows(r: TraceReader, name: str) -> np.ndarray:
    """An extra input's real-patch rows, image after image."""
    pos = r.extra_inputs()["image_position_ids"]
    return np.concatenate([x[(p != -1).all(-1)] for x, p in zip(r.extra_inputs()[name], pos)])


@pytest.mark.parametrize("name,rows,tokens", [("image", (256,), (64,)), ("two_images", (256, 280), (64, 70))])
def test_the_goldens_hold_the_tower_as_the_processor_cut_the_images(name, rows, tokens):
    with TraceReader(golden_path(name)) as r:
        t = r.towers["vision"]
        assert (t.item_rows, t.item_tokens) == (rows, tokens)
        assert (t.layers, t.hidden, t.heads, t.head_dim) == (2, 32, 2, 16)
        pos = r.extra_inputs()["image_position_ids"]
        assert [int((p != -1).all(-1).sum()) for p in pos] == list(rows)  # padding patches dropped
        present = {k for k, _ in r.kinds_present()}
        assert {f"vision.{k}" for k in VISION_KINDS} <= present
        for kind in ("q", "k", "v"):
            assert vision(r, kind, 1).shape == (sum(rows), 2, 16)
        assert vision(r, "layer_out", 0).shape == (sum(rows), 32)
        assert vision(r, "soft_tokens").shape == (sum(tokens), 64)


@pytest.mark.parametrize("name", ["image", "two_images"])
def test_the_soft_tokens_are_the_embeddings_image_rows(name, lm):
    with TraceReader(golden_path(name)) as r:
        ids = np.asarray(r.prompt_ids)
        slots = ids == lm.model.config.image_token_id
        emb = r.read("embeddings")[: len(ids)]
        soft = vision(r, "soft_tokens")
        assert slots.sum() == len(soft)
        np.testing.assert_array_equal(emb[slots], soft)  # merged unscaled, image after image


@pytest.mark.parametrize("name", ["image", "two_images"])
def test_each_kind_is_what_hf_computes_from_the_one_before(name, lm):
    vt, ev = lm.model.model.vision_tower, lm.model.model.embed_vision
    with TraceReader(golden_path(name)) as r, torch.no_grad():
        t = r.towers["vision"]
        # the patch embedder on the real patches' pixels and positions
        px = torch.from_numpy(real_rows(r, "pixel_values"))
        xy = torch.from_numpy(real_rows(r, "image_position_ids"))
        pe = vt.patch_embedder(px[None], xy[None], torch.zeros(1, len(px), dtype=torch.bool))[0]
        np.testing.assert_allclose(vision(r, "patch_embeddings"), pe.numpy(), atol=1e-5)
        # a layer's output: its input + its post-normed attention and MLP outputs
        for i, layer in enumerate(vt.encoder.layers):
            x = torch.from_numpy(vision(r, "patch_embeddings") if i == 0 else vision(r, "layer_out", i - 1))
            h = x + layer.post_attention_layernorm(torch.from_numpy(vision(r, "attn_out", i)))
            mlp_in = layer.pre_feedforward_layernorm(h)
            np.testing.assert_allclose(vision(r, "mlp_out", i), layer.mlp(mlp_in).numpy(), atol=1e-5)
            out = h + layer.post_feedforward_layernorm(torch.from_numpy(vision(r, "mlp_out", i)))
            np.testing.assert_allclose(vision(r, "layer_out", i), out.numpy(), atol=1e-5)
            # attention over each image's own patches (v rows per head) through o_proj gives attn_out
            q, k, v = (torch.from_numpy(vision(r, kind, i)) for kind in ("q", "k", "v"))
            start = 0
            for n in t.item_rows:
                sl = slice(start, start + n)
                w = torch.softmax(torch.einsum("qhd,khd->hqk", q[sl], k[sl]), dim=-1)  # scaling 1.0
                o = torch.einsum("hqk,khd->qhd", w, v[sl]).reshape(n, -1)
                got = layer.self_attn.o_proj(o)
                np.testing.assert_allclose(vision(r, "attn_out", i)[sl], got.numpy(), atol=1e-4)
                start += n
        # the pooled rows are the last layer pooled k x k (padding stripped), embed_vision makes the soft tokens
        soft = ev(torch.from_numpy(vision(r, "pooled")))
        np.testing.assert_allclose(vision(r, "soft_tokens"), soft.numpy(), atol=1e-5)
        k = lm.model.config.vision_config.pooling_kernel_size
        last = vision(r, "layer_out", t.layers - 1)
        start, first = 0, 0
        for n, grid in zip(t.item_tokens, [p[(p != -1).all(-1)] for p in r.extra_inputs()["image_position_ids"]]):
            width = (grid[:, 0].max() + 1) // k
            cell = (grid[:, 1] // k) * width + grid[:, 0] // k
            rows = last[start : start + len(grid)]
            pooled = np.stack([rows[cell == c].mean(0) for c in range(n)]) * np.sqrt(t.hidden)
            np.testing.assert_allclose(vision(r, "pooled")[first : first + n], pooled, rtol=1e-4, atol=1e-4)
            start, first = start + len(grid), first + n


def test_a_selection_keeps_the_towers_layers_and_kinds_it_names(tmp_path):
    out = tmp_path / "sel.h5"
    r = invoke("record", "--image", golden_image(), "-o", out, "--layers", "vision:1", "--kinds", "vision.q,layer_out")
    assert r.exit_code == 0, r.output
    with TraceReader(out) as t:
        present = set(t.kinds_present())
        assert ("vision.q", 1) in present and ("vision.q", 0) not in present
        assert ("layer_out", 7) in present  # no text layers named: every text layer kept
        assert not any(k == "vision.layer_out" for k, _ in present)
        assert t.selection == Selection(None, t.selection.kinds, None, (("vision", (1,)),))
        # the golden's own tensor, to float32 rounding (bit-exact only on the CPU that recorded it)
        np.testing.assert_allclose(t.read("vision.q", 1), read_golden("vision.q", 1), rtol=0, atol=1e-5)


def golden_image():
    from gemma4_trace.hf.model import DEMO_IMAGE

    return DEMO_IMAGE


def read_golden(kind, layer=None):
    with TraceReader(golden_path("image")) as r:
        return r.read(kind, layer)


@pytest.mark.parametrize(
    "layers,needles",
    [
        ("vision:2", ["--layers vision:2", "the vision tower has 2 layers (0-1)"]),
        ("0,visio:1", ["unknown tower 'visio'", "towers: vision, audio, text"]),
        ("vision:0,vision:1", ["the vision tower is named twice"]),
        ("vision:", ["nothing selected"]),
    ],
)
def test_a_selection_of_layers_a_tower_lacks_is_one_line(layers, needles, tmp_path):
    out = tmp_path / "bad.h5"
    r = invoke("record", "--image", golden_image(), "-o", out, "--layers", layers)
    one_line_error(r, *needles, out=out)


def test_the_tower_selection_round_trips_and_reads_for_people():
    s = Selection.parse("0-3,vision:0,1", "vision.q,q", None)
    assert s.layers == (0, 1, 2, 3) and s.tower_layers == (("vision", (0, 1)),)
    assert Selection.from_json(__import__("json").dumps(s.to_json())) == s
    assert s.describe().startswith("layers 0-3,vision:0-1; kinds ")
    assert s.keeps("vision.q", 1) and not s.keeps("q", 5) and s.keeps("q", 3)
    assert Selection.parse("vision:1").keeps("q", 7)  # a tower not named keeps every layer


def _png(path, width: int, height: int) -> None:
    """A PNG whose header claims width x height (its pixel data a few bytes)."""
    import struct
    import zlib

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(b"\0" * 8)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda p: p.write_bytes(golden_image().read_bytes()[:150]), "is not a readable image"),  # truncated
        (lambda p: _png(p, 0, 0), "is not a readable image"),
        (lambda p: _png(p, 100_000, 100_000), "is not a readable image (DecompressionBombError)"),
        (lambda p: _png(p, 9000, 9000), "claims 9000 x 9000 pixels"),
        (lambda p: __import__("os").mkfifo(p), "is not a regular file"),  # opening it would block
        (lambda p: p.mkdir(), "is not a regular file"),
    ],
    ids=["truncated", "0x0", "100k-square", "81-megapixel", "fifo", "folder"],
)
def test_an_image_the_tool_cannot_read_is_one_line(make, needle, tmp_path):
    bad, out = tmp_path / "bad.png", tmp_path / "out.h5"
    make(bad)
    one_line_error(invoke("record", "--image", bad, "--prompt", "hi", "-o", out), needle, out=out)


@pytest.mark.parametrize(
    "path,value,needle",
    [
        ("towers/vision/item_rows", [250, 286], "declares 250+286 patches and 64+70 soft tokens, but its images"),
        ("inputs/extra/image_position_ids", None, "give 255+280 and 63+70"),  # one patch of image 1 made padding
    ],
)
def test_a_tower_table_that_disagrees_with_its_images_is_refused(path, value, needle, tmp_path):
    import shutil

    import h5py

    t = tmp_path / "t.h5"
    shutil.copyfile(golden_path("two_images"), t)
    with h5py.File(t, "r+") as f:
        a = f[path][()]
        if value is None:
            a[0, 100] = -1
        else:
            a[...] = value
        f[path][...] = a
    one_line_error(invoke("show", t), needle)
