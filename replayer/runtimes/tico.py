"""`--runtime tico` / `tico-quant`: TICO's StaticGemma4Runtime driven through our runtime API.

TICO (the `tico` package, extra `gemma4-trace[tico]`, pinned release below) ships a
static-shape Gemma 4 runtime built from its PTQ wrappers: per-layer prefill/decode export
modules, additive masks, (1, kv, max_seq - 1, hd) caches with the decode step's own row
appended as the last key slot. This adapter runs TICO's own `prefill` / `decode_one` and
reports what it computes, read from the outside:

- forward hooks on its modules: embeddings (`mm_fusion` at prefill, `token_embedding` at
  decode), `per_layer_inputs` (`ple_projection`), `attn_out` (`o_proj`), `layer_out`, `k`, `v`
  (each layer's export module returns its new K/V);
- q after q_norm + RoPE has no module boundary: it is the value TICO hands to its `q_rot`
  fake-quant observer, so the attention wrapper's `_fq` is wrapped to see it; the mask is the
  value handed to `attn_mask` (the additive mask actually applied);
- RoPE rows from its mask/RoPE builders (its sine is pre-negated for the NPU: undone here);
- `final_hidden`: its LM head runs on the last prompt row only, so its own final norm is
  applied to the last layer's output rows.

Only the taps of the kinds the replay keeps are installed (`--kinds`, RuntimeChoice.capture);
with none asked, none is, and TICO's modules run as they are (logits only).

It needs nothing of TICO's E2B-only settings: a vision profile is derived from the inputs
and registered (image-token span, patch grid from `image_position_ids`, soft-token capacity
from `pixel_values`); a text-only prompt bypasses TICO's vision step and fusion.
`tico-quant` runs the same modules in TICO's fake-quant mode (its Gemma 4 PTQ config:
int16 activations and weights): its observers are calibrated on one prefill of the replayed
prompt, then frozen, and the replay runs quantized.
"""

from __future__ import annotations

import torch

from gemma4_trace.traces.errors import TraceToolError, install_hint
from gemma4_trace.traces.schema import rope_kinds, sites_of

from ..api import Runtime
from .captures import ROPE, TICO
from .registry import captures

TICO_VERSION = "0.3.0"  # the release tested; the extra [tico] pins it
NEG_ALLOWED_ABOVE = -1.0  # TICO's additive masks: 0 allowed, its fill value (-120) not
# the observers of TICO's attention whose fake-quant input is a kind (the capture map's `via`): name -> kind
OBSERVED = {r.via: r.kind for r in TICO.rows if r.native.endswith("._fq")}


def _import_tico():
    try:
        import tico  # noqa: F401  (its absence is the message below)
        from tico.quantization.recipes.debug import static_gemma4_runtime as rtmod
        from tico.quantization.wrapq.wrappers.gemma4 import static_vision_profile as vp
        from tico.quantization.wrapq.wrappers.gemma4.utils import StaticGemma4Layout
    except ImportError as e:
        raise TraceToolError(f"--runtime tico needs TICO {TICO_VERSION}: {install_hint('tico')} ({e})") from None
    from importlib.metadata import version as dist_version

    version = dist_version("tico")
    return rtmod, vp, StaticGemma4Layout, version


def _resolve(obj, path: str):
    """The attribute at a dotted path below obj (a number indexes a list); None where one is None."""
    for part in path.split("."):
        if obj is None:
            return None
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


class _TextOnlyFusion(torch.nn.Module):
    """Stands in for TICO's image fusion on a prompt without an image: the text rows as they are."""

    def forward(self, text_embeds, image_embeds):
        return text_embeds


