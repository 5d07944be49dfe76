"""The encoder towers' part of a recording: the vision tower's tensors of the prefill, as rows.

HF runs the vision tower once, in the prefill, on every image of the prompt at once: its
per-patch tensors keep an image axis and the processor's padding patches (position (-1, -1)).
A trace's vision rows are the real patches only, image after image (traces/schema.py): this
module drops the padding rows, and says before the run how many rows and soft tokens each
image gives (the header's tower table), so the writer can check every kind has them all.
"""

from __future__ import annotations

from gemma4_trace.hf import sites as S
from gemma4_trace.traces import schema
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.layers import TowerInfo, tower_sizes
from gemma4_trace.traces.rows import image_counts

VISION = schema.TOWER_BY_NAME[S.VISION]
# the vision kinds whose tensors keep HF's image axis: (images, patches, ...) or, from the attention
# function, (images, heads, patches, head_dim); pooled and soft_tokens are stripped by HF already
_BY_HEAD = frozenset(s.kind for s in S.SITES if s.tower == S.VISION and s.tensor == S.ATTENTION)
_STRIPPED = frozenset(("pooled", "soft_tokens"))


def tower_infos(model, extra: dict) -> tuple[TowerInfo, ...]:
    """The encoder towers a recording of these inputs holds: the vision tower when the prompt has
    images (and the model a vision tower), else none (a version-1 trace)."""
    pos = extra.get("image_position_ids")
    if extra.get("pixel_values") is None or pos is None or not S.has_tower(model, S.VISION):
        return ()
    sizes = tower_sizes(model.config, VISION)
    missing = [k for k in schema.TOWER_ATTRS if k not in (sizes or {})]
    if missing:
        raise TraceToolError(f"the model's vision_config has no valid {', '.join(missing)}")
    pooling = int(model.config.vision_config.pooling_kernel_size)
    counts = image_counts(pos.cpu().numpy(), pooling)
    if counts is None:
        raise TraceToolError(
            f"the images have {pos.shape[1]} patches, fewer than one pooled {pooling} x {pooling} token"
        )
    rows, tokens = counts
    return (TowerInfo(S.VISION, **sizes, item_rows=rows, item_tokens=tokens),)


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
        for k in VISION.kinds:
            layers = sorted(layer for kind, layer in self.buf if kind == k.name and layer is not None)
            for layer in layers or ([None] if (k.name, None) in self.buf else []):
                if writer.keeps(k.key, layer):
                    writer.add(k.name, convert(self.buf[(k.name, layer)]), layer=layer, tower=S.VISION)
        self.buf = {}
