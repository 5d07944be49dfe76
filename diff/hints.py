"""Likely causes: does the first divergence look like a known Gemma 4 porting bug?

Each signature is one known bug class (tests/support/bug_zoo.py, tests/support/quant_bugs.py, docs/bug-zoo.md)
decided from the numbers alone: the first divergence's kind, step, layer and position, the
layer's metadata (type, KV role and source), and a bounded look at the rows around it in both
traces (mask key sets, RoPE rows, per-row errors, zero rows, the logits against the
config's soft-cap). The runtime's name is never read. A signature that does not hold in full
gives no hint: no hint is better than a wrong one. Compute only: `likely_cause` returns a
`Hint` (name, evidence template, its numbers) or None; diff/report.py writes the numbers into
the evidence (`hint_evidence`) and the reports print it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader

from . import audio_hints, vision_hints
from .metrics import ranges_text, rel_l2_of_sums
from .result import DiffResult, Divergence, Hint

MAX_ROWS = 64  # rows past the first divergence a signature reads (masks, RoPE, logits, PLE)
SCORES_FACTOR = 10.0  # wrong scores: attn_out this many times its tolerance (FP16 scores' rounding: about 2x)
MAX_PREFILL_ROWS = 512  # prompt rows read to tell image from text positions (prompts with images only)
MAX_LOGIT_ROWS = 8  # steps of logits (a vocabulary each) the soft-cap signature reads
SHIFTS = range(-8, 9)  # RoPE position offsets tried

# the hints' names (tests/test_hints.py maps each zoo entry to one of them)
CAUSAL_MASK_MISSING = "causal mask missing in prefill"
MASK_BY_FILLED_SLOT = "decode mask by filled cache slot, not by position"
CURRENT_KEY_LEFT_OUT = "current key left out of decode attention"
WINDOW_OFF_BY_ONE = "sliding window off by one"
CAUSAL_MASK_ON_SLIDING = "causal (full-attention) mask on a sliding layer"
IDENTITY_ROPE = "RoPE not applied"
ROPE_OFFSET = "RoPE position offset"
UNWRITTEN_KV = "zeros read from a KV cache nobody wrote"
KV_SOURCE_WRONG = "KV-sharing source wrong"
SCORES_WRONG = "attention scores wrong"
NO_SOFTCAP = "final logit soft-cap missing"
PLE_MISSING = "per-layer inputs (PLE) missing"
PLE_RAW_IMAGE_IDS = "PLE looked up with the raw image token ids"
STALE_PLE = "stale per-layer inputs in decode"
IMAGE_BLOCK_CAUSAL = "image attended causally (no bidirectional attention within an image)"
IMAGE_BLOCK_PAST_WINDOW = "image keys let in past the sliding window"
VISION_SCALED = "vision soft tokens scaled like text embeddings"
VISION_SHIFTED = "vision soft tokens merged at shifted slots"
NAMES = (
    CAUSAL_MASK_MISSING,
    MASK_BY_FILLED_SLOT,
    CURRENT_KEY_LEFT_OUT,
    WINDOW_OFF_BY_ONE,
    CAUSAL_MASK_ON_SLIDING,
    IMAGE_BLOCK_CAUSAL,
    IMAGE_BLOCK_PAST_WINDOW,
    IDENTITY_ROPE,
    ROPE_OFFSET,
    UNWRITTEN_KV,
    KV_SOURCE_WRONG,
    SCORES_WRONG,
    NO_SOFTCAP,
    PLE_MISSING,
    PLE_RAW_IMAGE_IDS,
    STALE_PLE,
    VISION_SCALED,
    VISION_SHIFTED,
    *vision_hints.NAMES,  # inside the vision tower (diff/vision_hints.py)
    *audio_hints.NAMES,  # inside the audio tower (diff/audio_hints.py)
)


def likely_cause(result: DiffResult, ref_path, run_path) -> Hint | None:
    """The hint for the result's first divergence, or None when no signature holds in full.
    A trace that cannot be read here (past the rows the diff read) gives no hint, not an error."""
    d = result.first_divergence
    if d is None:
        return None
    checks = CHECKS.get("rope" if d.kind.startswith("rope_") else d.kind, ())
    if not checks:
        return None
    try:
        with TraceReader(ref_path) as ref, TraceReader(run_path) as run, np.errstate(all="ignore"):
            site = _Site(result, d, ref, run)
            for check in checks:
                hint = check(site)
                if hint is not None:
                    return hint
    except (_Unsure, TraceToolError, KeyError, ValueError, TypeError, IndexError):
        return None  # an odd trace or config: no hint rather than a wrong one, and never an error
    return None


class _Unsure(Exception):
    """A signature cannot be decided from what the traces hold."""


# ---------------------------------------------------------------- what the checks read
def _number(cfg: dict, key: str) -> float | None:
    v = cfg.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


class _Site:
    """The first divergence and bounded reads of both traces around it."""

    def __init__(self, result: DiffResult, d: Divergence, ref: TraceReader, run: TraceReader):
        self.result, self.d, self.ref, self.run = result, d, ref, run
        self.config = ref.model_config
        text = self.config.get("text_config", self.config)
        self.text = text if isinstance(text, dict) else {}
        self.tol = d.threshold if d.metric == "rel_l2" and d.threshold > 0 else 1e-4
        self.layer = ref.layers[d.layer] if d.layer is not None else None

    def both(self, kind: str, layer=None) -> bool:
        return self.ref.has(kind, layer) and self.run.has(kind, layer)

    def rows(self, kind: str, layer, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of both traces, cut to the rows both hold (float64, flattened per row
        for float kinds)."""
        n = max(start, min(stop, self.ref.dataset(kind, layer).shape[0], self.run.dataset(kind, layer).shape[0]))
        for r in (self.ref, self.run):
            present = r.rows_present(kind, layer)
            if present is not None and not present[start:n].all():
                raise _Unsure(f"{kind} rows not reported")  # their zeros are no evidence
        a = self.ref.read(kind, layer, slice(start, n))
        b = self.run.read(kind, layer, slice(start, n))
        if a.dtype == bool:
            return a, b
        return a.reshape(a.shape[0], -1).astype(np.float64), b.reshape(b.shape[0], -1).astype(np.float64)

    def image_positions(self) -> np.ndarray:
        token = self.config.get("image_token_id")
        ids = np.asarray(self.ref.prompt_ids)
        if not isinstance(token, int) or ids.ndim != 1:
            return np.zeros(0, dtype=int)
        return np.flatnonzero(ids == token)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """rel-L2 of each vector (the last axis) of b against the same vector of a (diff/metrics.py's rule)."""
    return rel_l2_of_sums(np.sum((b - a) ** 2, axis=-1), np.sum(a**2, axis=-1), 0.0)


