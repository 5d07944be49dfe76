"""A divergence inside the vision tower, for people: the sentence names the image, the encoder layer,
the kind and the patch with its row and column in the image (or the pooled cell), and the HTML
report lays each patch's error over the image. RUN is the two-image golden with one row changed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma4_trace.recorder.golden import golden_path
from gemma4_trace.traces import TraceReader
from tests.support.cli import invoke
from tests.support.diff_fixtures import copy_trace

REF = golden_path("two_images")


def bump(kind: str, layer, row: int):
    def edit(k, l, s, rows):
        if (k, l, s) == (kind, layer, 0):  # the prefill's rows (an encoder's: all of them)
            rows[row] += 1.0
        return rows

    return edit


def place(row: int) -> tuple[int, int, int, int]:
    """(image, its patch, row, col) of a vision patch row of REF, from its image_position_ids."""
    with TraceReader(REF) as r:
        pos = r.extra_inputs()["image_position_ids"]
    grids = [p[(p != -1).all(-1)] for p in pos]
    first = len(grids[0])
    image, within = (0, row) if row < first else (1, row - first)
    x, y = grids[image][within]
    return image + 1, within, int(y), int(x)


@pytest.mark.parametrize("kind,layer,row", [("vision.attn_out", 1, 300), ("vision.q", 0, 17)])
def test_the_sentence_names_image_layer_kind_and_patch_place(kind, layer, row, tmp_path):
    run = tmp_path / "run.h5"
    copy_trace(REF, run, edit=bump(kind, layer, row))
    res = invoke("diff", REF, run, "--json")
    assert res.exit_code == 1, res.output
    d = json.loads(res.stdout)["first_divergence"]
    assert (d["tower"], d["kind"], d["layer"], d["position"]) == ("vision", kind, layer, row)
    image, within, r, c = place(row)
    name = kind.split(".")[1]
    assert (
        f"vision tower, layer {layer}, kind {name}, patch {row} (image {image}, its patch {within}: " in d["sentence"]
    )
    assert f"row {r}, col {c})" in d["sentence"]


def test_a_pooled_row_names_its_cell_of_the_pooled_grid(tmp_path):
    run = tmp_path / "run.h5"
    copy_trace(REF, run, edit=bump("vision.pooled", None, 70))  # image 2 (64 + 6): its 6th pooled token
    res = invoke("diff", REF, run)
    assert res.exit_code == 1
    # image 2 is 20 x 14 patches: pooled 2 x 2, 10 cells a row -> token 6 is row 0, col 6
    assert "kind pooled, soft token 70 (image 2, its soft token 6: row 0, col 6)" in res.stdout


def test_the_report_lays_the_errors_over_each_image(tmp_path):
    run = tmp_path / "run.h5"
    copy_trace(REF, run, edit=bump("vision.layer_out", 0, 300))
    page = tmp_path / "report.html"
    res = invoke("diff", REF, run, "--report", page)
    assert res.exit_code == 1
    text = page.read_text()
    assert "<h2>Vision: error of vision.layer_out of layer 0 over each image</h2>" in text
    image, within, r, c = place(300)
    assert "image 1: 16 x 16 cells, 0 over the tolerance" in text  # 64 x 64 pixels, patch 4
    assert "image 2: 14 x 20 cells, 1 over the tolerance" in text
    assert f"<title>row {r}, col {c}: rel-L2 " in text
    assert text.count('stroke="#000" stroke-width="2"/>') >= 1  # the first divergence framed
    with TraceReader(REF) as t:
        px = t.extra_inputs()["pixel_values"][0, 0].reshape(-1, 3).mean(0)  # image 1's first patch, channel last
    colour = "#" + "".join(f"{int(round(v * 255)):02x}" for v in np.clip(px, 0, 1))
    assert f'fill="{colour}"' in text  # the patch drawn in its own colour


def test_a_text_divergence_draws_no_image(tmp_path):
    run = tmp_path / "run.h5"
    copy_trace(REF, run, edit=bump("layer_out", 3, 100))
    page = tmp_path / "report.html"
    assert invoke("diff", REF, run, "--report", page).exit_code == 1
    assert "Vision: error of" not in page.read_text()
