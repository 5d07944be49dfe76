"""Record a reference trace: HF Gemma 4 greedy generate() with hooks, streamed to HDF5.

Every model forward call inside generate() is one step. Hooks collect the canonical
tensors of the call; when the call returns they are written to the trace, so memory
does not grow with the number of steps. What is recorded is what HF computed:

- q, K/V and the mask come from the attention function itself (wrapped in place of
  the model's own implementation), so they are exactly what attention used;
- embeddings and per-layer inputs are the inputs of the decoder layers;
- logits are the model output (soft-capped) at the predicting position.

generate() normally passes `logits_to_keep=1`, which lets KV-reusing layers process
only the last prompt position in prefill (their other rows feed nothing: they write no
K/V). By default the recorder passes an index tensor instead, which keeps every position
in every layer and leaves the numbers unchanged. `shared_kv_prefill="last"` keeps
generate()'s shortcut (its speed on long prompts): those layers' other prefill rows, and
final_hidden's (the norm after them), are stored as zeros flagged absent, and the diff does
not compare them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from gemma4_trace.hf import sites as S
from gemma4_trace.hf.audio import audio_rate, load_clip, with_audio
from gemma4_trace.hf.files import check_input_file
from gemma4_trace.hf.memory import generation_bytes
from gemma4_trace.hf.model import DEMO_AUDIO_PROMPT, DEMO_IMAGE_PROMPT, DEMO_PROMPT, LoadedModel, load_model, provenance
from gemma4_trace.traces import Provenance, TraceHeader, TraceWriter, layer_infos_from_config
from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.schema import LAYER_KIND_NAMES, rope_kinds
from gemma4_trace.traces.writer import Bf16Rows, spare_core

from .towers import AudioRows, VisionRows, tower_infos


@dataclass
class PromptInputs:
    input_ids: list[int]
    extra: dict = field(default_factory=dict)  # processor outputs besides ids (torch tensors)
    text: str = ""
    chat: bool = False


def record_trace(
    model_dir=None,
    output=None,
    prompt: str | None = None,
    input_ids: list[int] | None = None,
    images: list[str] = (),
    audios: list[str] = (),
    max_new_tokens: int = 16,
    dtype: str = "float32",
    device: str = "cpu",
    chat: bool = True,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    selection=None,
    device_map: str | None = None,
    max_memory: dict | None = None,
    offload_folder=None,
    shared_kv_prefill: str = "all",
) -> str:
    """Record HF Gemma 4 on one prompt into `output`; return a one-line summary.

    `progress(done, total)`, when given, is called after each generated token.
    `selection` (traces.selection.Selection): the layers, kinds and steps to keep; None: all.
    `device_map` "auto" (with max_memory, offload_folder): accelerate places the model over the
    GPUs, CPU and disk (hf/model.py); the hooks copy what they record to the CPU.
    `shared_kv_prefill` "all" (every prefill row of every layer) or "last" (generate()'s shortcut,
    see the module docstring). `audios`: audio clips (recorder/audio.py), read before the model loads;
    with no model folder they select the embedded model with an audio tower.
    """
    check_output_path(output, force)  # fail before loading anything
    if prompt is not None and input_ids is not None:
        raise TraceToolError("give exactly one of --prompt or --input-ids")
    if prompt is None and input_ids is None:
        if model_dir is not None:
            raise TraceToolError("give the prompt with --prompt TEXT or --input-ids 2,10,11")
        prompt = DEMO_AUDIO_PROMPT if audios else DEMO_IMAGE_PROMPT if images else DEMO_PROMPT  # the demos
    if (images or audios) and prompt is None:
        what = "--image" if images else "--audio"
        raise TraceToolError(f"{what} needs --prompt (the processor places the image and audio tokens)")
    pil_images = [open_image(p) for p in images]
    _phase(progress, "loading the model")
    lm = load_model(
        model_dir,
        dtype=dtype,
        device=device,
        device_map=device_map,
        max_memory=max_memory,
        offload_folder=offload_folder,
        audio=bool(audios),
    )
    clips = [load_clip(p, audio_rate(lm)) for p in audios]
    _phase(progress, "generating")
    inputs = prepare_inputs(lm, prompt, input_ids, pil_images, chat, clips)
    tokens = record_loaded(
        lm,
        inputs,
        output,
        max_new_tokens=max_new_tokens,
        force=force,
        progress=progress,
        selection=selection,
        shared_kv_prefill=shared_kv_prefill,
    )
    text = ""
    if lm.tokenizer is not None:
        text = " -> " + repr(lm.tokenizer.decode(tokens, skip_special_tokens=False))
    notes = "; ".join(c.note for c in clips if c.note)  # what was done to fit the clips, said on the one line
    notes = f" ({notes})" if notes else ""
    return f"wrote {output}: {len(inputs.input_ids)} prompt tokens, {len(tokens)} generated{text}{notes}"


MAX_IMAGE_BYTES = 256 << 20  # an image file read whole at most
MAX_IMAGE_PIXELS = 64 << 20  # width x height an image's header may claim (the processor resizes it anyway)


def open_image(path: str):
    """A prompt image as RGB: a regular file within MAX_IMAGE_BYTES whose header claims at most
    MAX_IMAGE_PIXELS, else one line (a FIFO is never opened: it would block)."""
    from PIL import Image, UnidentifiedImageError

    check_input_file(path, "image", MAX_IMAGE_BYTES)
    try:
        with Image.open(path) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                raise TraceToolError(
                    f"image {one_line(path, 80)} claims {w} x {h} pixels, more than the {MAX_IMAGE_PIXELS} read"
                )
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise TraceToolError(f"image {one_line(path, 80)} is not a readable image ({type(e).__name__})") from None


def prepare_inputs(lm: LoadedModel, prompt, input_ids, images, chat: bool, clips=()) -> PromptInputs:
    """Token ids (and pixel and audio inputs) exactly as the processor / chat template make them."""
    vocab = lm.text_config.vocab_size
    if input_ids is not None:
        bad = [i for i in input_ids if not 0 <= i < vocab]
        if bad:
            raise TraceToolError(f"--input-ids {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return PromptInputs(list(input_ids))
    try:  # invalid UTF-8 on the command line, or a lone surrogate in a JSON prompt: no text a tokenizer takes
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise TraceToolError(f"the prompt is not valid Unicode text ({one_line(prompt, 60)})") from None
    if images and not lm.multimodal:
        raise TraceToolError(f"{lm.model_dir} is a text-only model; it cannot take --image")
    if lm.processor is None:
        raise TraceToolError(f"{lm.model_dir} has no tokenizer; give the prompt as --input-ids")
    check_prompt_bytes(lm, prompt)
    if images and not hasattr(lm.processor, "image_processor"):
        raise TraceToolError(f"{lm.model_dir} has no image processor; it cannot take --image")
    use_chat = chat and getattr(lm.processor, "chat_template", None) is not None
    if clips:
        enc = with_audio(lm, prompt, images, [c.samples for c in clips], use_chat)
    elif use_chat:
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": prompt}]
        enc = lm.processor.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
    elif images:
        text = "".join(lm.processor.image_token for _ in images) + prompt
        enc = lm.processor(text=text, images=images, return_tensors="pt")
    else:
        enc = (
            lm.processor(text=prompt, return_tensors="pt")
            if hasattr(lm.processor, "image_processor")
            else lm.tokenizer(prompt, return_tensors="pt")
        )
    enc = dict(enc)
    ids = enc.pop("input_ids")[0].tolist()
    enc.pop("attention_mask", None)
    if not images and not clips:
        enc.pop("mm_token_type_ids", None)
    if not ids:
        raise TraceToolError("the prompt tokenizes to no tokens")
    return PromptInputs(ids, {k: v for k, v in enc.items() if v is not None}, prompt, use_chat)


def check_prompt_bytes(lm: LoadedModel, prompt: str) -> None:
    """Refuse, before tokenizing (a 10 MB line took minutes and gigabytes), a prompt too long for
    any tokenization of it to fit the model's positions: no token is longer than the vocabulary's
    longest, so the text needs at least bytes / longest tokens."""
    limit = getattr(lm.text_config, "max_position_embeddings", None)
    size = len(prompt.encode("utf-8"))
    if limit is None or size <= limit:  # fewer bytes than positions: it fits whatever the tokens
        return
    try:
        longest = max(len(t.encode("utf-8")) for t in lm.tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return  # no vocabulary to bound by: the token count decides after tokenizing
    if size > limit * max(longest, 1):
        raise TraceToolError(
            f"the prompt is {size} bytes: at least {-(-size // longest)} tokens (no token of the vocabulary is "
            f"longer than {longest} bytes), more than the model's {limit} positions (max_position_embeddings)"
        )


def check_positions(text_config, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse a run past the model's max positions (RoPE and masks are defined up to there)."""
    limit = getattr(text_config, "max_position_embeddings", None)
    if limit is None:
        return
    if prompt_len > limit:
        raise TraceToolError(
            f"the prompt has {prompt_len} tokens, more than the model's {limit} positions (max_position_embeddings)"
        )
    if prompt_len + max_new_tokens > limit:
        raise TraceToolError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} = {prompt_len + max_new_tokens} "
            f"exceeds the model's {limit} positions (max_position_embeddings)"
        )


