"""Likely causes inside the audio tower (diff/hints.py's rules: decided from the numbers alone, a
signature that does not hold in full gives no hint). Each check takes hints.py's site of the first
divergence (its traces, tolerance and config) and reads whole tensors of the audio tower, bounded by
the tower's table (every clip's subsampled frames, at most MAX_ROWS), to see the error frame by frame:

- front end: audio.subsampled, the tower's first site, differs at nearly every frame of every clip
  (the log-mel front end or the subsampling convs);
- chunked attention: the first layer's attn_out differs exactly at a periodic set of frames, whole
  offsets of every attention_chunk_size-frame chunk (a chunk's first or last frame), or at nearly every
  frame including each clip's first, which sees only itself (the keys a frame sees changed);
- logit cap: attn_out differs at nearly every frame, not periodically, but matches at each clip's
  first frame: one key gets softmax weight 1 whatever its logit, so the scores changed, not the keys;
- light conv: lconv_out differs at nearly every frame while the layer's ff1_out and attn_out match;
- half step: ff1_out (or ff2_out) minus its input is REF's times a factor (1 / residual_weight:
  the macaron feed-forward's half step left out), the input matching.
"""

from __future__ import annotations

import math

import numpy as np

from .audio_where import AUDIO
from .metrics import ranges_text, rel_l2_of_sums
from .result import Hint

AUDIO_FRONT_END = "audio front end (log-mel or subsampling convs) differs"
AUDIO_CHUNK_CONTEXT = "audio chunked local attention: chunk boundary / left context"
AUDIO_LOGIT_CAP = "audio attention logit cap missing"
AUDIO_LCONV = "audio light conv: depthwise conv or its padding"
AUDIO_HALF_STEP = "audio macaron feed-forward half step (residual_weight)"
NAMES = (AUDIO_FRONT_END, AUDIO_CHUNK_CONTEXT, AUDIO_LOGIT_CAP, AUDIO_LCONV, AUDIO_HALF_STEP)
MOST = 0.9  # the share of frames that must differ where a signature says nearly every frame differs
ABOVE_FLOOR = 10.0  # "differs" for the logit cap: this many times the error of the frames that must match
MAX_ROWS = 1 << 16  # frames of the tower a check reads
MIN_CHUNKS = 2  # chunks past each clip's first that must show a periodic pattern


class _Frames:
    """Each row's clip and frame within it, from the tower's table."""

    def __init__(self, s):
        info = s.ref.towers[AUDIO]
        if info.rows > MAX_ROWS or info.rows < 2:
            raise ValueError("too many or too few frames")
        self.info = info
        self.clip = np.repeat(np.arange(len(info.item_rows)), info.item_rows)
        self.within = np.concatenate([np.arange(n) for n in info.item_rows])
        self.first = self.within == 0  # each clip's first frame


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return rel_l2_of_sums(np.sum((b - a) ** 2, axis=-1), np.sum(a**2, axis=-1), 0.0)


def _pair(s, kind: str, layer=None) -> tuple[np.ndarray, np.ndarray]:
    """Every row of an audio tensor in both traces, float64, one vector per row."""
    a, b = s.ref.read(kind, layer), s.run.read(kind, layer)
    if a.shape != b.shape:
        raise ValueError("shapes differ")
    return a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)


def _err(s, kind: str, layer=None) -> np.ndarray:
    return _rel(*_pair(s, kind, layer))


def _matches(s, kind: str, layer=None) -> bool:
    """Both traces hold the tensor and it is within the tolerance at every frame."""
    return s.both(kind, layer) and bool(np.all(_err(s, kind, layer) <= s.tol))


def _audio_cfg(s) -> dict:
    cfg = s.config.get("audio_config")
    return cfg if isinstance(cfg, dict) else {}


def _int(cfg: dict, key: str) -> int | None:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _where(s) -> str:
    return f"audio layer {s.d.layer}" if s.d.layer is not None else "the audio tower"


