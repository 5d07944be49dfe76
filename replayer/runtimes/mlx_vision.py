"""The vision side of `--runtime mlx`'s engine (replayer/runtimes/mlx.py, MLXEngine, in the child):
mlx-vlm's Gemma 4 vision tower and embed_vision loaded from the same fixed folder as mlx-lm's text
model, and its modules that the capture map's vision rows name wrapped; q and k are what mlx-vlm's
2D RoPE function returns, its first call by an attention q, its second k."""

from __future__ import annotations

from gemma4_trace.traces import schema as S

from ..child import quiet_fd2
from .mlx_spec import MLX

VISION = "vision"  # the encoder tower mlx-vlm runs (traces/schema.py)


class VisionTaps:
    """MLXEngine's images: `folder`, `mx`, `nn` and `seen` (the tensors the taps record) are the engine's."""

    def _load_vision(self, kinds):
        """mlx-vlm's Gemma 4 vision tower and embed_vision, loaded by mlx-vlm's own loader (config,
        sanitize, weights) from the same folder as the text model; the rest of mlx-vlm's model (its
        own language model, an audio tower) is dropped unevaluated. Its vision sites tapped (`kinds`)."""
        mx, nn = self.mx, self.nn
        with quiet_fd2():  # mlx-vlm imports transformers and torch, whose start-up writes on fd 2
            from mlx_vlm.utils import load_model

            vlm = load_model(self.folder, lazy=True)
        tower = nn.Module()  # the two modules the vision rows' paths start from
        tower.vision_tower, tower.embed_vision = vlm.vision_tower, vlm.embed_vision
        del vlm
        mx.eval(tower.parameters())
        self.tower, layers = tower, len(tower.vision_tower.encoder.layers)
        from mlx.utils import tree_flatten

        dtypes = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(tower.parameters())}
        self._tap_vision(tower, None if kinds is None else frozenset(kinds))
        return ("ready", {"layers": layers, "dtypes": sorted(dtypes)})

    def _tap_rope_2d(self, rope: dict) -> None:
        """mlx-vlm's 2D RoPE function, wrapped (once a process) where q or k is read (`rope`: the
        attention paths whose calls give them): its first call by an attention is q, its second k."""
        import mlx_vlm.models.gemma4.vision as V

        engine = self
        self.rope_reads, self.vision_attention = rope, None
        if not rope or getattr(V.apply_multidimensional_rope, "tapped", False):
            return
        inner_rope = V.apply_multidimensional_rope

        def tapped_rope(*a, **k):
            out = inner_rope(*a, **k)
            path = engine.vision_attention
            if path in engine.rope_reads:
                calls = engine.rope_calls[path] = engine.rope_calls.get(path, 0) + 1
                kind = "vision.q" if calls == 1 else "vision.k"
                engine.seen += [(kn, n, out) for kn, n in engine.rope_reads[path] if kn == kind]
            return out

        tapped_rope.tapped = True
        V.apply_multidimensional_rope = tapped_rope

    def _tap_vision(self, tower, kinds) -> None:
        """Wrap the modules of mlx-vlm's vision tower that the capture map's vision rows name (only
        those of the kinds in `kinds`; None: every kind). q and k are the outputs of the 2D RoPE, a
        function of mlx-vlm's vision module (`apply_multidimensional_rope`) each attention calls for
        q, then for k: it is wrapped in this process, and the attention module's wrapper says which
        layer is calling."""
        nn, engine = self.nn, self
        layers = len(tower.vision_tower.encoder.layers)
        at: dict[str, list] = {}
        for row in MLX.rows:
            if S.KIND_BY_NAME[row.kind].tower == VISION and (kinds is None or row.kind in kinds):
                for layer in range(layers) if S.layered(row.kind) else [None]:
                    at.setdefault(row.name(layer), []).append((row.kind, layer))
        rope = {path: reads for path, reads in at.items() if reads_both(path, "vision.q", "vision.k")}
        self._tap_rope_2d(rope)
        for path in sorted(at, key=lambda p: -p.count(".")):  # inside a layer before the layer itself
            where, _, name = path.rpartition(".")
            parent = tower
            for part in where.split(".") if where else ():
                parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
            inner = parent[int(name)] if name.isdigit() else getattr(parent, name)
            reads = [(k, n) for k, n in at[path] if path not in rope]

            def record(out, reads=reads):
                engine.seen += [(k, n, out[0] if k in POOLED else out) for k, n in reads]

            if path in rope:  # the attention: say which layer calls the RoPE

                def call(inner, a, k, path=path):
                    engine.vision_attention = path
                    try:
                        return inner(*a, **k)
                    finally:
                        engine.vision_attention = None
            else:

                def call(inner, a, k, record=record):
                    out = inner(*a, **k)
                    record(out)
                    return out

            if isinstance(inner, nn.Module):

                class Tap(nn.Module):
                    def __init__(self, inner, call):
                        super().__init__()
                        self.inner, self.call = inner, call

                    def __call__(self, *a, **k):
                        return self.call(self.inner, a, k)

                wrapped = Tap(inner, call)
            else:  # a method (the patch embedder's embed_patches)

                def wrapped(*a, inner=inner, call=call, **k):
                    return call(inner, a, k)

            if name.isdigit():
                parent[int(name)] = wrapped
            else:
                setattr(parent, name, wrapped)


def reads_both(path: str, *kinds: str) -> bool:
    """Whether the capture map reads all of `kinds` at `path` (q and k: the same RoPE module)."""
    return all(MLX.row(k).matches(path) for k in kinds)


# the vision kinds read per patch (their padding rows dropped); those read from a (1, tokens, hidden) output
POOLED = frozenset({"vision.pooled", "vision.soft_tokens"})
PER_PATCH = frozenset(k.key for k in S.TOWER_BY_NAME[VISION].kinds) - POOLED