class TicoRuntime(Runtime):
    """One replay's TICO runtime (the driver makes one per replay); built at the first prefill,
    when the inputs say which vision profile it needs."""

    def __init__(self, loaded, max_seq: int, quantized: bool = False, capture: frozenset[str] | None = None):
        self.rtmod, self.vp, self.Layout, version = _import_tico()
        if not loaded.multimodal:
            raise TraceToolError(
                "TICO's static Gemma 4 runtime needs a multimodal (image-text) checkpoint; "
                "this one has no vision_config"
            )
        if getattr(loaded.text_config, "enable_moe_block", False):
            raise TraceToolError("TICO's static Gemma 4 runtime does not support MoE configs (enable_moe_block)")
        self.loaded, self.max_seq, self.quantized = loaded, max_seq, quantized
        self.capture = capture  # the kinds tapped (None: every kind; empty: none)
        self.name = f"tico-quant {version}" if quantized else f"tico {version}"
        self.rt = None
        self._rec: dict | None = None  # what the hooks saw during the current call
        self.T = 0

    # ------------------------------------------------------------ building
    def _profile(self, input_ids: torch.Tensor, extra: dict):
        """A vision profile for these inputs, registered under a name derived from its geometry."""
        cfg = self.loaded.config
        vcfg = cfg.vision_config
        k = int(vcfg.pooling_kernel_size)
        image_id = int(cfg.image_token_id)
        slots = torch.nonzero(input_ids == image_id).reshape(-1)
        tok = getattr(self.loaded.tokenizer, "add_bos_token", False)
        if len(slots) == 0:  # text only: a minimal valid profile; the vision step is bypassed
            soft = int(extra["pixel_values"].shape[1]) // (k * k) if "pixel_values" in extra else None
            soft = soft or int(
                getattr(self.loaded.processor, "image_seq_length", 0) or getattr(vcfg, "default_output_length", 0) or 1
            )
            fields = dict(
                visual_start_idx=0, num_visual_tokens=1, max_soft_tokens=soft, patch_grid_height=k, patch_grid_width=k
            )
        else:
            start, n = int(slots[0]), len(slots)
            if not torch.equal(slots, torch.arange(start, start + n)):
                raise TraceToolError(
                    "TICO's runtime supports exactly one contiguous image span; "
                    f"this prompt's image tokens are at {slots.tolist()[:8]}..."
                )
            if "image_position_ids" not in extra or "pixel_values" not in extra:
                raise TraceToolError("REF has image tokens but no pixel_values / image_position_ids inputs")
            pos = extra["image_position_ids"].reshape(-1, 2)
            valid = pos[pos[:, 0] >= 0]
            fields = dict(
                visual_start_idx=start,
                num_visual_tokens=n,
                max_soft_tokens=int(extra["pixel_values"].shape[1]) // (k * k),
                patch_grid_height=int(valid[:, 1].max()) + 1,
                patch_grid_width=int(valid[:, 0].max()) + 1,
            )
        name = (
            "gemma4-trace-{visual_start_idx}-{num_visual_tokens}-{max_soft_tokens}-"
            "{patch_grid_height}x{patch_grid_width}".format(**fields)
        )
        profile = self.vp.Gemma4StaticVisionProfile(
            name=name,
            patch_size=int(vcfg.patch_size),
            pooling_kernel_size=k,
            tokenizer_add_bos_token=bool(tok),
            **fields,
        )
        # TICO looks profiles up by name when it builds its PTQ config: register ours
        self.vp._PROFILE_REGISTRY.setdefault(name, profile)
        return profile, bool(len(slots))

    def _build(self, input_ids, extra):
        profile, has_image = self._profile(input_ids, extra)
        layout = self.Layout(
            max_seq=self.max_seq, visual_start_idx=profile.visual_start_idx, num_visual_tokens=profile.num_visual_tokens
        )
        tc = self.loaded.text_config
        if hasattr(type(tc), "allow_global_per_layer_attribute_access"):
            # TICO reads config-wide num_key_value_heads / head_dim and derives the per-type values
            # itself; transformers 5.24 refuses such reads on per-layer (heterogeneous) configs
            tc.allow_global_per_layer_attribute_access = True
        try:
            rt = self.rtmod.StaticGemma4Runtime(
                self.loaded.model, self.loaded.processor, layout=layout, vision_profile=profile, device="cpu"
            )
        except (ValueError, RuntimeError, AssertionError) as e:
            raise TraceToolError(
                f"TICO's runtime refused this model or prompt: {str(e).splitlines()[0][:200]}"
            ) from None
        rt._allocate_empty_cache = self._allocate_cache
        if not has_image:  # TICO's prefill always runs its vision step: bypass it and the fusion
            rt._get_or_create_vision_prefill = lambda image_position_ids: lambda pixel_values: None
            rt.mm_fusion = _TextOnlyFusion()
        self.rt = rt
        self._hook(rt)
        return has_image

    def _allocate_cache(self, batch_size: int, dtype: torch.dtype) -> list:
        """TICO's cache allocation, sized per layer from the per-layer config.

        TICO 0.3.0 sizes caches from config-wide values; with attention_k_eq_v (full layers with
        their own KV head count) it allocates the sliding layers' head count for full layers too,
        and its prefill write then broadcasts one KV head into two (decode fails)."""
        from gemma4_trace.traces.layers import layer_infos_from_config

        return [
            self.rtmod.LayerCache(
                past_k=torch.zeros(batch_size, li.num_kv_heads, self.max_seq - 1, li.head_dim, dtype=dtype),
                past_v=torch.zeros(batch_size, li.num_kv_heads, self.max_seq - 1, li.head_dim, dtype=dtype),
            )
            for li in layer_infos_from_config(self.loaded.text_config)
        ]

    def _wants(self, *kinds: str) -> bool:
        """Whether any of `kinds` is tapped."""
        return any(captures(self.capture, k) for k in kinds)

    def _hook(self, rt) -> None:
        """Install the taps of the kinds asked for, where TICO's capture map (runtimes/captures.py:
        TICO) names them; each only records a reference to a tensor."""
        wants = self._wants

        def put(kind, layer=None):
            def hook(module, args, out):
                if self._rec is not None:
                    self._rec[(kind, layer)] = out[0] if isinstance(out, tuple) else out

            return hook

        n, last = len(rt.prefill_layers), len(rt.prefill_layers) - 1
        for row in TICO.rows:  # the modules whose output is the kind: hooked as they are
            if not row.via and "*" not in row.native and row.kind != "logits" and wants(row.kind):
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
        if wants(*(k for t in self._layer_types() for k in rope_kinds(t))):
            for name in (a for a in dir(rt) if TICO.row(ROPE[0]).matches(a)):  # the mask and RoPE builders
                setattr(rt, name, self._rope_tap(getattr(rt, name)))

    def _layer_hook(self, i, last, outs: dict):
        """A layer export module's hook: what it returns, (h, k, v), by the index of each kind (`outs`)."""
        keep = {k for k in outs if self._wants(k)}
        if i == last and self._wants("final_hidden"):
            keep.add("layer_out")  # the last layer's output is also what final_hidden is computed from (_report)

        def hook(module, args, out):
            if self._rec is None:
                return
            got = out if isinstance(out, tuple) and len(out) == len(outs) else (out,)
            for kind in keep:
                if outs[kind] < len(got):
                    self._rec[(kind, i)] = got[outs[kind]]

        return hook

    def _observer_tap(self, attn, i):
        """TICO's fake-quant call, seen: the value handed to an observer the capture map names is that
        kind (q: (B, S, heads, hd) after q_norm and RoPE, with its fake quant; the mask: (B, 1, Q, K)
        additive, as applied)."""
        fq = attn._fq
        observers = {kind: getattr(attn, name) for name, kind in OBSERVED.items()}

        def tapped(x, obs):
            y = fq(x, obs)
            if self._rec is not None:
                kind = next((k for k, o in observers.items() if obs is o), None)
                if kind is not None and self._wants(kind):
                    self._rec[(kind, i)] = y
            return y

        return tapped

    def _rope_tap(self, build):
        def tapped(*args, **kwargs):
            masks, rope = build(*args, **kwargs)
            if self._rec is not None:
                for layer_type, (cos, sin) in rope.items():
                    if self.rt.rope_convention == "pre_negated_sin":  # back to HF's half-split sine
                        a, b = sin.chunk(2, dim=-1)
                        sin = torch.cat((-a, b), dim=-1)
                    self._rec[("rope", layer_type)] = (cos, sin)
            return masks, rope

        return tapped

    # ------------------------------------------------------------ reporting
    def _report(self, probe, rows: slice, decode_pos: int | None) -> None:
        rec, L = self._rec, len(self.rt.prefill_layers)
        if ("embeddings", None) in rec:
            probe.tensor("embeddings", rec[("embeddings", None)][0, rows])
        if ("per_layer_inputs", None) in rec:
            probe.tensor("per_layer_inputs", rec[("per_layer_inputs", None)][0, rows])
        for layer_type in sorted(self._layer_types()):
            if ("rope", layer_type) in rec:
                cos, sin = rec[("rope", layer_type)]
                ck, sk = rope_kinds(layer_type)
                if self._wants(ck):
                    probe.tensor(ck, cos[0, rows])
                if self._wants(sk):
                    probe.tensor(sk, sin[0, rows])
        for i in range(L):
            if ("mask", i) in rec:
                probe.tensor("mask", self._mask(rec[("mask", i)][0, 0], rows, decode_pos), layer=i)
            if ("q", i) in rec:
                probe.tensor("q", rec[("q", i)][0, rows], layer=i)
            for kind in ("k", "v"):  # (B, kv, S, hd) -> rows written at this call
                if (kind, i) in rec and self._wants(kind):
                    probe.tensor(kind, rec[(kind, i)][0, :, rows].transpose(0, 1), layer=i)
            if ("attn_out", i) in rec:
                probe.tensor("attn_out", rec[("attn_out", i)][0, rows], layer=i)
            if self._wants("layer_out"):
                probe.tensor("layer_out", rec[("layer_out", i)][0, rows], layer=i)
        if self._wants("final_hidden"):
            norm = _resolve(self.rt, TICO.row("final_hidden").native)
            with torch.no_grad():
                probe.tensor("final_hidden", norm(rec[("layer_out", L - 1)][:, rows])[0])

    def _layer_types(self):
        return set(self.loaded.text_config.layer_types)

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

    # ------------------------------------------------------------ the API
    def prefill(self, input_ids, extra_inputs, probe):
        extra = {k: torch.as_tensor(v) for k, v in extra_inputs.items()}
        has_image = self._build(input_ids, extra)
        T = self.T = len(input_ids)
        if T > self.max_seq - 1:
            raise TraceToolError(
                f"TICO's runtime keeps one slot for the decode row: prompt {T} needs max_seq >= {T + 1}"
            )
        batch = self._batch(input_ids, extra, has_image)
        if self.quantized:  # calibrate the fake-quant observers on this prompt, then freeze them
            self.rt.qmodel.enable_calibration()
            self.rt.prefill(batch)
            self.rt.qmodel.freeze_qparams()
            self.rt.reset_cache()
        self._rec = {} if probe is not None else None
        try:
            logits = self.rt.prefill(batch)
            if probe is not None:
                self._report(probe, slice(0, T), None)
        finally:
            self._rec = None
        return logits.reshape(-1)

    def _batch(self, input_ids, extra, has_image) -> dict:
        cfg = self.loaded.config
        pad = getattr(self.loaded.text_config, "pad_token_id", None)
        pad = 0 if pad is None else int(pad)
        T, S = len(input_ids), self.max_seq
        ids = torch.full((1, S), pad, dtype=torch.long)
        ids[0, :T] = input_ids
        ids[ids == int(cfg.image_token_id)] = pad  # TICO's convention: image slots hold pad ids
        valid = torch.zeros(1, S, dtype=torch.bool)
        valid[0, :T] = True
        dtype = next(self.loaded.model.parameters()).dtype
        pixels = extra["pixel_values"].to(dtype) if has_image else torch.zeros(1, dtype=dtype)
        batch = dict(llm_input_ids=ids, attention_mask=valid, valid_length=torch.tensor([T]), pixel_values=pixels)
        if has_image:
            batch["image_position_ids"] = extra["image_position_ids"].long()
        return batch

    def decode(self, token_id, position, probe):
        if position != self.rt.past_len:
            raise TraceToolError(f"TICO's runtime is at position {self.rt.past_len}, asked to decode at {position}")
        self._rec = {} if probe is not None else None
        try:
            logits = self.rt.decode_one(torch.tensor([[int(token_id)]]))
            if probe is not None:
                self._report(probe, slice(0, 1), position)
        finally:
            self._rec = None
        return logits.reshape(-1)


def create(loaded, max_seq: int, choice):
    return TicoRuntime(loaded, max_seq, quantized=choice.name == "tico-quant", capture=choice.capture)
