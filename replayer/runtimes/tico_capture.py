"""What `--runtime tico` reads from TICO's modules (replayer/runtimes/tico.py runs them): the taps
its capture map (runtimes/captures.py: TICO) names, installed for the kinds the replay keeps, and
what they saw during one call reported to the probe as canonical kinds.

- forward hooks on its modules: embeddings, `per_layer_inputs`, `attn_out` as they are; each layer
  export module's (h, k, v) by the index of each kind;
- q and the mask: the values handed to TICO's fake-quant observers (`_fq` wrapped);
- RoPE rows from its mask/RoPE builders (its pre-negated sine undone);
- `final_hidden`: its own final norm applied to the last layer's output rows;
- the vision tower's sites: hooks on its vision step (made at an image prompt's first prefill),
  q and k the results of its 2D RoPE, reported as the real patches' rows (its static profile holds
  the processor's padding patches too), pooled and soft tokens as it strips them."""

from __future__ import annotations

import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.schema import rope_kinds, sites_of

from ..api import report
from .captures import ROPE
from .registry import captures
from .tico_spec import TICO

NEG_ALLOWED_ABOVE = -1.0  # TICO's additive masks: 0 allowed, its fill value (-120) not
# the observers of TICO's attention whose fake-quant input is a kind (the capture map's `via`): name -> kind
OBSERVED = {r.via: r.kind for r in TICO.rows if r.native.endswith("._fq")}
VISION_ROWS = tuple(r for r in TICO.rows if S.KIND_BY_NAME[r.kind].tower == "vision")


def _resolve(obj, path: str):
    """The attribute at a dotted path below obj (a number indexes a list); None where one is None."""
    for part in path.split("."):
        if obj is None:
            return None
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