def _keys(row: np.ndarray) -> set[int]:
    return {int(k) for k in np.flatnonzero(row)}


def _where(d: Divergence) -> str:
    return f"{d.phase} step {d.step}"


# ---------------------------------------------------------------- masks
def _mask_rows(s: _Site) -> list[tuple[int, set[int], set[int], int]]:
    """(query position, REF's allowed keys, RUN's allowed keys, RUN's row width) from the first
    divergence on, at most MAX_ROWS rows."""
    p = s.d.position
    a, b = s.rows("mask", s.d.layer, p, p + MAX_ROWS)
    return [(p + i, _keys(a[i]), _keys(b[i]), b.shape[1]) for i in range(a.shape[0])]


def _later_keys_visible(s: _Site) -> Hint | None:
    """RUN's query sees every key after its own position, up to the end of its cache; REF none."""
    rows = _mask_rows(s)
    if s.d.phase == "decode":
        checked = rows  # by slot: every decode row sees the whole written cache
    else:
        checked = rows[:1]
    if not rows or rows[0][0] + 1 >= rows[0][3]:
        return None
    for q, ra, rb, width in checked:  # a last slot has nothing after it: nothing to check there
        if not set(range(q + 1, width)) <= rb or any(k > q for k in ra):
            return None
    q, _, _, width = rows[0]
    where = f"layer {s.d.layer}, {_where(s.d)}"
    if s.d.phase == "prefill":
        return Hint(
            CAUSAL_MASK_MISSING,
            f"{where}: query {q} may attend to every key after it ({q + 1}-{width - 1}, up to the end of RUN's "
            f"{width}-slot mask), REF to none",
        )
    qs = ranges_text(np.array([r[0] for r in checked]))
    return Hint(
        MASK_BY_FILLED_SLOT,
        f"{where}: every decode query read ({qs}) may attend to every slot after it, up to the end of RUN's "
        f"{width}-slot cache (written but not yet reached), REF to none after the query",
    )


