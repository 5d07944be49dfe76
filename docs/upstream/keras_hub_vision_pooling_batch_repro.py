"""Minimal repro: keras-hub 0.32.0 pools a Gemma 4 image on the widest image's grid.

`Gemma4VisionAveragePooling.call` derives the pooled grid's width as
`n_w_pooled = (ops.max(clamped_positions[..., 0]) + 1) // k`: one maximum over every image of the
batch (all of `batch_size * max_images` flattened together). An image narrower than the widest one
in the same call gets its patches binned with the wrong row stride: its second pooled row lands on
a later bin, or past `output_length` where `one_hot` drops it (a soft token of zeros).
transformers 5.24 (`Gemma4VisionPooler._avg_pool_by_positions`) takes `max_x` per image
(`clamped_positions[..., 0].max(dim=-1, keepdim=True)`).

Needs keras-hub 0.32.0, keras 3 with jax, and numpy (nothing else):

    python docs/upstream/keras_hub_vision_pooling_batch_repro.py

It pools two images of 18 patches each with Gemma 4's kernel 3 (2 soft tokens each): a wide one
(6 patch columns x 3 rows) and a tall one (3 columns x 6 rows), once each alone and once together in
one call, as `generate()` batches a prompt's images. Expected: the same soft tokens either way (and
equal to the mean of each 3 x 3 block of patches, times sqrt(hidden), as transformers computes).
Observed: the tall image's second soft token is zeros when the wide image is in the batch. Exit 1
while the bug holds.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

K, D = 3, 4


def positions(cols: int, rows: int) -> np.ndarray:
    return np.array([(x, y) for y in range(rows) for x in range(cols)], "int32")  # (x, y) per patch, row-major


def reference(patches: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """transformers' pooling of one image: the mean of each k x k block, row-major, times sqrt(hidden)."""
    width = (pos[:, 0].max() + 1) // K
    bins = pos[:, 0] // K + width * (pos[:, 1] // K)
    out = np.zeros((len(patches) // K**2, patches.shape[-1]), "float32")
    np.add.at(out, bins, patches / K**2)
    return out * np.sqrt(patches.shape[-1])


def main() -> int:
    import keras
    import keras_hub
    from keras_hub.src.models.gemma4.gemma4_vision_encoder import Gemma4VisionAveragePooling

    pool = Gemma4VisionAveragePooling(image_size=None, patch_size=16, pool_size=K, dtype="float32")
    rng = np.random.default_rng(0)
    wide, tall = positions(6, 3), positions(3, 6)
    x = rng.normal(size=(2, 18, D)).astype("float32")
    alone = [np.asarray(pool(x[i][None, None], pos[None, None]))[0, 0] for i, pos in enumerate((wide, tall))]
    together = np.asarray(pool(x[None], np.stack([wide, tall])[None]))[0]
    print(f"keras-hub {keras_hub.__version__}, keras {keras.__version__} ({keras.backend.backend()})")
    print(f"Gemma4VisionAveragePooling, kernel {K}: image 0 is 6 x 3 patches (wide), image 1 is 3 x 6 (tall)")
    bug = False
    for i, (name, pos) in enumerate((("wide", wide), ("tall", tall))):
        want = reference(x[i], pos)
        for t in range(2):
            err_alone = np.abs(alone[i][t] - want[t]).max()
            err_batch = np.abs(together[i][t] - want[t]).max()
            print(
                f"image {i} ({name}), soft token {t}: max-abs error vs per-image pooling: alone {err_alone:.1g},"
                f" in one call with the other image {err_batch:.1g} (norm {np.linalg.norm(together[i][t]):.3g},"
                f" expected {np.linalg.norm(want[t]):.3g})"
            )
            bug |= bool(err_batch > 1e-3 and err_alone < 1e-5)
    print(
        "BUG: an image pools on the widest image's grid when batched"
        if bug
        else "fixed: each image pools on its own grid"
    )
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
