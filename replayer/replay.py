"""`trace replay`: run a runtime on a reference trace's inputs and write a candidate trace."""

from __future__ import annotations

import time

from gemma4_trace.progress import ProgressBar
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.layers import layer_infos_from_config
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.writer import TraceWriter

MODES = ("teacher-forced", "free-running")


def default_max_seq(prompt_len: int, max_new_tokens: int) -> int:
    """Prompt + new tokens rounded up to a multiple of 8."""
    n = prompt_len + max_new_tokens
    return -(-n // 8) * 8


def _read_reference(reference) -> dict:
    with TraceReader(reference) as r:
        return dict(
            provenance=dict(r.provenance),
            prompt_ids=[int(x) for x in r.prompt_ids],
            extra=r.extra_inputs(),
            max_new_tokens=r.max_new_tokens,
            eos=list(r.eos_token_ids),
            prompt_text=r.prompt_text,
            chat=r.chat_template_applied,
            tokens=[int(t) for t in r.tokens()],
            n_steps=r.n_steps,
        )


def replay_trace(
    reference,
    output,
    *,
    model_dir=None,
    runtime: str = "static",
    max_seq: int | None = None,
    mode: str = "teacher-forced",
    force: bool = False,
    progress: bool = True,
) -> str:
    """Replay REF's inputs through a runtime and write the candidate trace; return a summary line."""
    import torch

    from gemma4_trace.recorder.model import load_for_reference, provenance

    from .api import WriterProbe, make_runtime

    if mode not in MODES:
        raise TraceToolError(f"mode must be one of {MODES}, got {mode!r}")
    check_output_path(output, force)
    ref = _read_reference(reference)
    T, n_new = len(ref["prompt_ids"]), ref["max_new_tokens"]
    if max_seq is None:
        max_seq = default_max_seq(T, n_new)
    if T + n_new > max_seq:
        raise TraceToolError(
            f"prompt ({T} tokens) + max_new_tokens ({n_new}) = {T + n_new} exceeds --max-seq {max_seq}"
        )
    loaded = load_for_reference(ref["provenance"], model_dir)
    rt = make_runtime(runtime, loaded, max_seq)
    name = rt.name
    layers = layer_infos_from_config(loaded.text_config)
    extra = {k: torch.as_tensor(v) for k, v in ref["extra"].items()}
    ids = torch.tensor(ref["prompt_ids"], dtype=torch.long)
    eos = set(ref["eos"])
    ref_tokens = ref["tokens"]
    n_steps = ref["n_steps"] if mode == "teacher-forced" else n_new
    vocab = loaded.text_config.vocab_size
    bar = ProgressBar("replaying", n_steps, progress)
    plugin = runtime != "static"
    t0 = time.perf_counter()

    def call(what, fn, *args):
        try:
            logits = fn(*args)
        except TraceToolError:
            raise
        except Exception as e:
            if not plugin:
                raise
            raise TraceToolError(f"runtime {name} failed in {what}: {type(e).__name__}: {str(e)[:200]}") from None
        logits = torch.as_tensor(logits).detach().reshape(-1) if logits is not None else None
        if logits is None or logits.shape[0] != vocab:
            shape = None if logits is None else tuple(logits.shape)
            raise TraceToolError(f"runtime {name} returned logits of shape {shape} from {what}; expected ({vocab},)")
        return logits

    tokens: list[int] = []
    with TraceWriter(output, force=force, source_dtype=loaded.dtype) as w:
        w.write_header(
            provenance(loaded, runtime=name, mode=mode), ref["prompt_ids"], layers,
            max_new_tokens=n_new, eos_token_ids=ref["eos"], prompt_text=ref["prompt_text"],
            chat_template_applied=ref["chat"], extra_inputs=ref["extra"],
        )
        probe = WriterProbe(w, name)
        try:
            for step in range(n_steps):
                probe.next_step()
                if step == 0:
                    w.begin_step(range(0, T))
                    logits = call("prefill", rt.prefill, ids, extra, probe)
                else:
                    fed = ref_tokens[step - 1] if mode == "teacher-forced" else tokens[-1]
                    w.begin_step(range(T + step - 1, T + step))
                    logits = call(f"decode step {step}", rt.decode, fed, T + step - 1, probe)
                token = int(torch.argmax(logits))
                w.add("logits", logits.float().cpu().numpy(), source_dtype=str(logits.dtype).removeprefix("torch."))
                w.add("token", token)
                w.end_step()
                tokens.append(token)
                bar.update(step + 1)
                if mode == "free-running" and token in eos:
                    break
        finally:
            bar.close()
    seconds = time.perf_counter() - t0
    if mode == "teacher-forced":
        agree = sum(a == b for a, b in zip(tokens, ref_tokens))
        detail = f"{agree}/{len(tokens)} tokens agree with the reference"
    else:
        n = len(tokens)
        same = tokens == ref_tokens[:n] and n == len(ref_tokens)
        detail = "same tokens as the reference" if same else "tokens differ from the reference"
    return (
        f"wrote {output}: {name} runtime, {mode}, {len(tokens)} steps, max_seq {max_seq}, "
        f"{detail} ({seconds:.1f} s)"
    )