# ---------------------------------------------------------------- the front end
def front_end(s) -> Hint | None:
    fr = _Frames(s)
    err = _err(s, s.d.kind)
    share = float(np.mean(err > s.tol))
    clips = {int(c) for c in fr.clip[err > s.tol]}
    if share < MOST or len(clips) < len(fr.info.item_rows):
        return None
    fa, fb = s.ref.extra_input("input_features"), s.run.extra_input("input_features")
    numbers = {"share": (share, "pct"), "median": (float(np.median(err)), "sci")}
    if fa is None or fb is None:
        inputs = "; the traces do not both hold the log-mel input_features"
    elif fa.shape != fb.shape:
        inputs = f"; RUN's input_features have shape {tuple(fb.shape)}, REF's {tuple(fa.shape)}"
    else:
        numbers["feat"] = (float(_rel(*(x.reshape(1, -1).astype(np.float64) for x in (fa, fb)))[0]), "sci")
        inputs = (
            "; the traces' log-mel input_features are the same"
            if numbers["feat"][0] == 0
            else "; RUN's log-mel input_features differ from REF's (rel-L2 {feat})"
        )
    return Hint(
        AUDIO_FRONT_END,
        "audio.subsampled, the audio tower's first site, differs at {share} of the "
        f"{len(err)} frames, in every clip (median rel-L2 {{median}}){inputs}: the log-mel front end (filterbank, "
        "log floor, frame hop) or the subsampling convs and their projection differ",
        numbers,
    )


# ---------------------------------------------------------------- the chunked attention
def _offset_words(offsets: list[int], chunk: int) -> str:
    named = {0: "each chunk's first frame", chunk - 1: "each chunk's last frame"}
    if len(offsets) == 1 and offsets[0] in named:
        return named[offsets[0]]
    return f"offset{'s' if len(offsets) > 1 else ''} {ranges_text(np.asarray(offsets))} in each chunk"