def _current_key_left_out(s: _Site) -> Hint | None:
    """Every decode query read blocks its own key and nothing else differs."""
    if s.d.phase != "decode":
        return None
    rows = _mask_rows(s)
    for q, ra, rb, _ in rows:
        if q not in ra or rb != ra - {q}:
            return None
    qs = ranges_text(np.array([r[0] for r in rows]))
    return Hint(
        CURRENT_KEY_LEFT_OUT,
        f"layer {s.d.layer}: at every decode query read ({qs}) RUN blocks the query's own key, which REF "
        f"allows, and nothing else differs: attention over past_len keys instead of past_len + 1",
    )


def _sliding_window(s: _Site) -> Hint | None:
    """A sliding layer whose RUN rows from the window on hold one extra key (q - W) each, or every
    key up to q (the causal mask); told apart only by a query past q = W."""
    W = _number(s.text, "sliding_window")
    if s.layer is None or s.layer.layer_type != "sliding_attention" or W is None or W < 1:
        return None
    W = int(W)
    rows = _mask_rows(s)
    off_by_one = causal = True
    for q, ra, rb, _ in rows:
        if not ra <= rb:
            return None
        extra = rb - ra
        if q < W:
            if extra:
                return None
            continue
        off_by_one &= extra == {q - W}
        causal &= rb == set(range(q + 1))
    beyond = [q for q, *_ in rows if q > W]  # where the two readings differ
    if not beyond:
        return None
    qs = ranges_text(np.array([q for q, *_ in rows if q >= W]))
    where = f"layer {s.d.layer} (sliding_attention, window {W})"
    if off_by_one:
        return Hint(
            WINDOW_OFF_BY_ONE,
            f"{where}, {_where(s.d)}: at every query q read from {W} on ({qs}) RUN allows W + 1 = {W + 1} keys "
            f"q-{W}..q, REF the last {W}; nothing else differs",
        )
    if causal:
        return Hint(
            CAUSAL_MASK_ON_SLIDING,
            f"{where}, {_where(s.d)}: at every query q read from {W} on ({qs}) RUN allows every key 0..q like a "
            f"full-attention layer, REF the last {W}",
        )
    return None


def _image_block(s: _Site) -> Hint | None:
    """A sliding layer's prefill rows inside one image's block of positions differ from REF's by that
    block's keys alone: its later keys blocked (attended causally, where REF attends within an image
    both ways), or its keys older than the window let in (the block ORed in after the window)."""
    W = _number(s.text, "sliding_window")
    if s.layer is None or s.layer.layer_type != "sliding_attention" or s.d.phase != "prefill" or not W:
        return None
    image, p, W = {int(i) for i in s.image_positions()}, s.d.position, int(W)
    if p not in image:
        return None
    lo, hi = p, p
    while lo - 1 in image:
        lo -= 1
    while hi + 1 in image:
        hi += 1
    rows = [r for r in _mask_rows(s) if r[0] <= hi]
    causal = all(rb == ra - set(range(q + 1, hi + 1)) for q, ra, rb, _ in rows)
    past = all(rb == ra | set(range(lo, max(lo, q - W + 1))) for q, ra, rb, _ in rows)
    qs = ranges_text(np.array([r[0] for r in rows]))
    where = f"layer {s.d.layer} (sliding_attention, window {W}), {_where(s.d)}: at every query of the image"
    where += f" at {lo}-{hi}"
    if causal:
        return Hint(
            IMAGE_BLOCK_CAUSAL,
            f"{where} read ({qs}) RUN blocks the image's later keys, which REF allows (an image attends to itself "
            "both ways where use_bidirectional_attention is vision); nothing else differs",
        )
    if past:
        return Hint(
            IMAGE_BLOCK_PAST_WINDOW,
            f"{where} read ({qs}) RUN also allows the image's keys at or before q - {W}, which REF's window "
            "blocks: the image's keys ORed in after the window, not within it; nothing else differs",
        )
    return None


