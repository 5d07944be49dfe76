"""`trace show`: the command's readable summary of one trace (numpy and h5py only)."""

from __future__ import annotations

import json

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import one_line
from gemma4_trace.traces.header import Provenance
from gemma4_trace.traces.limits import fmt_bytes
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.rows import rows_word

PROMPT_CHARS = 400  # the summary quotes this much of the prompt text


def summarize(r: TraceReader, decode=None) -> str:
    p = Provenance.from_dict(r.provenance)
    cfg = r.model_config
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    tokens = r.tokens()
    lines = [
        f"trace      {r.path} ({fmt_bytes(r.path.stat().st_size)}, schema v{r.f.attrs[S.ATTR_SCHEMA_VERSION]})",
        f"model      {p.model_name}  config sha256 {p.model_config_sha256[:12]}",
        f"producer   {p.runtime}, mode {p.mode}, {p.dtype} on {p.device}",
        f"versions   creator {p.creator_version}, torch {p.torch_version}, "
        f"transformers {p.transformers_version}, h5py {p.h5py_version}",
    ]
    prompt = f"prompt     {r.prompt_len} tokens"
    if r.prompt_text:
        text = r.prompt_text
        quoted = json.dumps(text[:PROMPT_CHARS]) + (
            f" ... ({len(text)} characters)" if len(text) > PROMPT_CHARS else ""
        )
        prompt += f" from {quoted}" + (" (chat template)" if r.chat_template_applied else "")
    lines.append(prompt)
    extra = r.extra_shapes()  # shapes only: nothing is read
    if extra:
        lines.append("inputs     " + ", ".join(f"{k} {shape}" for k, shape in extra.items()))
    lines.append(
        f"steps      {r.n_steps} (prefill + {r.n_steps - 1} decode), positions 0..{r.n_positions - 1}, "
        f"max_new_tokens {r.max_new_tokens}, eos {r.eos_token_ids}"
    )
    ended = "ended at EOS" if len(tokens) and int(tokens[-1]) in r.eos_token_ids else "no EOS"
    lines.append(f"generated  {len(tokens)} tokens ({ended}): {tokens.tolist()}")
    if decode is not None:
        bad = decode.unknown(tokens)
        lines.append(
            f"text       {json.dumps(decode(tokens))}"
            if bad is None
            else f"text       not decoded: token {bad[1]} of step {bad[0]} is not in the tokenizer's vocabulary "
            f"(ids 0..{decode.vocab_size - 1})"
        )
    window = text_cfg.get("sliding_window")
    lines.append(f"layers     {len(r.layers)} (hidden {text_cfg.get('hidden_size')}, sliding window {window})")
    for i, li in enumerate(r.layers):
        role = li.kv_role + (f" layer {li.kv_source}" if li.kv_role == "reuses" else "")
        lines.append(
            f"  L{i:02d}  {li.layer_type:<17} head_dim {li.head_dim:<4} heads {li.num_heads}/{li.num_kv_heads} kv  "
            f"{role}"
        )
    for name, t in r.towers.items():  # schema version 2: the encoder towers recorded
        tower = S.TOWER_BY_NAME[name]
        items, rows = tower.item, rows_word(tower.rows)
        lines.append(
            f"tower      {name}: {t.layers} layers (hidden {t.hidden}, {t.heads} heads of {t.head_dim}); "
            f"{len(t.item_rows)} {items}(s): {'+'.join(map(str, t.item_rows))} {rows}, "
            f"{'+'.join(map(str, t.item_tokens))} soft tokens into {tower.joins}"
        )
    lines += _kind_lines(r)
    # every value here comes from the file: one line each, no control characters for the terminal
    return "\n".join(one_line(line) for line in lines)


def _kind_lines(r: TraceReader) -> list[str]:
    """One line per kind stored (a layer kind's: its first layer's shape, its size over all its layers)."""
    lines = ["kinds      (stored shape, one layer's for a layer kind; source dtype; on-disk size)"]
    seen = set()
    for kind, layer in r.kinds_present():
        if kind in seen:
            continue
        seen.add(kind)
        layers = [l for k, l in r.kinds_present() if k == kind]
        ds = r.dataset(kind, layer)
        size = sum(r.storage_size(kind, l) for l in layers)
        where = "" if layer is None else f" in {len(layers)} layers ({fmt_bytes(size / len(layers))} each on average)"
        lines.append(f"  {kind:<17} {str(ds.shape):<16} {r.source_dtype(kind, layer):<9} {fmt_bytes(size):>10}{where}")
        partial = [(l, f) for l in layers if (f := r.rows_present(kind, l)) is not None]
        if partial:  # a runtime reported some rows only: say how many hold data
            l, f = partial[0]
            lines.append(
                f"    rows reported: {int(f.sum())} of {f.size}"
                + (f" (layer {l}; {len(partial)} layers partial)" if l is not None else "")
            )
    return lines
