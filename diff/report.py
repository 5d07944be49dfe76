"""The terminal report: the first divergence in one sentence, then tokens, growth, notes."""

from __future__ import annotations

import json
import math

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.rows import row_word

from .audio_where import AudioPlace
from .fmt import fmt, sci, sci_pair, seconds_text, val
from .metrics import METRIC, ROW_METRICS, Metric
from .result import (
    BaseAgainstRef,
    BaselineFigures,
    BaselineInfo,
    DiffResult,
    Divergence,
    Growth,
    Hint,
    IsolationRanking,
    LogitMetrics,
    MaskDetail,
    Outlier,
    Problem,
    RowDetail,
    TokenFlip,
    TokenInfo,
)

__all__ = [
    "divergence_sentence",
    "fmt",
    "hint_evidence",
    "format_text",
    "growth_summary",
    "sci",
    "sci_pair",
    "token_summary",
    "val",
]
SHOWN = 5  # layers of an isolation ranking in the text (all in the JSON and HTML)


def _layer_words(d: Divergence) -> str:
    li = d.layer_info
    extra = {"reuses": f", reuses layer {li.kv_source}", "stores": ", stores K/V for later layers"}.get(li.kv_role, "")
    return f"layer {d.layer} ({li.layer_type}{extra})"


def _element(names: dict[str, int]) -> str:
    if "head" in names:
        return f"head {names['head']} channel {names['channel']}"
    if "ple_layer" in names:
        return f"per-layer slot {names['ple_layer']} channel {names['channel']}"
    if "vocab_id" in names:
        return f"token id {names['vocab_id']}"
    if "channel" in names:
        return f"channel {names['channel']}"
    return ""


def _key_words(keys: list[int], n: int, position: int, n_positions: int) -> str:
    """'keys 4-19 (future), 300-303 (never-written slot) and 12 more': runs of consecutive keys
    of the same sort as ranges."""

    def tag(k):
        if k >= n_positions:
            return " (never-written slot)"
        if k > position:
            return " (future)"
        return ""

    runs: list[list[int]] = []  # [first, last]
    for k in sorted(keys):
        if runs and k == runs[-1][1] + 1 and tag(k) == tag(runs[-1][0]):
            runs[-1][1] = k
        else:
            runs.append([k, k])
    shown = ", ".join((f"{a}-{b}" if b > a else f"{a}") + tag(a) for a, b in runs)
    return shown + (f" and {n - len(keys)} more" if n > len(keys) else "")


def _mask_words(m: MaskDetail, position: int, n_positions: int) -> str:
    parts = []
    for keys, n, what in (
        (m.allowed_in_run_blocked_in_ref, m.n_allowed_in_run_blocked_in_ref, "allowed in RUN, blocked in REF"),
        (m.blocked_in_run_allowed_in_ref, m.n_blocked_in_run_allowed_in_ref, "blocked in RUN, allowed in REF"),
    ):
        if n:
            parts.append(f"key{'s' if len(keys) > 1 else ''} {_key_words(keys, n, position, n_positions)} {what}")
    images = "".join(
        f"; keys {b['first']}-{b['last']} = image {b['image']}"
        + (" (the query's own)" if b["first"] <= position <= b["last"] else "")
        for b in m.image_blocks or ()
    )
    return "; ".join(parts) + f" (REF allows {m.ref_allowed}; RUN allows {m.run_allowed}){images}"


def audio_words(place: AudioPlace, kind: str, layer: int | None) -> str:
    """'clip 1, audio layer 0, block lconv, frame 17 (0.68 s)'; a global kind: 'clip 1, audio tower,
    kind subsampled, frame 3 (0.12 s)'."""
    spec = S.KIND_BY_NAME[kind]
    where = f"audio layer {layer}, block {place.block}" if layer is not None else f"audio tower, kind {spec.name}"
    return f"clip {place.clip}, {where}, {row_word(spec)} {place.frame} ({seconds_text(place.time_s, place.ms)})"


