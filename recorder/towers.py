"""The encoder towers' part of a recording: the vision and audio towers' tensors of the prefill, as rows.

HF runs the vision tower once, in the prefill, on every image of the prompt at once: its
per-patch tensors keep an image axis and the processor's padding patches (position (-1, -1)).
A trace's vision rows are the real patches only, image after image (traces/schema.py): this
module drops the padding rows, and says before the run how many rows and soft tokens each
image gives (the header's tower table), so the writer can check every kind has them all.

HF runs the audio tower the same way, once on every clip at once: its per-frame tensors keep a clip
axis and the padding frames of the shorter clips; a trace's audio rows are the valid subsampled
frames (the mel frames' mask, halved by each of the two stride-2 convolutions as HF halves it), clip
after clip, one soft token per valid frame.
"""

from __future__ import annotations

from gemma4_trace.hf import sites as S
from gemma4_trace.traces import schema
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.layers import TowerInfo, tower_sizes
from gemma4_trace.traces.rows import image_counts

VISION = schema.TOWER_BY_NAME[S.VISION]
AUDIO = schema.TOWER_BY_NAME[S.AUDIO]
# the vision kinds whose tensors keep HF's image axis: (images, patches, ...) or, from the attention
# function, (images, heads, patches, head_dim); pooled and soft_tokens are stripped by HF already
_BY_HEAD = frozenset(s.kind for s in S.SITES if s.tower == S.VISION and s.tensor == S.ATTENTION)
_STRIPPED = frozenset(("pooled", "soft_tokens"))


def tower_infos(model, extra: dict) -> tuple[TowerInfo, ...]:
    """The encoder towers a recording of these inputs holds: the vision tower when the prompt has
    images, the audio tower when it has clips (and the model the tower); none: a version-1 trace."""
    return tuple(t for t in (_vision_info(model, extra), _audio_info(model, extra)) if t is not None)


def _sizes(model, tower) -> dict:
    sizes = tower_sizes(model.config, tower)
    missing = [k for k in schema.TOWER_ATTRS if k not in (sizes or {})]
    if missing:
        raise TraceToolError(f"the model's {tower.config} has no valid {', '.join(missing)}")
    return sizes


def _vision_info(model, extra: dict) -> TowerInfo | None:
    pos = extra.get("image_position_ids")
    if extra.get("pixel_values") is None or pos is None or not S.has_tower(model, S.VISION):
        return None
    sizes = _sizes(model, VISION)
    pooling = int(model.config.vision_config.pooling_kernel_size)
    counts = image_counts(pos.cpu().numpy(), pooling)
    if counts is None:
        raise TraceToolError(
            f"the images have {pos.shape[1]} patches, fewer than one pooled {pooling} x {pooling} token"
        )
    rows, tokens = counts
    return TowerInfo(S.VISION, **sizes, item_rows=rows, item_tokens=tokens)


def frame_mask(features_mask):
    """The subsampled frames' validity (clips, frames) from the mel frames' (clips, mel_frames): each
    stride-2 convolution keeps every other row of the mask, as HF's subsampling does."""
    return features_mask[:, ::2][:, ::2]


def _audio_info(model, extra: dict) -> TowerInfo | None:
    mask = extra.get("input_features_mask")
    if extra.get("input_features") is None or mask is None or not S.has_tower(model, S.AUDIO):
        return None
    frames = tuple(int(n) for n in frame_mask(mask.bool()).sum(dim=1).tolist())
    return TowerInfo(S.AUDIO, **_sizes(model, AUDIO), item_rows=frames, item_tokens=frames)


class VisionRows:
    """Gathers the vision tower's tensors during the prefill (hf/sites.py's rows), padding dropped."""

    def __init__(self, model, extra: dict):
        pos = extra.get("image_position_ids")
        self.valid = None if pos is None else (pos != -1).all(dim=-1)  # (images, patches): real patches
        self.buf: dict[tuple[str, int | None], object] = {}
        if self.valid is None or not S.has_tower(model, S.VISION):
            self.attention_layers: dict[int, int] = {}
            return
        site = S.BY_KEY[schema.kind_key("q", S.VISION)]
        n = S.layer_count(model, S.VISION)
        self.attention_layers = {id(S.submodule(model, site, i)): i for i in range(n)}

    def put(self, site, layer, t) -> None:
        """A hooked vision module's tensor (hf/sites.py), as rows."""
        self.buf[(site.kind, layer)] = self._rows(site.kind, t)

    def attention(self, layer: int, query, key, value, attention_mask) -> None:
        """One vision layer's call of the attention function: q, K and V as rows (patches, heads, dim)."""
        for kind, t in S.attention_tensors(query, key, value, attention_mask, S.VISION).items():
            self.buf[(kind, layer)] = self._rows(kind, t)

    def _rows(self, kind: str, t):
        if kind in _STRIPPED:
            return t
        valid = self.valid.to(t.device)
        return t.transpose(1, 2)[valid] if kind in _BY_HEAD else t[valid]

    def write(self, writer, convert) -> None:
        """Add every gathered tensor the writer keeps (as convert(tensor)) in the schema's order, then
        forget them."""
        _write(VISION, self.buf, writer, convert)
        self.buf = {}


def _write(tower, buf: dict, writer, convert) -> None:
    for k in tower.kinds:
        layers = sorted(layer for kind, layer in buf if kind == k.name and layer is not None)
        for layer in layers or ([None] if (k.name, None) in buf else []):
            if writer.keeps(k.key, layer):
                writer.add(k.name, convert(buf[(k.name, layer)]), layer=layer, tower=tower.name)


class AudioRows:
    """Gathers the audio tower's tensors during the prefill (hf/sites.py's rows), padding frames dropped."""

    def __init__(self, model, extra: dict):
        mask = extra.get("input_features_mask")
        has = mask is not None and extra.get("input_features") is not None and S.has_tower(model, S.AUDIO)
        self.valid = frame_mask(mask.bool()) if has else None  # (clips, frames): real frames
        self.buf: dict[tuple[str, int | None], object] = {}

    def put(self, site, layer, t) -> None:
        """A hooked audio module's tensor (clips, frames, width), as the valid frames' rows (a copy)."""
        if self.valid is not None:
            self.buf[(site.kind, layer)] = t[self.valid.to(t.device)]

    def write(self, writer, convert) -> None:
        """Add every gathered tensor the writer keeps (as convert(tensor)) in the schema's order."""
        _write(AUDIO, self.buf, writer, convert)
        self.buf = {}