# ---------------------------------------------------------------- RoPE tables
def _rope_identity(s: _Site) -> Hint | None:
    """RUN's cos table is 1 and its sin table 0 at every position read; REF rotates."""
    suffix = s.d.kind.split("_", 2)[2]
    cos, sin = f"rope_cos_{suffix}", f"rope_sin_{suffix}"
    if not (s.both(cos) and s.both(sin)):
        return None
    rc, bc = s.rows(cos, None, 0, MAX_ROWS)
    _, bs = s.rows(sin, None, 0, MAX_ROWS)
    if bc.size == 0 or not (np.all(bc == 1.0) and np.all(bs == 0.0)) or np.all(rc == 1.0):
        return None
    return Hint(
        IDENTITY_ROPE,
        f"RUN's {cos} is 1 and {sin} 0 at every position read (0-{bc.shape[0] - 1}): no rotation; REF's rotate "
        f"from position {int(np.flatnonzero(np.any(rc != 1.0, axis=1))[0])} on",
    )


def _rope_offset(s: _Site) -> Hint | None:
    """RUN's RoPE row at every position q read from the divergence on is REF's row at q + k, one k."""
    kind, p = s.d.kind, s.d.position
    n_ref = s.ref.dataset(kind).shape[0]
    a, b = s.rows(kind, None, p, p + MAX_ROWS)
    if b.shape[0] == 0:
        return None
    lo = max(0, p + min(SHIFTS))
    near = s.ref.read(kind, None, slice(lo, min(n_ref, p + MAX_ROWS + max(SHIFTS)))).astype(np.float64)
    near = near.reshape(near.shape[0], -1)  # REF's rows lo.. around the ones read
    for k in SHIFTS:
        if k == 0:
            continue
        qs = [p + i for i in range(b.shape[0]) if 0 <= p + i + k - lo < near.shape[0]]
        if len(qs) < 2:
            continue
        err = _rel(near[[q + k - lo for q in qs]], b[[q - p for q in qs]])
        if np.all(err <= s.tol):
            phase = f"{s.d.phase} position" if s.d.phase == "decode" else "position"
            ahead = f"{abs(k)} position{'s' if abs(k) > 1 else ''} {'ahead' if k > 0 else 'behind'}"
            return Hint(
                ROPE_OFFSET,
                f"RUN's {kind} at positions {ranges_text(np.array(qs))} equals REF's at "
                f"{ranges_text(np.array(qs) + k)} ({ahead}; worst rel-L2 {{worst}}); the rows before "
                f"{phase} {p} match",
                {"worst": (float(err.max()), "sci")},
            )
    return None


# ---------------------------------------------------------------- KV sharing
def _reused_kv(s: _Site) -> Hint | None:
    """attn_out is the first thing wrong at a KV-reusing layer whose q, mask and source K/V matched:
    RUN's row all zeros (a cache nobody wrote), or, in decode after a matching prefill, other rows."""
    li, d = s.layer, s.d
    if li is None or li.kv_role != "reuses":
        return None
    src = li.kv_source
    if not (s.both("q", d.layer) and s.both("mask", d.layer) and s.both("k", src) and s.both("v", src)):
        return None  # what the layer attends with and over was not all compared
    a, b = s.rows("attn_out", d.layer, d.position, d.position + 1)
    if a.shape[0] == 0:
        return None
    upto = f"positions 0-{d.position}" if d.position else "position 0"
    who = f"layer {d.layer} reuses layer {src}'s K/V; its q and mask and layer {src}'s k and v ({upto}) match"
    if np.all(b[0] == 0) and np.any(a[0] != 0):
        return Hint(
            UNWRITTEN_KV,
            f"{who}, yet its attn_out at position {d.position} ({_where(d)}) is all zeros in RUN (REF's is not): "
            f"attention over zero values, a cache nobody wrote, not layer {src}'s",
        )
    if d.phase == "decode":
        return Hint(
            KV_SOURCE_WRONG,
            f"{who}, and all of prefill matched, yet its attn_out at position {d.position} ({_where(d)}) has "
            f"rel-L2 {{rel}}: it attends over other K/V rows than layer {src}'s (a stale or "
            f"wrong cache)",
            {"rel": (float(_rel(a, b)[0]), "sci")},
        )
    return None