def divergence_sentence(result: DiffResult, run: str = "RUN") -> str:
    """'first divergence: SITE: WHAT'; `run` names the candidate (BASE when a baseline is judged)."""
    d = result.first_divergence
    if d is None:
        return "no divergence"
    where = [f"{d.phase} step {d.step}"]
    if d.audio is not None:  # the audio tower's: its clip, layer, block and frame, with the frame's time
        where.append(audio_words(d.audio, d.kind, d.layer))
    elif d.row_words is not None:  # an encoder tower's: its layer, its kind, its row (patch, frame, soft token)
        tower, _, kind = d.kind.partition(".")
        where += [f"{tower} tower"] + ([f"layer {d.layer}"] if d.layer is not None else [])
        where += [f"kind {kind}", d.row_words]
    else:
        if d.layer is not None:
            where.append(_layer_words(d))
        where.append(f"kind {d.kind}")
        where.append(f"position {d.position}")
    head = "first divergence: " + ", ".join(where)
    det = d.detail
    if isinstance(det, MaskDetail):
        return f"{head}: " + _mask_words(det, d.position, result.steps.positions_compared)
    if isinstance(det, TokenFlip):
        return f"{head}: {run} chose token {det.candidate_token}, REF chose {det.reference_token} ({_tie_words(det)})"
    if isinstance(det, Problem):
        return f"{head}: {det.message}"
    elem = _element(det.first.names)
    m = METRIC[d.metric]
    if m.threshold and d.baseline is not None:
        cmp_ = baseline_words(m, d.value, d.baseline)
    elif m.threshold:
        v, t = sci_pair(d.value, d.threshold) if not m.plain else (val(d.value), val(d.threshold))
        if m.plain and v == t:
            v, t = repr(float(d.value)), repr(float(d.threshold))
        cmp_ = f"{m.label} {v} {'<' if m.fails_below else '>'} {t}"
    else:
        cmp_ = f"{int(d.value)} non-finite value(s) (NaN/Inf never pass)"
    return f"{head}{', ' + elem if elem else ''}: {cmp_} (REF {val(det.first.ref)} vs {run} {val(det.first.run)})"


def _tie_words(t: TokenFlip) -> str:
    if t.reference_margin is None:
        return t.label
    return (
        f"{t.label}: REF top-1/top-2 margin {t.reference_margin:.3g}, REF logit gap to RUN's token "
        f"{t.reference_gap:.3g}; RUN's token ranks {t.candidate_rank} under REF logits"
    )


BY_CONSTRUCTION = (
    "by construction: an isolated replay feeds the final norm REF's last layer output, so only the "
    "norm and the head are tested here"
)


def token_summary(tokens: TokenInfo, isolated: bool = False) -> str:
    n = tokens.compared_steps
    if not n:
        return "tokens: none compared"
    s = f"tokens: {tokens.matches}/{n} generated tokens match ({100 * tokens.accuracy:.1f}%)"
    if isolated:
        s += f" ({BY_CONSTRUCTION})"
    m, flip = tokens.first_mismatch_step, tokens.flip
    if m is not None:
        phase = "prefill" if m == 0 else "decode"
        s += (
            f"; first mismatch at {phase} step {m}: REF {flip.reference_token} vs RUN "
            f"{flip.candidate_token} ({_tie_words(flip)})"
        )
    for side, text in (("REF", tokens.reference_text), ("RUN", tokens.candidate_text)):
        if text is not None:
            s += f"\n  {side} text: {json.dumps(text)}"
    return s


