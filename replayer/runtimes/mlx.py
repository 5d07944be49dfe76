"""`--runtime mlx`, `mlx-q8`, `mlx-q4` and their `-dq` baselines: REF's checkpoint loaded by
mlx-lm (Apple's MLX; on Linux its CPU backend) and run through mlx-lm's own Gemma 4 modules and
caches, in the child process (extra `gemma4-trace[mlx]`).

mlx-lm's `models/gemma4_text.py` is an implementation of Gemma 4 independent of PyTorch (PLE, KV
sharing, proportional RoPE, the double-wide MLP, v_norm, layer_scalar, the soft-cap). The replay
feeds the prompt in one call and each later token in one call through mlx-lm's `KVCache` /
`RotatingKVCache` (teacher-forced or `--free-running`), and taps mlx-lm's modules in the child
(the module paths are its capture map's, runtimes/captures.py: MLX):

    embeddings        layer 0's input (the scaled token embeddings)
    per_layer_inputs  the result of the model's per-layer input projection
    q, k              the outputs of each attention's RoPE call (k only where the layer owns K/V)
    v                 the output of v_norm (the rows handed to the cache)
    attn_out          o_proj's output;  layer_out: each decoder layer's output
    final_hidden      the final norm's output

Only the modules of the kinds the replay keeps are wrapped and streamed back (`--kinds`,
RuntimeChoice.capture); with none asked, mlx-lm's model runs as loaded and only logits return.

Not compared: the mask (mlx-lm builds it for its ring-buffer layout, or passes "causal") and the
RoPE tables (computed inside `mx.fast.rope`).

    mlx-q8, mlx-q4   mlx-lm's own `quantize_model` (affine, group size 64, its default), with its
                     own rule for what stays float (a matrix whose input width is no multiple of
                     64, e.g. the embedded model's 8-wide per-layer projection)
    mlx-qN-dq        that quantized model with every quantized weight dequantized back into a
                     float32 Linear / Embedding: the same weights in float kernels (its --baseline)

Two config fixes: mlx-lm 0.32.2 reads a transformers-5.24 Gemma 4 config wrongly in two places
(docs/upstream/mlx-lm-gemma4-config.md); the checkpoint is loaded from a folder holding a fixed
copy of config.json beside links to its weights, and each fix is said once on stderr and in the
provenance.

An image prompt (docs/vision.md): mlx-lm's Gemma 4 drops the vision weights, so the vision tower
is mlx-vlm's own Gemma 4 `vision_tower` and `embed_vision`, loaded by mlx-vlm's loader from the
same fixed folder (it misreads global_head_dim as mlx-lm does; said once on stderr), every image at
once, each vision site tapped and kept at the real patches' rows. The soft tokens enter mlx-lm's
text model as the image rows of `input_embeddings` (over its sqrt(hidden) scale, which it
multiplies in), the per-layer inputs looked up with pad ids there, and, where the text model
attends within an image both ways, HF's masks in place of mlx-lm's causal ones for the prefill.

An audio prompt (mlx_audio.py): mlx-vlm's own Gemma 4 `audio_tower` and `embed_audio`, from the same
folder, on REF's log-mel features (HF's extractor's), every clip at once; each audio site tapped and
kept at the valid subsampled frames' rows, clip after clip; the valid frames' soft tokens enter at
the audio-token slots as the images' do (mlx-vlm's own merge, which scatters the padding frames
too, is not used: docs/upstream/mlx-vlm-gemma4-audio-padding.md).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.schema import sites_of

from ..api import report
from ..child import ChildRuntime, EngineError, quiet_fd2
from .mlx_audio import AUDIO, PER_FRAME, AudioTaps
from .mlx_spec import MLX
from .mlx_vision import PER_PATCH, VISION, VisionTaps, reads_both

ENGINE = "gemma4_trace.replayer.runtimes.mlx:MLXEngine"
GROUP = 64  # mlx-lm's default group size for affine quantization
MODES = {"mlx": None, "mlx-q8": 8, "mlx-q4": 4}
MLX_DEFAULTS = {"vocab_size": 262144, "global_head_dim": 512}  # mlx-lm 0.32.2's ModelArgs defaults


# ------------------------------------------------------------------ the config mlx-lm can read
def fixed_config(cfg: dict) -> tuple[dict, list[str]]:
    """A copy of a transformers-5.24 Gemma 4 config that mlx-lm 0.32.2 reads as transformers does,
    and one phrase per fix made. Refuses (one line) what no fix makes mlx-lm read right."""
    cfg = json.loads(json.dumps(cfg))
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    fixes = []
    vocab = text.get("vocab_size")
    if text is not cfg and vocab is not None and cfg.get("vocab_size", MLX_DEFAULTS["vocab_size"]) != vocab:
        # mlx-lm's gemma4 ModelArgs copies its own top-level vocab_size (default 262144) over text_config's
        cfg["vocab_size"] = vocab
        fixes.append(f"top-level vocab_size set to text_config's {vocab}")
    types = text.get("layer_types") or []
    per_layer = text.get("per_layer_config") or {}
    full = {int(i): v for i, v in per_layer.items() if int(i) < len(types) and types[int(i)] == "full_attention"}
    if any(types[int(i)] != "full_attention" for i in per_layer if int(i) < len(types)):
        raise TraceToolError("mlx-lm cannot load this checkpoint: per_layer_config overrides a sliding layer")
    dims = {v.get("head_dim") for v in full.values()} - {None}
    if len(dims) > 1:
        raise TraceToolError(f"mlx-lm cannot load this checkpoint: full layers of head_dim {sorted(dims)}")
    if dims and text.get("global_head_dim", MLX_DEFAULTS["global_head_dim"]) != (dim := dims.pop()):
        # mlx-lm takes full layers' head_dim from global_head_dim (default 512); 5.24 writes per_layer_config
        text["global_head_dim"] = dim
        fixes.append(f"global_head_dim set to the full layers' head_dim {dim} (from per_layer_config)")
    kv = {v.get("num_key_value_heads") for v in full.values()} - {None}
    if kv and text.get("num_global_key_value_heads") != (n := kv.pop()):
        text["num_global_key_value_heads"] = n
        fixes.append(f"num_global_key_value_heads set to {n} (from per_layer_config)")
    return cfg, fixes


def staged_checkpoint(model_dir: Path) -> tuple[Path, list[str]]:
    """A temporary folder mlx-lm loads: the fixed config.json and links to the weight files."""
    cfg, fixes = fixed_config(json.loads((model_dir / "config.json").read_text()))
    folder = Path(tempfile.mkdtemp(prefix="gemma4-trace-mlx-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json"):
            (folder / f.name).symlink_to(f.resolve())
    return folder, fixes


# ------------------------------------------------------------------ the child
class MLXEngine(VisionTaps, AudioTaps):
    """("load", folder, bits, dequantize, kinds) -> ("ready", info); ("vision", kinds) / ("audio",
    kinds) -> ("ready", info): mlx-vlm's vision / audio tower loaded and tapped; ("step", [token ids],
    position[, media]) -> the step's kinds streamed (the child's emit: ("tensors", [(kind, layer,
    array), ...])), then ("logits", array); `media` (a prefill with images or audio clips):
    pad_token_id, blocks (each position's image or -1; None: causal masks), and pixel_values,
    image_position_ids, image_token_id where it has images, input_features, input_features_mask,
    audio_token_id where it has clips. Only `kinds` are tapped and streamed (None: every kind;
    empty: none, the logits alone)."""

    def __init__(self, emit):
        self.emit = emit
        try:
            with quiet_fd2():
                import mlx.core as mx
                import mlx.nn as nn
                import mlx_lm.utils as U
        except (ImportError, OSError) as e:  # plain `mlx` on Linux has no CPU backend (libmlx.so)
            raise SystemExit(f"mlx cannot be imported ({e}); install the CPU build: pip install 'mlx[cpu]'") from None
        self.mx, self.nn, self.U = mx, nn, U
        self.seen: list = []

    def handle(self, command: str, *args):
        if command == "load":
            return self._load(*args)
        if command == "vision":
            return self._load_vision(*args)
        if command == "audio":
            return self._load_audio(*args)
        ids, position, media = args if len(args) == 3 else (*args, None)
        if position != self.offset:
            raise EngineError(f"asked for position {position} with {self.offset} positions in mlx-lm's cache")
        mx = self.mx
        self.seen, self.rope_calls, self.valid, self.frames = [], {}, None, None
        if media is None:
            logits = self.model(mx.array([ids]), cache=self.cache)[0, -1]
        else:
            logits = self._prefill_media(ids, media)[0, -1]
        mx.eval(logits, *(v for _, _, v in self.seen))
        self.offset += len(ids)
        for kind, layer, value in self.seen:
            value = np.array(value.astype(mx.float32))
            if kind in PER_PATCH:  # the real patches' rows, image after image (padding patches dropped)
                value = value[self.valid]
            elif kind in PER_FRAME:  # the valid frames' rows, clip after clip (padding frames dropped)
                value = value[self.frames]
            self.emit(kind, layer, value)
        return ("logits", np.array(logits.astype(mx.float32)))

    def _load(self, folder: str, bits, dequantize: bool, kinds):
        model, config = self.U.load_model(Path(folder))
        info = {"quantized": 0, "kept": 0}
        if bits is not None:
            with quiet_fd2():  # quantize_model prints its bits per weight
                model, _ = self.U.quantize_model(model, config, GROUP, bits)
            info["quantized"] = sum(hasattr(m, "scales") for _, m in model.named_modules())
            info["kept"] = sum(isinstance(m, self.nn.Linear) for _, m in model.named_modules())
            if dequantize:
                self._dequantize(model)
        self.model, self.cache, self.offset = model, model.make_cache(), 0
        self.folder, self.kinds = Path(folder), None if kinds is None else frozenset(kinds)
        self._tap(model, self.kinds)
        return ("ready", info)

    def _dequantize(self, model) -> None:
        """Every quantized Linear / Embedding back to a float32 one holding its dequantized weight."""
        mx, nn = self.mx, self.nn
        from mlx.utils import tree_map_with_path

        def back(path, m):
            if not hasattr(m, "scales"):
                return m
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits).astype(mx.float32)
            if isinstance(m, nn.QuantizedEmbedding):
                f = nn.Embedding(*w.shape)
            else:
                f = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                if "bias" in m:
                    f.bias = m.bias
            f.weight = w
            return f

        model.update_modules(tree_map_with_path(back, model.leaf_modules(), is_leaf=nn.Module.is_module))

    def _prefill_media(self, ids: list[int], media: dict):
        """The prompt with images or audio clips: mlx-vlm's vision tower and embed_vision on every
        image at once (the soft tokens that cover real patches, image after image), its audio tower
        and embed_audio on every clip at once (the valid frames' soft tokens, clip after clip), then
        mlx-lm's text model on the input embeddings: the token embeddings with the soft tokens in
        the image- and audio-token slots, the per-layer inputs looked up with pad ids there (as HF),
        and, where the model attends within an image both ways, HF's masks for the prefill (sliding
        layers: window AND (causal OR the same image); full layers causal)."""
        mx = self.mx
        towers = []  # (the token id of its slots, its soft tokens, what gives them)
        if "pixel_values" in media:
            pixels, positions = media["pixel_values"], media["image_position_ids"]
            self.valid = (positions != -1).all(axis=-1)  # (images, patches): the real patches
            soft = self.tower.embed_vision(self.tower.vision_tower(mx.array(pixels), mx.array(positions)))[0]
            why = "mlx-vlm's vision tower pools or resizes otherwise than the processor did"
            towers.append((media["image_token_id"], soft, "images", why))
        if "input_features" in media:
            soft = self.encode_audio(media["input_features"], media["input_features_mask"])
            why = "mlx-vlm's audio tower subsamples otherwise than HF's"
            towers.append((media["audio_token_id"], soft, "audio clips", why))
        ids_np = np.asarray(ids)
        lm = self.model.language_model.model if hasattr(self.model, "language_model") else self.model.model
        plain = ids_np.copy()  # pad ids at every soft token's slot (HF's per-layer inputs take those)
        for token, soft, what, why in towers:
            slots = ids_np == token
            if soft.shape[0] != int(slots.sum()):
                raise EngineError(
                    f"the {what} give {soft.shape[0]} soft tokens for {int(slots.sum())} slots in the prompt ({why})"
                )
            plain[slots] = media["pad_token_id"]
        plain = mx.array(plain[None])
        merged = lm.embed_tokens(plain)
        # mlx-lm scales what it is given by sqrt(hidden); HF puts the soft tokens in unscaled: divide
        # them by the scale first (exact where it is a power of two: the embedded model's 8)
        for token, soft, _, _ in towers:
            slots = ids_np == token
            rows = mx.array(np.maximum(np.cumsum(slots) - 1, 0))  # each position's soft token (its slot's)
            merged = mx.where(mx.array(slots)[None, :, None], (soft[rows] / lm.embed_scale)[None], merged)
        per_layer = lm._get_per_layer_inputs(plain) if lm.hidden_size_per_layer_input else None
        blocks = media.get("blocks")
        if blocks is None:
            return self.model(mx.array([ids]), cache=self.cache, input_embeddings=merged, per_layer_inputs=per_layer)
        made = lm._make_masks
        n = len(ids)
        q, k = np.arange(n)[:, None], np.arange(n)[None, :]
        same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
        sliding = mx.array((k > q - lm.window_size) & ((k <= q) | same))

        def masks(h, cache):
            return [
                sliding if layer.layer_type == "sliding_attention" else m for layer, m in zip(lm.layers, made(h, cache))
            ]

        lm._make_masks = masks
        try:
            return self.model(mx.array([ids]), cache=self.cache, input_embeddings=merged, per_layer_inputs=per_layer)
        finally:
            del lm._make_masks

    def _tap(self, model, kinds) -> None:
        """Wrap the modules of mlx-lm's text model that its capture map names (runtimes/captures.py:
        MLX) so that each step records what they compute (self.seen): only those of the kinds in
        `kinds` (None: every kind; empty: none, the model as loaded)."""
        lm = model.language_model.model if hasattr(model, "language_model") else model.model
        at: dict[str, list] = {}  # module path -> the (kind, layer) read there
        for row in MLX.rows:
            text = S.KIND_BY_NAME[row.kind].tower == S.TEXT
            if row.kind != "logits" and text and (kinds is None or row.kind in kinds):
                for site in sites_of(row.kind, len(lm.layers)):
                    at.setdefault(row.name(site.layer), []).append((site.kind, site.layer))
        for path in sorted(at, key=lambda p: -p.count(".")):  # inside a layer before the layer itself
            self._wrap(lm, path, at[path])

    def _wrap(self, lm, path: str, reads: list) -> None:
        """Wrap the module (or method) at `path` below lm: each call records the kinds `reads` names."""
        nn, engine = self.nn, self
        where, _, name = path.rpartition(".")
        parent = lm
        for part in where.split(".") if where else ():
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        inner = parent[int(name)] if name.isdigit() else getattr(parent, name, None)
        layer = next((n for _, n in reads if n is not None), None)
        owns = layer is None or lm.layers[layer].self_attn.has_kv  # a layer that reuses K/V computes none
        reads = [(k, n) for k, n in reads if owns or k not in ("k", "v")]
        if inner is None or not reads:  # no per-layer input projection in a model without PLE
            return
        rope = reads_both(path, "q", "k")

        def record(a, out):
            if rope:  # q and k come from the same RoPE call: k first where the layer owns K/V
                calls = engine.rope_calls[path] = engine.rope_calls.get(path, 0) + 1
                kind = "k" if owns and calls == 1 else "q"
                engine.seen += [(k, n, _READ[k](a, out)) for k, n in reads if k == kind]
            else:
                engine.seen += [(k, n, _READ[k](a, out)) for k, n in reads]

        class Tap(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def __call__(self, *a, **k):
                out = self.inner(*a, **k)
                record(a, out)
                return out

        if isinstance(inner, nn.Module):
            wrapped = Tap(inner)
            if hasattr(inner, "layer_type"):
                wrapped.layer_type = inner.layer_type  # read by mlx-lm's mask builder
        else:  # a method (the per-layer input projection)

            def wrapped(*a, **k):
                out = inner(*a, **k)
                record(a, out)
                return out

        if name.isdigit():
            parent[int(name)] = wrapped
        else:
            setattr(parent, name, wrapped)


# how each kind is read from its module's call (args, output): one row of batch 1 (q, k: heads after rows)
_READ = {
    "embeddings": lambda a, out: a[0][0],
    "per_layer_inputs": lambda a, out: out[0],
    "q": lambda a, out: out[0].transpose(1, 0, 2),
    "k": lambda a, out: out[0].transpose(1, 0, 2),
    "v": lambda a, out: out[0],
    "attn_out": lambda a, out: out[0],
    "layer_out": lambda a, out: out[0][0],
    "final_hidden": lambda a, out: out[0],
}


# ------------------------------------------------------------------ the parent
_SAID: set = set()  # the model folders and (folder, mode) pairs whose loading line this process wrote
_SAY = {  # said once per process where a tower first loads: mlx-vlm reads the same fixed copy of config.json
    VISION: "the image's vision tower: mlx-vlm's Gemma 4 (its loader reads the same fixed config.json: without "
    "global_head_dim it refuses the checkpoint, as mlx-lm does)",
    AUDIO: "the clip's audio tower: mlx-vlm's Gemma 4 audio encoder, from the same fixed config.json, fed REF's "
    "log-mel features (HF's feature extractor's, not mlx-vlm's own)",
}


class MLXRuntime(ChildRuntime):
    """mlx-lm's Gemma 4 in the child; the host feeds token ids and hands the tapped kinds to the probe."""

    vision: str | None = None  # what runs an image prompt's vision tower, once loaded
    audio: str | None = None  # what runs an audio prompt's audio tower, once loaded

    def __init__(self, loaded, max_seq: int, mode: str, capture: frozenset[str] | None = None):
        from importlib.metadata import version

        self.mode, self.capture, self.config = mode, capture, loaded.model.config
        self.model_key = str(Path(loaded.model_dir).resolve())
        self.folder, fixes = staged_checkpoint(Path(loaded.model_dir))
        base = mode.removesuffix("-dq")
        v = {p: version(p) for p in ("mlx", "mlx-lm")}
        label = f"{mode} (mlx {v['mlx']}, mlx-lm {v['mlx-lm']})"
        what = "float32" if base == "mlx" else f"mlx-lm's quantize_model: {MODES[base]}-bit affine, group size {GROUP}"
        if mode.endswith("-dq"):
            what += ", dequantized into float32 weights"
        # said once per process (a sweep loads the runtime for every prompt, and its baseline beside it)
        model_key = str(Path(loaded.model_dir).resolve())
        said = f"; config.json fixed for mlx-lm: {'; '.join(fixes)}" if fixes and model_key not in _SAID else ""
        if (model_key, mode) not in _SAID:
            print(
                f"{mode}: loading with mlx-lm (MLX compiles its CPU kernels with g++ on first use){said}",
                file=sys.stderr,
            )
        _SAID.update({model_key, (model_key, mode)})
        child = self.start(label, ENGINE, streams=True)
        try:
            kinds = None if capture is None else sorted(capture)  # the child taps only these (--kinds)
            info = child.call("load", str(self.folder), MODES[base], mode.endswith("-dq"), kinds, phase="loading")[1]
        except BaseException:
            self.close()
            raise
        kept = f"; {info['quantized']} layers quantized, {info['kept']} kept float" if MODES[base] else ""
        self.fixed = f"; config fixed: {'; '.join(fixes)}" if fixes else ""
        self.head = f"{label[:-1]}, CPU; {what}{kept}"
        self.name = f"{self.head}{self.fixed})"

    def prepare(self, input_ids, extra_inputs) -> None:
        """A prompt with images or audio clips: mlx-vlm's vision or audio tower loaded in the child,
        once (one line where mlx-vlm is not installed, or the checkpoint has no audio tower)."""
        extra = extra_inputs or {}
        towers = [t for t, key in ((VISION, "pixel_values"), (AUDIO, "input_features")) if key in extra]
        towers = [t for t in towers if getattr(self, t) is None]
        if not towers:
            return
        import importlib.util
        from importlib.metadata import version

        from gemma4_trace.traces.errors import install_hint

        what = {VISION: "an image prompt's vision tower", AUDIO: "an audio prompt's audio tower"}
        if importlib.util.find_spec("mlx_vlm") is None:  # refused before the model loads (registry.check_inputs)
            raise TraceToolError(
                f"--runtime {self.mode} runs {what[towers[0]]} with mlx_vlm, which is not installed: "
                f"{install_hint('mlx')}"
            )
        if AUDIO in towers and getattr(self.config, "audio_config", None) is None:
            raise TraceToolError(
                f"--runtime {self.mode}: REF has audio, and the model has no audio tower (no audio_config)"
            )
        for tower in towers:
            if (self.model_key, tower) not in _SAID:  # mlx-vlm reads the same fixed copy of config.json
                print(f"{self.mode}: {_SAY[tower]}", file=sys.stderr)
                _SAID.add((self.model_key, tower))
            kinds = (
                None if self.capture is None else sorted(k for k in self.capture if S.KIND_BY_NAME[k].tower == tower)
            )
            info = self.child.call(tower, kinds, phase=f"loading mlx-vlm's {tower} tower")[1]
            setattr(self, tower, f"{tower} tower: mlx-vlm {version('mlx-vlm')}, {'/'.join(info['dtypes'])}")
        self.name = f"{self.head}{''.join(f'; {v}' for v in (self.vision, self.audio) if v)}{self.fixed})"

    def _step(self, ids: list[int], position: int, probe, prefill: bool, media=None):
        def tensor(kind, layer, array):
            spec = S.KIND_BY_NAME[kind]
            if spec.tower == S.TEXT:
                self.report(probe, [((kind, layer), array)])
            elif probe is not None:
                report(probe, spec.name, torch.from_numpy(array), layer, tower=spec.tower)

        import torch

        args = (ids, position) if media is None else (ids, position, media)
        reply = self.child.call("step", *args, phase=self.phase(prefill), tensor=tensor)
        return torch.from_numpy(reply[1])

    def prefill(self, input_ids, extra_inputs, probe):
        ids = [int(t) for t in input_ids]
        extra = extra_inputs or {}
        if "pixel_values" not in extra and "input_features" not in extra:
            return self._step(ids, 0, probe, True)
        self.prepare(input_ids, extra_inputs)
        config = self.config
        text = config.get_text_config()
        media = {"pad_token_id": int(text.pad_token_id), "blocks": None}
        if "pixel_values" in extra:
            media["pixel_values"] = np.asarray(extra["pixel_values"], dtype=np.float32)
            media["image_position_ids"] = np.asarray(extra["image_position_ids"])
            media["image_token_id"] = int(config.image_token_id)
        if "input_features" in extra:  # HF's log-mel features (REF's), not mlx-vlm's own extractor's
            media["input_features"] = np.asarray(extra["input_features"], dtype=np.float32)
            media["input_features_mask"] = np.asarray(extra["input_features_mask"], dtype=bool)
            media["audio_token_id"] = int(config.audio_token_id)
        bidirectional = getattr(text, "use_bidirectional_attention", None)
        if bidirectional == "vision" and "mm_token_type_ids" in extra:
            from ..ops import image_blocks

            blocks = image_blocks(np.asarray(extra["mm_token_type_ids"]).reshape(-1))
            media["blocks"] = blocks if (blocks >= 0).any() else None  # an audio prompt alone: causal
        elif bidirectional not in (None, "vision"):
            raise TraceToolError(
                f"--runtime {self.mode}: use_bidirectional_attention={bidirectional!r} is not supported"
            )
        return self._step(ids, 0, probe, True, media)

    def decode(self, token_id, position, probe):
        return self._step([int(token_id)], int(position), probe, False)

    def close(self) -> None:
        super().close()
        shutil.rmtree(getattr(self, "folder", ""), ignore_errors=True)


def create(loaded, max_seq: int, choice):
    return MLXRuntime(loaded, max_seq, choice.name, choice.capture)