def chunk_context(s) -> Hint | None:
    cfg = _audio_cfg(s)
    chunk, left, right = (_int(cfg, k) for k in ("attention_chunk_size", "attention_context_left",
                                                "attention_context_right"))  # fmt: skip
    if not chunk or left is None:
        return None
    fr = _Frames(s)
    err = _err(s, s.d.kind, s.d.layer)
    bad = err > s.tol
    config = f"attention_chunk_size {chunk}, attention_context_left {left}: a window of {max(left - 1, 0)} frames"
    # periodic: past each clip's first chunk, whole offsets of every chunk differ and the others match
    late = fr.within >= chunk
    offset = fr.within % chunk
    hit = sorted({int(o) for o in offset[late & bad]})
    chunks = {(int(c), int(w) // chunk) for c, w in zip(fr.clip[late & bad], fr.within[late & bad])}
    if hit and len(hit) < chunk and len(chunks) >= MIN_CHUNKS and np.array_equal(bad[late], np.isin(offset[late], hit)):
        first = bad[~late] == np.isin(offset[~late], hit)
        c0 = int(fr.clip[bad][0])
        frames = ranges_text(fr.within[bad & (fr.clip == c0)])
        shown = f"frames {frames} of clip {c0 + 1}" + (" and alike in the others" if len(fr.info.item_rows) > 1 else "")
        tail = "" if first.all() else " past each clip's first chunk"
        if len(hit) <= chunk // 2:
            return Hint(
                AUDIO_CHUNK_CONTEXT,
                f"{_where(s)}'s attn_out (its inputs matching) differs exactly at {_offset_words(hit, chunk)} "
                f"(period {chunk}: {shown}) and matches at every other frame"
                f"{tail}: the chunks' boundaries ({config})",
            )
        if hit == list(range(chunk - 1)):
            return Hint(
                AUDIO_CHUNK_CONTEXT,
                f"{_where(s)}'s attn_out differs at every frame whose left context reaches back past its chunk's "
                f"start and matches at {_offset_words([chunk - 1], chunk)}, whose context is its own chunk: the "
                f"left context before the chunk is dropped ({config})",
            )
        return None
    # every frame, each clip's first too: it sees itself alone in REF, so only the keys can move it
    if right == 0 or right is None:
        share = float(np.mean(bad))
        if share >= MOST and bad[fr.first].all():
            return Hint(
                AUDIO_CHUNK_CONTEXT,
                f"{_where(s)}'s attn_out (its inputs matching) differs at {{share}} of the {len(err)} frames, "
                f"also at the first frame of every clip (rel-L2 up to {{first}}), which in REF sees itself alone "
                f"(no right context): no change of the scores moves a one-key softmax, so the keys each frame "
                f"sees differ: the chunk's context or its left context ({config})",
                {"share": (share, "pct"), "first": (float(err[fr.first].max()), "sci")},
            )
    return None


def logit_cap(s) -> Hint | None:
    cfg = _audio_cfg(s)
    right = _int(cfg, "attention_context_right")
    if right not in (0, None):
        return None  # a clip's first frame sees future frames: no frame has one key
    fr = _Frames(s)
    err = _err(s, s.d.kind, s.d.layer)
    floor = float(err[fr.first].max())  # each clip's first frame: one key, softmax weight 1
    if floor > s.tol:
        return None
    rest = err[~fr.first]
    limit = max(ABOVE_FLOOR * floor, s.tol / 100)
    share = float(np.mean(rest > limit))
    if share < MOST or not np.any(rest > s.tol):
        return None
    cap = cfg.get("attention_logit_cap")
    cap_words = f" (attention_logit_cap {cap:g})" if isinstance(cap, (int, float)) and math.isfinite(cap) else ""
    return Hint(
        AUDIO_LOGIT_CAP,
        f"{_where(s)}'s attn_out (its inputs matching) differs at {{share}} of the frames after each clip's first "
        f"(rel-L2 up to {{worst}}, {int(np.sum(rest > s.tol))} over the tolerance), spread over the chunks, and "
        f"matches at the first frame of every clip (at most {{floor}}), which sees itself alone: a one-key softmax "
        f"gives weight 1 whatever the logit, so the scores differ, not the keys: the tanh logit soft cap"
        f"{cap_words} left out, or the scores' scale",
        {"share": (share, "pct"), "worst": (float(rest.max()), "sci"), "floor": (floor, "sci")},
    )


# ---------------------------------------------------------------- the light conv and the feed-forwards
def lconv(s) -> Hint | None:
    layer = s.d.layer
    if layer is None or not (_matches(s, "audio.attn_out", layer) and _matches(s, "audio.ff1_out", layer)):
        return None
    err = _err(s, s.d.kind, layer)
    share = float(np.mean(err > s.tol))
    if share < MOST:
        return None
    width = _int(_audio_cfg(s), "conv_kernel_size")
    return Hint(
        AUDIO_LCONV,
        f"audio layer {layer}'s lconv_out differs at {{share}} of the {len(err)} frames while its ff1_out and "
        "attn_out match at every frame: the light conv's depthwise conv or its padding (non-causal, reading "
        "future frames, or another width than" + (f" conv_kernel_size {width})" if width else " the config's)"),
        {"share": (share, "pct")},
    )


def half_step(s) -> Hint | None:
    layer, name = s.d.layer, s.d.kind.split(".", 1)[1]
    if layer is None:
        return None
    if name == "ff1_out":
        source = ("audio.subsampled", None) if layer == 0 else ("audio.layer_out", layer - 1)
    else:
        source = ("audio.lconv_out", layer)
    if not _matches(s, *source):
        return None
    xa, xb = _pair(s, *source)
    fa, fb = _pair(s, s.d.kind, layer)
    da, db = fa - xa, fb - xb  # the feed-forward's contribution
    k = float(np.sum(da * db) / np.sum(da * da))
    fit = _rel(fb, xb + k * da)
    if not (np.all(fit <= s.tol) and math.isfinite(k) and abs(k - 1) > 1e-3):
        return None
    w = _audio_cfg(s).get("residual_weight")
    ok = isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0
    which = "feed_forward1" if name == "ff1_out" else "feed_forward2"
    src = f"{source[0]}" + ("" if source[1] is None else f" of layer {source[1]}")
    why = (
        f": {which}'s output added at 1.0 instead of residual_weight {w:g} (the macaron half step left out)"
        if ok and abs(k * w - 1) < 1e-2
        else f": {which}'s residual_weight{f' ({w:g} in the config)' if ok else ''} applied otherwise"
    )
    return Hint(
        AUDIO_HALF_STEP,
        f"audio layer {layer}'s {name} minus its input ({src}, which matches) is REF's times {{k}} at every frame "
        f"(rel-L2 after the factor at most {{fit}}){why}",
        {"k": (k, "val"), "fit": (float(fit.max()), "sci")},
    )


CHECKS = {
    "audio.subsampled": (front_end,),
    "audio.attn_out": (chunk_context, logit_cap),
    "audio.lconv_out": (lconv,),
    "audio.ff1_out": (half_step,),
    "audio.ff2_out": (half_step,),
}