def _scores_wrong(s: _Site) -> Hint | None:
    """attn_out is the first thing wrong, in the prefill, at a layer whose q, mask and K/V were compared
    (and matched: they come first): right at every query that sees one key, wrong (SCORES_FACTOR times
    its tolerance at least) from the first that sees two. One key gets softmax weight 1 whatever its
    score, so only the scores (or their softmax) can be wrong: a K transpose lost where one KV head is
    broadcast to the query heads (litert-torch's convert), or a wrong scale."""
    d, li = s.d, s.layer
    if li is None or d.phase != "prefill" or d.position is None or not 0 < d.position < MAX_ROWS:
        return None
    src = li.kv_source
    if not (s.both("q", d.layer) and s.both("mask", d.layer) and s.both("k", src) and s.both("v", src)):
        return None  # what the layer attends with and over was not all compared
    masks, _ = s.rows("mask", d.layer, 0, d.position + 1)
    seen = [len(_keys(row)) for row in masks]  # keys REF lets each query see
    if len(seen) != d.position + 1 or seen[-1] < 2 or any(n != 1 for n in seen[:-1]):
        return None  # not the first query with two keys, after queries with one
    a, b = s.rows("attn_out", d.layer, 0, d.position + 1)
    if a.shape[0] != d.position + 1:
        return None
    rel = _rel(a, b)
    if (rel[:-1] > s.tol).any() or rel[-1] < SCORES_FACTOR * s.tol:
        return None  # a query with one key differs, or the error is rounding's size (FP16 scores)
    upto = "position 0" if d.position == 1 else f"positions 0-{d.position - 1}"
    gqa = (
        f"; this layer broadcasts {li.num_kv_heads} KV head(s) to {li.num_heads} query heads, where a lost K "
        "transpose has been seen (litert-torch's convert, docs/upstream/litert-torch-gqa-transpose.md)"
        if li.num_kv_heads < li.num_heads
        else ""
    )
    return Hint(
        SCORES_WRONG,
        f"layer {d.layer}'s q, mask and K/V match; its attn_out is right at {upto} (one key visible: softmax "
        f"gives it weight 1 whatever its score) and wrong from position {d.position}, the first query that sees "
        f"two keys (rel-L2 {{rel}}): the scores q.K or their scale are computed wrong{gqa}",
        {"rel": (float(rel[-1]), "sci")},
    )


# ---------------------------------------------------------------- logits
def _softcap(s: _Site) -> Hint | None:
    """c * tanh(RUN / c) is REF's logits (c: the config's final_logit_softcapping) at every step read."""
    cap = _number(s.text, "final_logit_softcapping")
    if cap is None or cap <= 0 or not s.both("logits"):
        return None
    a, b = s.rows("logits", None, s.d.step, s.d.step + MAX_LOGIT_ROWS)
    if a.shape[0] == 0:
        return None
    before = _rel(a, b)
    after = _rel(a, cap * np.tanh(b / cap))
    if not (np.all(after <= s.tol) and before[0] > s.tol):
        return None
    steps = f"{s.d.step}-{s.d.step + a.shape[0] - 1}" if a.shape[0] > 1 else f"{s.d.step}"
    return Hint(
        NO_SOFTCAP,
        f"{{cap}} * tanh(RUN / {{cap}}) is REF's logits at steps {steps} (rel-L2 at most {{after}}; "
        f"RUN as it is: {{before}}), {{cap}} being the config's final_logit_softcapping; everything "
        f"before them matches",
        {"cap": (cap, "val"), "after": (float(after.max()), "sci"), "before": (float(before[0]), "sci")},
    )


# ---------------------------------------------------------------- per-layer inputs
def _ple_missing(s: _Site) -> Hint | None:
    """RUN stores no per_layer_inputs, and layer 0's output (where they join) is the first thing wrong
    while its attention output matches."""
    d = s.d
    ple = _number(s.text, "hidden_size_per_layer_input")
    if d.layer != 0 or d.step != 0 or not ple or not s.both("attn_out", 0):
        return None
    if not any(k.kind == "per_layer_inputs" and k.reason == "only in REF" for k in s.result.skipped):
        return None
    return Hint(
        PLE_MISSING,
        f"REF stores per_layer_inputs (hidden_size_per_layer_input {int(ple)}), RUN none; layer 0's attn_out "
        f"matches and its layer_out, where the per-layer input joins the residual, is the first thing wrong",
    )


