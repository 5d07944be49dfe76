"""Record HF again on the exact inputs of an existing trace (`trace record --rerecord`, the pytest
plugin's golden refresh): the trace's ids, pixels and settings, checked before they reach generate()."""

from __future__ import annotations

from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError, one_line

from .record import PromptInputs, record_loaded

# inputs of the model's forward that generate() or the model compute, or that carry state:
# never taken from a trace (one from a trace would steer, not reproduce, the recording)
_NOT_EXTRA = frozenset(
    {
        "self",
        "input_ids",
        "attention_mask",
        "position_ids",
        "cache",
        "past_key_values",
        "inputs_embeds",
        "labels",
        "use_cache",
        "logits_to_keep",
        "per_layer_inputs",
        "mm_encoder_outputs",
        "cache_position",
    }
)


def check_extra_inputs(reader) -> None:
    """Refuse (one line) a trace whose extra inputs are not inputs of the recorded model's forward.

    A trace's extra inputs are passed to generate() as keyword arguments when it is re-recorded:
    a name generate() itself takes (suppress_tokens, max_new_tokens) would change or break the
    recording. Checked by name against the forward of the class the trace's config loads, and by
    shape where the prompt fixes it; nothing is read but shapes.
    """
    import inspect

    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    cls = Gemma4ForConditionalGeneration if reader.model_config.get("model_type") == "gemma4" else Gemma4ForCausalLM
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = {n for n, p in inspect.signature(cls.forward).parameters.items() if p.kind in kinds} - _NOT_EXTRA
    shapes = reader.extra_shapes()
    expected = {"mm_token_type_ids": (1, reader.prompt_len)}
    if "pixel_values" in shapes:
        expected["image_position_ids"] = (*shapes["pixel_values"][:2], 2)
    where = one_line(reader.path)
    for name, shape in shapes.items():
        if name not in takes:
            raise TraceToolError(
                f"{where}: extra input {one_line(repr(name))} is not an input of {cls.__name__}'s "
                f"forward ({', '.join(sorted(takes)) or 'it takes none'}); not re-recording it"
            )
        if name in expected and tuple(shape) != expected[name]:
            raise TraceToolError(
                f"{where}: extra input {name} has shape {tuple(shape)}, expected {expected[name]} "
                "for this prompt; not re-recording it"
            )


def rerecord_trace(reference, output, *, model_dir=None, device: str = "cpu", force: bool = False) -> list[int]:
    """Record HF again on the exact inputs of an existing trace (ids, pixels, settings)."""
    import numpy as np
    import torch

    from gemma4_trace.hf.model import load_for_reference
    from gemma4_trace.traces import TraceReader

    check_output_path(output, force)
    with TraceReader(reference) as r:
        check_extra_inputs(r)
        prov, ids, n_new = dict(r.provenance), [int(i) for i in r.prompt_ids], r.max_new_tokens
        extra = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in r.extra_inputs().items()}
        text, chat = r.prompt_text, r.chat_template_applied
    lm = load_for_reference(prov, model_dir, device=device)
    return record_loaded(lm, PromptInputs(ids, extra, text, chat), output, max_new_tokens=n_new, force=force)
