"""The terminal report: the first divergence in one sentence, then tokens, growth, notes."""

from __future__ import annotations

import json
import math

from .metrics import METRIC_LABEL


def sci(v) -> str:
    """4.1e-2 style (no exponent padding); 0 and non-finite spelled plainly."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    m, e = f"{v:.1e}".split("e")
    return f"{m.removesuffix('.0')}e{int(e)}"


def val(v) -> str:
    if isinstance(v, str):
        return v
    v = float(v)
    if not math.isfinite(v):
        return sci(v)
    return f"{v:.4g}"


def _layer_words(d: dict) -> str:
    role = d.get("kv_role")
    extra = {"reuses": f", reuses layer {d.get('kv_source')}", "stores": ", stores K/V for later layers"}.get(role, "")
    return f"layer {d['layer']} ({d.get('layer_type', '?')}{extra})"


def _element(d: dict) -> str:
    if "head" in d:
        return f"head {d['head']} channel {d['channel']}"
    if "ple_layer" in d:
        return f"per-layer slot {d['ple_layer']} channel {d['channel']}"
    if "vocab_id" in d:
        return f"token id {d['vocab_id']}"
    if "channel" in d:
        return f"channel {d['channel']}"
    return ""


def _key_words(keys: list[int], n: int, position: int, n_positions: int) -> str:
    def tag(k):
        if k >= n_positions:
            return f"{k} (never-written slot)"
        if k > position:
            return f"{k} (future)"
        return str(k)

    shown = ", ".join(tag(k) for k in keys)
    return shown + (f" and {n - len(keys)} more" if n > len(keys) else "")


def divergence_sentence(result) -> str:
    d = result.first_divergence
    if d is None:
        return "no divergence"
    where = [f"{d['phase']} step {d['step']}"]
    if d["layer"] is not None:
        where.append(_layer_words(d))
    where.append(f"kind {d['kind']}")
    where.append(f"position {d['position']}")
    head = "first divergence: " + ", ".join(where)
    metric = d["metric"]
    if metric == "mask_keys":
        n_pos = result.steps.get("positions_compared", 10**9)
        parts = []
        if d["n_allowed_in_run_blocked_in_ref"]:
            ks = d["allowed_in_run_blocked_in_ref"]
            parts.append(f"key{'s' if len(ks) > 1 else ''} {_key_words(ks, d['n_allowed_in_run_blocked_in_ref'], d['position'], n_pos)} allowed in RUN, blocked in REF")
        if d["n_blocked_in_run_allowed_in_ref"]:
            ks = d["blocked_in_run_allowed_in_ref"]
            parts.append(f"key{'s' if len(ks) > 1 else ''} {_key_words(ks, d['n_blocked_in_run_allowed_in_ref'], d['position'], n_pos)} blocked in RUN, allowed in REF")
        return f"{head}: " + "; ".join(parts) + f" (REF allows {d['ref_allowed']}; RUN allows {d['run_allowed']})"
    if metric == "token":
        s = f"{head}: RUN chose token {d['candidate_token']}, REF chose {d['reference_token']}"
        return s + f" ({_tie_words(d)})"
    if metric in ("shape", "rows", "missing"):
        return f"{head}: {d['message']}"
    elem = _element(d)
    op = "<" if metric == "cosine" else ">"
    if metric == "nonfinite":
        cmp_ = f"{int(d['value'])} non-finite value(s) (NaN/Inf never pass)"
    else:
        cmp_ = f"{METRIC_LABEL[metric]} {sci(d['value'])} {op} {sci(d['threshold'])}"
    s = f"{head}{', ' + elem if elem else ''}: {cmp_} (REF {val(d['ref_value'])} vs RUN {val(d['run_value'])})"
    return s


def _tie_words(t: dict) -> str:
    label = t.get("label", "unknown")
    if "reference_margin" not in t:
        return label
    return (f"{label}: REF top-1/top-2 margin {t['reference_margin']:.3g}, REF logit gap to RUN's token "
            f"{t['reference_gap']:.3g}; RUN's token ranks {t['candidate_rank']} under REF logits")


def token_summary(tokens: dict) -> str:
    n = tokens.get("compared_steps", 0)
    if not n:
        return "tokens: none compared"
    s = (f"tokens: {tokens['matches']}/{n} generated tokens match ({100 * tokens['accuracy']:.1f}%)")
    m = tokens.get("first_mismatch_step")
    if m is not None:
        phase = "prefill" if m == 0 else "decode"
        s += (f"; first mismatch at {phase} step {m}: REF {tokens['reference_token']} vs RUN "
              f"{tokens['candidate_token']} ({_tie_words(tokens)})")
    for side, key in (("REF", "reference_text"), ("RUN", "candidate_text")):
        if key in tokens:
            s += f"\n  {side} text: {json.dumps(tokens[key])}"
    return s


def growth_summary(growth: dict, max_layers: int = 48) -> str:
    vals = growth.get("max_over_steps") or []
    if not vals:
        return "error growth: no layer outputs compared"
    items = [f"L{l} {sci(v)}" for l, v in zip(growth["layers"], vals)]
    if len(items) > max_layers:
        items = items[: max_layers // 2] + ["..."] + items[-max_layers // 2:]
    s = "error growth (layer_out rel-L2, worst step): " + "  ".join(items)
    j = growth.get("largest_jump")
    if j and j["ratio"] > 1:
        s += f"\n  largest jump: into layer {j['layer']} (x{j['ratio']:.3g}: {sci(j['before'])} -> {sci(j['after'])})"
    return s


def origin_summary(d: dict) -> str | None:
    o = d.get("origin")
    if not o:
        return None
    where = f"layer {d['layer']}" if d["layer"] is not None else d["kind"]
    if "input_rel_l2" not in o:
        return f"  origin: {o['verdict']} ({o.get('reason', '')})"
    inp = o["input_kind"] + (f" of layer {o['input_layer']}" if o["input_layer"] is not None else "")
    s = (f"  origin: {o['verdict']} in {where}: its input ({inp}) has rel-L2 {sci(o['input_rel_l2'])} "
         f"(tolerance {sci(o['input_threshold'])}), {d['kind']} here {sci(o['rel_l2_here'])}")
    if "output_rel_l2" in o and d["kind"] != "layer_out":
        s += f", layer output {sci(o['output_rel_l2'])}"
    if o.get("reason"):
        s += f" - {o['reason']}"
    return s


def format_text(result) -> str:
    lines = []
    d = result.first_divergence
    st = result.steps
    if d is None:
        lines.append(f"match: no divergence over {st['numbers_compared']} step(s), {len(result.tensors)} tensors")
    else:
        lines.append(d.get("sentence") or divergence_sentence(result))
        if d["metric"] in ("rel_l2", "max_abs", "cosine", "nonfinite"):
            w = d["worst"]
            m = d["metrics"]
            lines.append(f"  worst element: {_element(w) or 'index ' + str(w['index'])} (REF {val(w['ref'])} vs RUN "
                         f"{val(w['run'])}); row: rel-L2 {sci(m['rel_l2'])}, max-abs {sci(m['max_abs'])}, "
                         f"cosine {val(m['cosine'])}")
        o = origin_summary(d)
        if o:
            lines.append(o)
    lines.append(token_summary(result.tokens))
    lines.append(growth_summary(result.growth))
    ref, run = result.reference, result.candidate
    decode = max(0, st["numbers_compared"] - 1)
    lines.append(
        f"compared: prefill of {st['prompt_len']} positions + {decode} decode step(s), {len(result.tensors)} tensors; "
        f"REF {ref['mode']} {ref['dtype']} ({ref['runtime']}), RUN {run['mode']} {run['dtype']} ({run['runtime']}); "
        f"tolerances: {result.tolerances['source']}"
    )
    for n in result.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)