def _differing(s: _Site, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Prompt rows of a kind in both traces, and the positions where they differ beyond the tolerance."""
    T = min(s.ref.prompt_len, MAX_PREFILL_ROWS)
    a, b = s.rows(kind, None, 0, T)
    return a, b, np.flatnonzero(_rel(a, b) > s.tol), np.arange(a.shape[0])


def _ple_image_ids(s: _Site) -> Hint | None:
    """per_layer_inputs differ exactly at the image-token positions of the prompt."""
    image = s.image_positions()
    if s.d.step != 0 or image.size == 0:
        return None
    _, _, bad, read = _differing(s, "per_layer_inputs")
    image = image[image < read.size]
    if image.size == 0 or not np.array_equal(bad, image):
        return None
    return Hint(
        PLE_RAW_IMAGE_IDS,
        f"per_layer_inputs differ at exactly the {image.size} image-token positions ({ranges_text(image)}) and "
        f"match at the {read.size - image.size} text positions of the prompt",
    )


def _stale_ple(s: _Site) -> Hint | None:
    """RUN's per_layer_inputs at the divergent decode position are bit-identical to its row at an
    earlier decode position, where REF's two rows differ."""
    d, T = s.d, s.ref.prompt_len
    if d.step < 2 or d.position - T >= MAX_ROWS:
        return None
    a, b = s.rows("per_layer_inputs", None, T, d.position + 1)
    if a.shape[0] != d.position + 1 - T:
        return None
    last = a.shape[0] - 1
    for i in range(last):
        if np.array_equal(b[i], b[last]) and _rel(a[i][None], a[last][None])[0] > s.tol:
            return Hint(
                STALE_PLE,
                f"RUN's per_layer_inputs at position {d.position} ({_where(d)}) are bit-identical to its row at "
                f"position {T + i} (decode step {i + 1}), while REF's two rows differ (rel-L2 "
                f"{{rel}}): computed once, not per step",
                {"rel": (float(_rel(a[i][None], a[last][None])[0]), "sci")},
            )
    return None


# ---------------------------------------------------------------- vision soft tokens
def _vision(s: _Site) -> Hint | None:
    """embeddings differ only at (or next to) image-token positions: RUN's rows are REF's times the
    text embedding scale sqrt(hidden_size), or REF's rows one or more slots away."""
    image = s.image_positions()
    if s.d.step != 0 or image.size == 0:
        return None
    a, b, bad, read = _differing(s, "embeddings")
    image = image[image < read.size]
    if image.size == 0 or bad.size == 0:
        return None
    hidden = _number(s.text, "hidden_size")
    if np.array_equal(bad, image) and hidden:
        ra, rb = a[image], b[image]
        k = float(np.sum(ra * rb) / np.sum(ra * ra))
        fit = _rel(k * ra, rb)
        scale = math.sqrt(hidden)
        if np.all(fit <= s.tol) and abs(k / scale - 1) < 1e-2:
            return Hint(
                VISION_SCALED,
                f"RUN's embeddings at the {image.size} image-token positions ({ranges_text(image)}) are REF's times "
                f"{{k}} (sqrt(hidden_size {int(hidden)}) = {{scale}}, the text embedding scale; rel-L2 after "
                f"dividing it out at most {{fit}}); text positions match",
                {"k": (k, "val"), "scale": (scale, "val"), "fit": (float(fit.max()), "sci")},
            )
        return None
    image_set = {int(x) for x in image}
    for shift in (1, -1, 2, -2):
        moved = [int(p) for p in bad if int(p) - shift in image_set]
        rest = np.array(sorted(set(bad.tolist()) - set(moved)), dtype=int)
        if len(moved) < 2 or rest.size > abs(shift) or not set(rest.tolist()) <= image_set:
            continue  # at most the slots the block left behind may differ otherwise
        err = _rel(a[[p - shift for p in moved]], b[moved])
        if np.all(err <= s.tol):
            m = np.array(moved)
            where = "later" if shift > 0 else "earlier"
            return Hint(
                VISION_SHIFTED,
                f"RUN's embeddings at positions {ranges_text(m)} are REF's image-token rows at "
                f"{ranges_text(m - shift)}: the image block merged {abs(shift)} slot{'s' if abs(shift) > 1 else ''} "
                f"{where}"
                + (f"; {ranges_text(rest)} (left behind) differ as well" if rest.size else "")
                + "; the other text positions match",
            )
    return None


CHECKS: dict[str, tuple[Callable[[_Site], Hint | None], ...]] = {
    "mask": (_later_keys_visible, _current_key_left_out, _image_block, _sliding_window),
    "rope": (_rope_identity, _rope_offset),
    "attn_out": (_reused_kv, _scores_wrong),
    "logits": (_softcap,),
    "layer_out": (_ple_missing,),
    "per_layer_inputs": (_ple_image_ids, _stale_ple),
    "embeddings": (_vision,),
    **vision_hints.CHECKS,
    **audio_hints.CHECKS,
}
