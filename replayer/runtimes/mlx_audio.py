"""The audio side of `--runtime mlx`'s engine (replayer/runtimes/mlx.py, MLXEngine, in the child):
mlx-vlm's Gemma 4 audio encoder (`mlx_vlm/models/gemma4/audio.py`: SubSampleConvProjection, the
ConformerBlocks, output_proj) and embed_audio loaded from the same fixed folder as mlx-lm's text
model, fed REF's log-mel features (HF's feature extractor's: mlx-vlm's own extractor is not what
runs here), and its modules that the capture map's audio rows name wrapped. Every audio site is a
module's output, one row per subsampled frame of every clip (padding frames included): the engine
keeps the valid frames' rows, clip after clip, as HF's are recorded."""

from __future__ import annotations

import numpy as np

from gemma4_trace.traces import schema as S

from ..child import EngineError, quiet_fd2
from .mlx_spec import MLX

AUDIO = "audio"  # the encoder tower (traces/schema.py)
# every audio kind is read per subsampled frame of every clip (its padding frames dropped)
PER_FRAME = frozenset(k.key for k in S.TOWER_BY_NAME[AUDIO].kinds)


class AudioTaps:
    """MLXEngine's audio clips: `folder`, `mx`, `nn` and `seen` (the tensors the taps record) are the
    engine's; `frames` (clips, frames) bool: the valid subsampled frames of the last clips encoded."""

    frames = None

    def _load_audio(self, kinds):
        """mlx-vlm's Gemma 4 audio tower and embed_audio, loaded by mlx-vlm's own loader (config,
        sanitize: the conv weights moved to MLX's channel-last layout, weights) from the same folder
        as the text model; the rest of mlx-vlm's model is dropped unevaluated. Its audio sites
        tapped (`kinds`). A checkpoint mlx-vlm loads without an audio tower is one line."""
        mx, nn = self.mx, self.nn
        with quiet_fd2():  # mlx-vlm imports transformers and torch, whose start-up writes on fd 2
            from mlx_vlm.utils import load_model

            vlm = load_model(self.folder, lazy=True)
        if getattr(vlm, "audio_tower", None) is None or getattr(vlm, "embed_audio", None) is None:
            raise EngineError(
                "mlx-vlm loads this checkpoint without an audio tower (its config.json has no audio_config "
                "mlx-vlm reads): the audio prompt cannot run"
            )
        audio = nn.Module()  # the two modules the audio rows' paths start from
        audio.audio_tower, audio.embed_audio = vlm.audio_tower, vlm.embed_audio
        del vlm
        mx.eval(audio.parameters())
        self.audio = audio
        from mlx.utils import tree_flatten

        dtypes = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(audio.parameters())}
        self._tap_audio(audio, None if kinds is None else frozenset(kinds))
        return ("ready", {"layers": len(audio.audio_tower.layers), "dtypes": sorted(dtypes)})

    def _tap_audio(self, audio, kinds) -> None:
        """Wrap the modules of mlx-vlm's audio tower that the capture map's audio rows name (only
        those of the kinds in `kinds`; None: every kind): each call records its output (the
        subsampling's: its frames, not its mask)."""
        nn, engine = self.nn, self
        layers = len(audio.audio_tower.layers)
        at: dict[str, list] = {}
        for row in MLX.rows:
            if S.KIND_BY_NAME[row.kind].tower == AUDIO and (kinds is None or row.kind in kinds):
                for layer in range(layers) if S.layered(row.kind) else [None]:
                    at.setdefault(row.name(layer), []).append((row.kind, layer))

        class Tap(nn.Module):
            def __init__(self, inner, reads):
                super().__init__()
                self.inner, self.reads = inner, reads

            def __call__(self, *a, **k):
                out = self.inner(*a, **k)
                value = out[0] if isinstance(out, tuple) else out
                engine.seen += [(kind, layer, value) for kind, layer in self.reads]
                return out

        for path in sorted(at, key=lambda p: -p.count(".")):  # inside a layer before the layer itself
            where, _, name = path.rpartition(".")
            parent = audio
            for part in where.split(".") if where else ():
                parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
            if name.isdigit():
                parent[int(name)] = Tap(parent[int(name)], at[path])
            else:
                setattr(parent, name, Tap(getattr(parent, name), at[path]))

    def encode_audio(self, features: np.ndarray, features_mask: np.ndarray):
        """The clips' soft tokens (valid frames, text hidden), clip after clip: mlx-vlm's audio tower
        and embed_audio on every clip at once (HF's features, `features_mask` True on real mel frames;
        mlx-vlm's mask is True on padding). The valid subsampled frames are the tower's own output mask
        (kept in `frames` to strip every audio site's padding rows)."""
        mx = self.mx
        if getattr(self, "audio", None) is None:
            raise EngineError("an audio prompt reached mlx's engine before mlx-vlm's audio tower was loaded")
        encodings, padding = self.audio.audio_tower(mx.array(features), mx.array(~np.asarray(features_mask, bool)))
        soft = self.audio.embed_audio(encodings)
        self.frames = ~np.array(padding)  # (clips, frames): the valid subsampled frames
        keep = mx.array(np.flatnonzero(self.frames.reshape(-1)))
        return soft.reshape(-1, soft.shape[-1])[keep]