def growth_summary(growth: Growth, max_layers: int = 48, isolated: bool = False) -> str:
    vals = growth.max_over_steps
    if not vals:
        return "error growth: no layer outputs compared"
    items = [f"L{l} {sci(v)}" for l, v in zip(growth.layers, vals)]
    if len(items) > max_layers:
        items = items[: max_layers // 2] + ["..."] + items[-max_layers // 2 :]
    s = "error growth (layer_out rel-L2, worst step): " + "  ".join(items)
    j = growth.largest_jump
    if j and j.ratio > 1 and not isolated:  # isolated: every layer was fed REF's input, no error is carried
        src = "from the embeddings " if j.layer == 0 else ""
        at = "" if j.step is None else f" at {'prefill' if j.step == 0 else 'decode'} step {j.step}"
        s += f"\n  largest jump: {src}into layer {j.layer}{at} ({_jump_words(j)})"
    return s


def _jump_words(j) -> str:
    """'1.2e-3 / 1e-4 = x11.6 (the input's 0, counted at its tolerance 1e-4)': the floor shown."""
    counted = j.after / j.ratio  # what the input's error counted as: itself, or its tolerance when larger
    ratio = (
        f"{sci(j.after)} / {sci(counted)} = x{j.ratio:.3g}"
        if j.ratio < 1e3
        else f"{sci(j.after)} / {sci(counted)} = x{sci(j.ratio)}"
    )
    if counted > j.before * (1 + 1e-6):
        return f"{ratio}; the input's {sci(j.before)} counted at its tolerance {sci(counted)}"
    return f"{ratio}; the input's {sci(j.before)}"


def origin_summary(d: Divergence) -> str | None:
    o = d.origin
    if not o:
        return None
    spec = S.KIND_BY_NAME[d.kind]
    tower = f"{spec.tower} " if spec.encoder else ""
    where = f"{tower}layer {d.layer}" if d.layer is not None else d.kind
    i = o.input
    if i is None:
        return f"  origin: {o.verdict} ({o.reason or ''})"
    inp = i.kind + (f" of layer {i.layer}" if i.layer is not None else "")
    s = (
        f"  origin: {o.verdict} in {where}: its input ({inp}) has rel-L2 {sci(i.rel_l2)} "
        f"(tolerance {sci(i.threshold)}), {d.kind} here {sci(i.here)}"
    )
    if i.output_rel_l2 is not None and spec.name != "layer_out":
        s += f", layer output {sci(i.output_rel_l2)}"
    if o.reason:
        s += f" - {o.reason}"
    return s


def baseline_words(metric: Metric, value: float, fig: BaselineFigures) -> str:
    """'rel-L2: RUN 6.1e-2 vs BASE 4.0e-3 against REF: 15x the baseline (limit 4x; ...)'."""
    num = fmt
    rvb, thr = (sci_pair if not metric.plain else lambda a, b: (val(a), val(b)))(
        fig.run_vs_base, fig.run_vs_base_threshold
    )
    ratio = "BASE is exact here" if math.isinf(fig.ratio) else f"{fig.ratio:.3g}x the baseline"
    op = "<" if metric.fails_below else ">"
    bound = 1.0 - fig.base_step_worst if metric.fails_below else fig.base_step_worst
    worst = ""  # check 3 applied: RUN and BASE are independent noisy runs here
    if bound > 0:
        worst = (
            f"BASE's {'least' if metric.fails_below else 'largest'} in this step {num(metric, fig.base_step_worst)}; "
        )
    return (
        f"{metric.label}: RUN {num(metric, value)} vs BASE {num(metric, fig.base_value)} against REF: {ratio} "
        f"(limit {fig.factor:g}x; {worst}RUN vs BASE {rvb} {op} {thr})"
    )


def ranking_text(r: IsolationRanking) -> str:
    items = [f"L{e.layer} {sci(e.rel_l2)} (step {e.step})" for e in r.ranking[:SHOWN]]
    more = f", {len(r.ranking) - SHOWN} more" if len(r.ranking) > SHOWN else ""
    return (
        "isolated replay (every layer fed REF's input; rel-L2 of each step's rows together, as in the error growth): "
        "layers by local error, layer_out rel-L2 at the worst step: " + ", ".join(items) + more
    )


def logits_text(m: LogitMetrics, isolated: bool = False) -> str:
    s = m.summary
    if not s.steps:
        return "logits: no step with finite logits in both traces"
    head = f"logits ({BY_CONSTRUCTION}) over" if isolated else "logits over"
    return (
        f"{head} {s.steps} step(s): KL(REF||RUN) mean {sci(s.kl_mean)}, p99 {sci(s.kl_p99)}, max {sci(s.kl_max)} "
        f"(step {s.kl_max_step}); top-1 agreement {100 * s.top1_agreement:.1f}%, top-5 overlap "
        f"{100 * s.top5_overlap:.1f}%; REF token's probability drop mean {sci(s.drop_mean)}, max "
        f"{sci(s.drop_max)} (step {s.drop_max_step})"
    )


def hint_evidence(h: Hint) -> str:
    """The hint's evidence with its numbers written as every report writes them."""
    styles = {"sci": sci, "val": val, "pct": lambda v: f"{100 * v:.1f}%"}
    return h.template.format(**{k: styles[style](v) for k, (v, style) in h.numbers.items()})


def format_text(result: DiffResult) -> str:
    lines = []
    d = result.first_divergence
    st = result.steps
    if d is None:
        lines.append(f"match: no divergence over {st.numbers_compared} step(s), {len(result.tensors)} tensors")
    else:
        lines.append(d.sentence or divergence_sentence(result))
        if isinstance(d.detail, RowDetail):
            w = d.detail.worst
            row = ", ".join(f"{m.label} {fmt(m, d.detail.metrics[m.name])}" for m in ROW_METRICS if m.threshold)
            lines.append(
                f"  worst element: {_element(w.names) or 'index ' + str(list(w.index))} (REF {val(w.ref)} vs RUN "
                f"{val(w.run)}); row: {row}"
            )
        o = origin_summary(d)
        if o:
            lines.append(o)
        if result.hint is not None:
            h = result.hint
            lines.append(f"  looks like: {h.name} ({h.evidence or hint_evidence(h)})")
    # a match under --baseline is relative to BASE: say where BASE itself stands (on a divergence the
    # sentence above already weighs RUN against BASE)
    standing = base_standing(result.baseline) if result.baseline is not None and d is None else None
    if standing:
        lines.append(standing)
    isolated = result.candidate.mode == "isolated"
    lines.append(token_summary(result.tokens, isolated))
    if result.logits is not None:
        lines.append(logits_text(result.logits, isolated))
    lines.append(growth_summary(result.growth, isolated=isolated))
    if result.isolation is not None:
        lines.append(ranking_text(result.isolation))
    ref, run = result.reference, result.candidate
    decode = max(0, st.numbers_compared - 1)
    lines.append(
        f"compared: prefill of {st.prompt_len} positions + {decode} decode step(s), {len(result.tensors)} tensors; "
        f"REF {ref.mode} {ref.dtype} ({ref.runtime}), RUN {run.mode} {run.dtype} ({run.runtime}); "
        f"tolerances: {result.tolerances.source}"
    )
    if result.baseline is not None:
        b = result.baseline
        lines.append(
            f"baseline: {b.trace.path} ({b.trace.mode} {b.trace.dtype}, {b.trace.runtime}): a row fails only "
            f"beyond the tolerance, beyond {b.factor:g}x BASE's error there, beyond BASE's largest in that step "
            f"(where RUN does not track BASE) and beyond the tolerance from BASE"
        )
    for n in result.notes:
        lines.append(f"note: {n}")
    if result.growth.outlier is not None:
        lines.append(f"note: {outlier_words(result.growth.outlier)}")
    return "\n".join(lines)


def outlier_words(o: Outlier) -> str:
    """A match's note on one layer whose own error stands out (diff/origin.py own_error_outlier)."""
    at = f"{'prefill' if o.step == 0 else 'decode'} step {o.step}"
    what = (
        f"its error over BASE's grows x{o.ratio:.3g} from its input's"
        if o.over_base
        else f"its layer_out rel-L2 {sci(o.after)} is x{o.ratio:.3g} its input's {sci(o.before)}"
    )
    return (
        f"layer {o.layer}'s own error stands out at {at}: {what}, where the other layers' typical step-up is "
        f"x{o.typical:.2g}. It is under the tolerance, but layers that compute the same thing add errors alike: "
        f"look at layer {o.layer} (trace replay --isolate gives each layer's own error)"
    )


def base_against_ref(against: DiffResult) -> BaseAgainstRef:
    """The baseline judged against REF alone (a `compare(REF, BASE)` result), in short."""
    first = against.first_divergence
    sentence = None if first is None else divergence_sentence(against, "BASE").removeprefix("first divergence: ")
    t = against.tokens
    return BaseAgainstRef(against.match, sentence, t.matches, t.compared_steps, list(t.candidate))


def base_standing(b: BaselineInfo) -> str | None:
    """'BASE against REF: ...': whether the envelope RUN is judged by is itself within the tolerances."""
    a = b.against_ref
    if a is None:
        return None
    tokens = f"{a.tokens_matched}/{a.tokens_compared} tokens agree"
    if a.match:
        return f"BASE against REF: no divergence, {tokens} (the envelope is within the tolerances)"
    return (
        f"BASE against REF: BASE itself diverges, first at {a.first_divergence}; {tokens}. RUN is judged by BASE's "
        "envelope: a match says RUN errs no more than BASE, not that either is within the tolerances"
    )