def eos_ids(lm: LoadedModel) -> list[int]:
    eos = lm.model.generation_config.eos_token_id
    if eos is None:
        eos = lm.text_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return sorted(set(int(e) for e in eos))


class _StepRecorder:
    """Hooks that gather one forward call's canonical tensors, then write them as a step."""

    def __init__(self, lm: LoadedModel, writer: TraceWriter, prompt_len: int, shortcut: bool = False, extra=None):
        self.lm, self.w, self.T = lm, writer, prompt_len
        self.vision = VisionRows(lm.model, extra or {})  # the vision tower's rows (prefill only)
        self.audio = AudioRows(lm.model, extra or {})  # the audio tower's rows (prefill only)
        self.shortcut = shortcut  # generate()'s prefill shortcut: KV-sharing layers see only the last row
        self.text_model = S.tower_model(lm.model)
        self.n_layers = S.layer_count(lm.model)
        self.layer_types = list(lm.text_config.layer_types)
        self.owner = [li.kv_role != "reuses" for li in layer_infos_from_config(lm.text_config)]
        self.n_steps = 0
        self.pending_token_step = False  # a step waits for its token (known at the next call)
        self.buf: dict = {}

    # -- the wrapped attention function: sees q, K, V and the mask as HF uses them
    def attention(self, original):
        # the modules whose calls of the attention function compute q, K, V and the mask (hf/sites.py)
        site = S.BY_KEY["q"]
        text_attention = {id(S.submodule(self.lm.model, site, i)): i for i in range(self.n_layers)}

        def wrapped(module, query, key, value, attention_mask, **kwargs):
            i = text_attention.get(id(module))
            if i is None:  # the vision tower's attention
                j = self.vision.attention_layers.get(id(module))
                if j is not None:
                    self.vision.attention(j, query, key, value, attention_mask)
                return original(module, query, key, value, attention_mask, **kwargs)
            t = S.attention_tensors(query, key, value, attention_mask)
            q_len, k_len = t["q"].shape[2], t["k"].shape[2]
            assert t["q"].shape[0] == 1, "the recorder runs batch 1"
            assert q_len == len(self.positions) or (self.shortcut and q_len == 1), (q_len, self.positions)
            allowed = self._allowed(t["mask"], q_len, k_len, t["q"].device)
            self.buf[("mask", i)] = allowed
            self.buf[("q", i)] = t["q"][0].transpose(0, 1)  # (q, H, D)
            if self.owner[i]:
                # the rows written at this step are the last q_len rows of the returned cache
                self.buf[("k", i)] = t["k"][0, :, -q_len:].transpose(0, 1)  # (q, KVH, D)
                self.buf[("v", i)] = t["v"][0, :, -q_len:].transpose(0, 1)
            return original(module, query, key, value, attention_mask, **kwargs)

        return wrapped

    def _allowed(self, mask, q_len: int, k_len: int, device):
        """allowed[query, key] over absolute key positions 0..last query position.

        HF hands attention the K/V of a contiguous run of positions ending at the last
        query position (a sliding cache keeps only its window), and a mask that is None
        (sdpa's causal fast path), bool, or additive float. The queries are the step's last
        q_len positions (all of them, or the last one under generate()'s prefill shortcut).
        """
        import torch

        last = self.positions.stop - 1
        start = last + 1 - q_len
        if mask is None:
            local = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
            if q_len > 1:
                qpos = torch.arange(start, last + 1, device=device)[:, None]
                kpos = torch.arange(last - k_len + 1, last + 1, device=device)[None, :]
                local = kpos <= qpos
        else:
            m = mask[0, 0, :, -k_len:] if mask.dim() == 4 else mask[0, :, -k_len:]
            assert m.shape == (q_len, k_len), (tuple(mask.shape), q_len, k_len)
            local = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        full = torch.zeros(q_len, last + 1, dtype=torch.bool, device=device)
        full[:, last + 1 - k_len :] = local
        return full

    # -- module hooks: at every module hf/sites.py names
    def install(self, stack: contextlib.ExitStack) -> None:
        tm = self.text_model
        hooks = [
            self.lm.model.register_forward_pre_hook(self._on_call, with_kwargs=True),
            self.lm.model.register_forward_hook(self._on_return),
            *S.install(self.lm.model, self._put),
        ]
        for h in hooks:
            stack.callback(h.remove)
        slicer = getattr(tm, "_maybe_slice_kv_shared_inputs", None)
        if slicer is not None:  # the per-layer inputs of every position, before the shortcut drops rows

            def see_all_rows(hidden, per_layer_inputs, *args, **kwargs):
                if per_layer_inputs is not None:
                    self.buf["ple_all"] = per_layer_inputs[0]
                return slicer(hidden, per_layer_inputs, *args, **kwargs)

            tm._maybe_slice_kv_shared_inputs = see_all_rows
            stack.callback(delattr, tm, "_maybe_slice_kv_shared_inputs")

    def _on_call(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        n = ids.shape[1]
        if self.pending_token_step:  # the token fed now is the one chosen at the previous step
            self._finish_step(int(ids[0, -1]))
        start = 0 if self.n_steps == 0 else self.T + self.n_steps - 1
        if (self.n_steps == 0 and n != self.T) or (self.n_steps > 0 and n != 1):
            raise RuntimeError(f"unexpected forward over {n} tokens at step {self.n_steps}")
        self.positions = range(start, start + n)
        self.buf = {}

    def _put(self, site, layer, t):
        """A hooked module's tensor (hf/sites.py): batch 1's rows, by kind (and layer: per_layer_inputs
        too, one slice per layer)."""
        if site.tower != S.TEXT:
            (self.audio if site.tower == S.AUDIO else self.vision).put(site, layer, t)
            return
        self.buf[site.kind if layer is None else (site.kind, layer)] = t[0]

    def _on_return(self, module, args, out):
        import numpy as np
        import torch

        b, w = self.buf, self.w
        w.begin_step(self.positions)

        def put(kind, t, layer=None):
            if not w.keeps(kind, layer):  # a selective recording: never copied
                return
            if not w.keeps_now(kind, layer):  # a step left out: zero rows, flagged absent by the writer
                t = np.zeros(tuple(t.shape), dtype=bool if t.dtype == torch.bool else np.float32)
            n = t.shape[0]  # fewer rows than positions: the last ones (generate()'s prefill shortcut)
            rows = None if n == len(self.positions) else range(self.positions.stop - n, self.positions.stop)
            w.add(kind, writer_rows(t) if hasattr(t, "detach") else t, layer=layer, positions=rows)

        if self.n_steps == 0:  # the encoder towers ran in the prefill, before the text tower
            self.vision.write(w, writer_rows)
            self.audio.write(w, writer_rows)
        put("embeddings", b["embeddings"])
        n_layers = self.n_layers
        if ("per_layer_inputs", 0) in b and w.keeps("per_layer_inputs"):
            ple = [b[("per_layer_inputs", i)] for i in range(n_layers)]
            whole = all(p.shape[0] == len(self.positions) for p in ple)
            put("per_layer_inputs", torch.stack(ple, dim=1) if whole else b["ple_all"])
        for lt in sorted(set(self.layer_types)):
            for kind in rope_kinds(lt):
                put(kind, b[kind])
        for i in range(n_layers):
            for kind in LAYER_KIND_NAMES:
                if (kind, i) in b:
                    put(kind, b[(kind, i)], layer=i)
        put("final_hidden", b["final_hidden"])
        logits = S.output_of(S.LOGITS, out)[0, -1]
        w.add("logits", writer_rows(logits))
        self.n_steps += 1
        self.pending_token_step = True
        self.buf = {}

    def _finish_step(self, token: int) -> None:
        self.w.add("token", token)
        self.w.end_step()
        self.pending_token_step = False


def writer_rows(t):
    """A step's rows for the writer: bf16 as their 16-bit patterns (no upcast, half the bytes to
    copy, and copied once: here or by the writer), the rest as numpy_rows."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        bits = t.contiguous().view(torch.int16).cpu().numpy()
        # a transposed view (q, K, V) or a GPU tensor was copied here: the writer need not copy it again
        return Bf16Rows(bits, owned=bits.ctypes.data != t.data_ptr())
    return numpy_rows(t)


def numpy_rows(t):
    """float32 numpy for floating tensors (bf16 upcast losslessly); bool and int kept."""
    t = t.detach()
    return (t.float() if t.is_floating_point() else t).cpu().numpy()


def record_loaded(
    lm: LoadedModel,
    inputs: PromptInputs,
    output,
    *,
    max_new_tokens: int,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    selection=None,
    shared_kv_prefill: str = "all",
) -> list[int]:
    """Run greedy generate() with hooks and write the trace; return the generated ids."""
    import torch

    ids = torch.tensor([inputs.input_ids], device=lm.device)
    extra = {k: v.to(lm.device) if hasattr(v, "to") else v for k, v in inputs.extra.items()}
    eos = eos_ids(lm)
    layers = layer_infos_from_config(lm.text_config)
    prompt_len = ids.shape[1]
    check_positions(lm.text_config, prompt_len, max_new_tokens)
    towers = tower_infos(lm.model, extra)
    if selection is not None:
        selection.check(len(layers), max_new_tokens, {t.name: t.layers for t in towers})
    if shared_kv_prefill not in ("all", "last"):
        raise TraceToolError(f"--shared-kv-prefill must be all or last, got {shared_kv_prefill!r}")
    # HF slices only a prefill of 2+ positions (and not under flash / flex attention, GPU only)
    shortcut = shared_kv_prefill == "last" and any(li.kv_role == "reuses" for li in layers) and prompt_len > 1
    impl = lm.model.config._attn_implementation or "eager"
    streamer = _ProgressStreamer(max_new_tokens, progress) if progress is not None else None
    LIM.check_fits(
        generation_bytes(lm.text_config, prompt_len, prompt_len + max_new_tokens, 2 if lm.dtype == "bfloat16" else 4),
        f"recording {prompt_len} prompt tokens + {max_new_tokens} new tokens",
    )

    threaded = spare_core(str(lm.device), torch.get_num_threads())  # a writer thread only where it has a core
    with TraceWriter(output, force=force, source_dtype=lm.dtype, selection=selection, threaded=threaded) as w:
        w.write_header(
            TraceHeader(
                Provenance.from_dict(
                    provenance(
                        lm,
                        runtime=f"hf-transformers ({impl}{', KV-shared prefill: last row' if shortcut else ''})",
                        mode="reference",
                    )
                ),
                inputs.input_ids,
                layers,
                max_new_tokens=max_new_tokens,
                eos_token_ids=eos,
                prompt_text=inputs.text,
                chat_template_applied=inputs.chat,
                extra_inputs={k: numpy_rows(v) for k, v in extra.items()},
                towers=towers,
            )
        )
        rec = _StepRecorder(lm, w, prompt_len, shortcut, extra)
        out = _generate(lm, rec, ids, extra, max_new_tokens, eos, shortcut, streamer)
        generated = out[0, prompt_len:].tolist()
        if rec.pending_token_step:
            rec._finish_step(generated[-1])
        if rec.n_steps != len(generated):
            raise RuntimeError(f"recorded {rec.n_steps} steps for {len(generated)} generated tokens")
    return generated


def _generate(lm: LoadedModel, rec, ids, extra: dict, max_new_tokens: int, eos, shortcut: bool, streamer):
    """HF's greedy generate() with the recorder's hooks and attention function installed (and
    removed again, however it ends); returns generate()'s output ids."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gemma4 import modeling_gemma4

    impl = lm.model.config._attn_implementation or "eager"
    original = ALL_ATTENTION_FUNCTIONS.get(impl, modeling_gemma4.eager_attention_forward)
    with contextlib.ExitStack() as stack:
        rec.install(stack)
        ALL_ATTENTION_FUNCTIONS[impl] = rec.attention(original)
        stack.callback(ALL_ATTENTION_FUNCTIONS._local_mapping.pop, impl, None)
        with torch.no_grad():
            return lm.model.generate(
                ids,
                **extra,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos,
                pad_token_id=lm.text_config.pad_token_id,
                # an index tensor (not the int generate() uses) keeps all positions in KV-reusing layers
                logits_to_keep=1 if shortcut else torch.tensor([-1], device=lm.device),
                streamer=streamer,
                top_k=None,
                top_p=None,
                temperature=None,
            )


def _phase(progress, what: str) -> None:
    """Tell a progress display (gemma4_trace/progress.py) which phase starts, if it listens."""
    if hasattr(progress, "phase"):
        progress.phase(what)


class _ProgressStreamer:
    """A generate() streamer that reports progress: put() is called once per generated token."""

    def __init__(self, total: int, progress: Callable[[int, int], None]):
        self.total, self.progress = total, progress
        self.done = -1  # the first put() is the prompt

    def put(self, value) -> None:
        self.done += 1
        if self.done > 0:
            self.progress(self.done, self.total)

    def end(self) -> None:
        pass