class TicoCapture:
    """The taps on one TICO StaticGemma4Runtime `rt` (installed when made), for the kinds `capture`
    asks for (None: every kind; empty: none); `rec` holds what they saw during the current call."""

    def __init__(self, rt, capture: frozenset[str] | None, layer_types: set, max_seq: int):
        self.rt, self.capture, self.layer_types, self.max_seq = rt, capture, layer_types, max_seq
        self.rec: dict | None = None
        self.valid = None  # the real patches of the image prompt's vision step (its profile's rows)
        self._hook(rt)

    def wants(self, *kinds: str) -> bool:
        """Whether any of `kinds` is tapped."""
        return any(captures(self.capture, k) for k in kinds)

    def call(self, run, probe, rows: slice, decode_pos: int | None):
        """run() with the taps recording when there is a probe, then what they saw reported to it."""
        self.rec = {} if probe is not None else None
        try:
            out = run()
            if probe is not None:
                self._report(probe, rows, decode_pos)
        finally:
            self.rec = None
        return out

    # ------------------------------------------------------------ the taps
    def _hook(self, rt) -> None:
        """Install the taps of the kinds asked for, where TICO's capture map (runtimes/captures.py:
        TICO) names them; each only records a reference to a tensor."""
        wants = self.wants

        def put(kind, layer=None):
            def hook(module, args, out):
                if self.rec is not None:
                    self.rec[(kind, layer)] = out[0] if isinstance(out, tuple) else out

            return hook

        n, last = len(rt.prefill_layers), len(rt.prefill_layers) - 1
        for row in TICO.rows:  # the modules whose output is the kind: hooked as they are
            text = S.KIND_BY_NAME[row.kind].tower == S.TEXT
            if text and not row.via and "*" not in row.native and row.kind != "logits" and wants(row.kind):
                for site in sites_of(row.kind, n):
                    module = _resolve(rt, row.name(site.layer))
                    if module is not None:  # no per-layer input projection without PLE
                        module.register_forward_hook(put(row.kind, site.layer))
        outs = {r.kind: r.ops[0][1] for r in TICO.rows if r.native == TICO.row("layer_out").native}
        for i, (pre, dec) in enumerate(zip(rt.prefill_layers, rt.decode_layers)):
            if wants(*outs) or (i == last and wants("final_hidden")):
                for m in (pre, dec):
                    m.register_forward_hook(self._layer_hook(i, last, outs))
            if wants(*OBSERVED.values()):
                attn = _resolve(rt, TICO.row("q").name(i).rpartition(".")[0])  # shared by both export modules
                attn._fq = self._observer_tap(attn, i)
        if wants(*(k for t in self.layer_types for k in rope_kinds(t))):
            for name in (a for a in dir(rt) if TICO.row(ROPE[0]).matches(a)):  # the mask and RoPE builders
                setattr(rt, name, self._rope_tap(getattr(rt, name)))
        if wants(*(r.kind for r in VISION_ROWS)):
            rt._get_or_create_vision_prefill = self._vision_step_tap(rt._get_or_create_vision_prefill)

    def _vision_step_tap(self, make):
        """TICO's vision step, made at the first image prompt's prefill: its modules hooked once, and
        the step's real patches (image_position_ids not -1) kept for the report."""
        hooked = []

        def made(image_position_ids):
            step = make(image_position_ids)
            if not isinstance(step, torch.nn.Module):  # a text prompt's bypass (replayer/runtimes/tico.py)
                return step
            if step not in hooked:
                self._hook_vision(len(step.vision_model.wrapped_model.encoder.wrapped.layers))
                hooked.append(step)
            self.valid = (image_position_ids.reshape(-1, 2) != -1).all(dim=-1)
            return step

        return made

    def _hook_vision(self, n: int) -> None:
        """Hooks on the vision step's modules the capture map names; q and k: its 2D RoPE's results."""
        for row in VISION_ROWS:
            if not self.wants(row.kind):
                continue
            for site in sites_of(row.kind, n):
                target = _resolve(self.rt, row.name(site.layer))
                if row.native.endswith("._apply_multidimensional_rope"):
                    attn = _resolve(self.rt, row.name(site.layer).rpartition(".")[0])
                    if row.kind == "vision.q":  # one wrapper for both q and k
                        attn._apply_multidimensional_rope = self._rope2d_tap(attn, target, site.layer)
                else:
                    target.register_forward_hook(self._vision_hook(row.kind, site.layer))

    def _vision_hook(self, kind, layer):
        def hook(module, args, out):
            if self.rec is not None:
                self.rec[(kind, layer)] = getattr(out, "last_hidden_state", out)

        return hook

    def _rope2d_tap(self, attn, apply, layer):
        """Its 2D RoPE, seen: called with q's observers the result is q (B, S, heads, hd), with k's k."""

        def tapped(x, cos, sin, obs_x1, *rest):
            y = apply(x, cos, sin, obs_x1, *rest)
            if self.rec is not None:
                kind = {id(attn.obs_q_x1): "vision.q", id(attn.obs_k_x1): "vision.k"}.get(id(obs_x1))
                if kind is not None and self.wants(kind):
                    self.rec[(kind, layer)] = y
            return y

        return tapped

    def _layer_hook(self, i, last, outs: dict):
        """A layer export module's hook: what it returns, (h, k, v), by the index of each kind (`outs`)."""
        keep = {k for k in outs if self.wants(k)}
        if i == last and self.wants("final_hidden"):
            keep.add("layer_out")  # the last layer's output is also what final_hidden is computed from (_report)

        def hook(module, args, out):
            if self.rec is None:
                return
            got = out if isinstance(out, tuple) and len(out) == len(outs) else (out,)
            for kind in keep:
                if outs[kind] < len(got):
                    self.rec[(kind, i)] = got[outs[kind]]

        return hook

    def _observer_tap(self, attn, i):
        """TICO's fake-quant call, seen: the value handed to an observer the capture map names is that
        kind (q: (B, S, heads, hd) after q_norm and RoPE, with its fake quant; the mask: (B, 1, Q, K)
        additive, as applied)."""
        fq = attn._fq
        observers = {kind: getattr(attn, name) for name, kind in OBSERVED.items()}

        def tapped(x, obs):
            y = fq(x, obs)
            if self.rec is not None:
                kind = next((k for k, o in observers.items() if obs is o), None)
                if kind is not None and self.wants(kind):
                    self.rec[(kind, i)] = y
            return y

        return tapped

    def _rope_tap(self, build):
        def tapped(*args, **kwargs):
            masks, rope = build(*args, **kwargs)
            if self.rec is not None:
                for layer_type, (cos, sin) in rope.items():
                    if self.rt.rope_convention == "pre_negated_sin":  # back to HF's half-split sine
                        a, b = sin.chunk(2, dim=-1)
                        sin = torch.cat((-a, b), dim=-1)
                    self.rec[("rope", layer_type)] = (cos, sin)
            return masks, rope

        return tapped

    # ------------------------------------------------------------ reporting
    def _report(self, probe, rows: slice, decode_pos: int | None) -> None:
        rec, L = self.rec, len(self.rt.prefill_layers)
        if ("embeddings", None) in rec:
            probe.tensor("embeddings", rec[("embeddings", None)][0, rows])
        if ("per_layer_inputs", None) in rec:
            probe.tensor("per_layer_inputs", rec[("per_layer_inputs", None)][0, rows])
        for layer_type in sorted(self.layer_types):
            if ("rope", layer_type) in rec:
                cos, sin = rec[("rope", layer_type)]
                ck, sk = rope_kinds(layer_type)
                if self.wants(ck):
                    probe.tensor(ck, cos[0, rows])
                if self.wants(sk):
                    probe.tensor(sk, sin[0, rows])
        for i in range(L):
            if ("mask", i) in rec:
                probe.tensor("mask", self._mask(rec[("mask", i)][0, 0], rows, decode_pos), layer=i)
            if ("q", i) in rec:
                probe.tensor("q", rec[("q", i)][0, rows], layer=i)
            for kind in ("k", "v"):  # (B, kv, S, hd) -> rows written at this call
                if (kind, i) in rec and self.wants(kind):
                    probe.tensor(kind, rec[(kind, i)][0, :, rows].transpose(0, 1), layer=i)
            if ("attn_out", i) in rec:
                probe.tensor("attn_out", rec[("attn_out", i)][0, rows], layer=i)
            if self.wants("layer_out"):
                probe.tensor("layer_out", rec[("layer_out", i)][0, rows], layer=i)
        if self.wants("final_hidden"):
            norm = _resolve(self.rt, TICO.row("final_hidden").native)
            with torch.no_grad():
                probe.tensor("final_hidden", norm(rec[("layer_out", L - 1)][:, rows])[0])
        self._report_vision(probe)

    def _report_vision(self, probe) -> None:
        """The vision step's sites, in the tower's order: patch rows are the real patches (the
        profile's padding patches dropped); pooled and soft tokens are TICO's own (stripped)."""
        for key in (k.key for k in S.TOWER_BY_NAME["vision"].kinds):
            kind = key.partition(".")[2]
            for layer in sorted(layer for k, layer in self.rec if k == key and layer is not None) or [None]:
                x = self.rec.get((key, layer))
                if x is None:
                    continue
                if S.KIND_BY_NAME[key].index == S.ROW_PATCH:
                    x = x.reshape(-1, *x.shape[2:])[self.valid]  # (1, patches, ...) -> the real patches' rows
                else:
                    x = x.reshape(-1, x.shape[-1])
                report(probe, kind, x, layer=layer, tower="vision")

    def _mask(self, m: torch.Tensor, rows: slice, decode_pos: int | None) -> torch.Tensor:
        """TICO's additive mask -> allowed[query, key] over absolute key positions (max_seq wide).

        Prefill keys are slots 0..max_seq-1 = positions. At decode, slots 0..max_seq-2 are the cache
        (slot = position) and the last slot holds the step's own row (position past_len): it is
        moved there (OR-ed with that never-written cache slot, which should be masked)."""
        allowed = m[rows] > NEG_ALLOWED_ABOVE
        if decode_pos is None:
            return allowed
        out = allowed[:, : self.max_seq].clone()
        out[:, -1] = False
        out[:, decode_pos] |= allowed[:, -1]
        return out
