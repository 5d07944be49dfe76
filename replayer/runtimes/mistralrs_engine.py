"""mistral.rs in the child process (replayer/child.py's protocol), for --runtime mistralrs
(replayer/runtimes/mistralrs.py): its `Runner` on a checkpoint folder, CPU, float32.

    ("load", folder, template) -> ("ready", {"max_len": its maximum sequence length})
                                  template: a chat template file that writes the message verbatim
    ("next", ids, k)           -> ("token", id, log-probability, [(id, log-probability)] its top k)

A step is a new chat completion of one greedy token (temperature 0, top_logprobs k) whose message is
the text mistral.rs's tokenizer reads back as exactly `ids` (else refused): the template writes it as
it is, and mistral.rs's count of the prompt's tokens must be len(ids). The chosen token's id is its
top log-probability's (the binding names a top log-probability by id, the chosen token by its text
alone): the greedy choice, checked against the chosen token's log-probability (and, in a tie, its text).
"""

from __future__ import annotations

from gemma4_trace.replayer.child import EngineError, quiet_fd2


def _line(e: BaseException, n: int = 200) -> str:
    """An engine error's first line (mistral.rs appends candle's backtrace), whitespace folded."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    return " ".join(lines[0].split())[:n]


class MistralRSEngine:
    def __init__(self, emit):
        with quiet_fd2():
            import mistralrs

        self.M, self.runner = mistralrs, None

    def handle(self, command: str, *args):
        if command == "load":
            return self._load(*args)
        ids, k = [int(t) for t in args[0]], int(args[1])
        M, r = self.M, self.runner
        text = r.detokenize_text(ids, False)
        again = list(r.tokenize_text(text, False, None))
        if again != ids:
            at = next((i for i, (a, b) in enumerate(zip(again, ids)) if a != b), min(len(again), len(ids)))
            raise EngineError(
                f"mistral.rs's tokenizer reads the step's text back as {len(again)} other ids (first difference "
                f"at {at}): it takes text, and this text is ambiguous"
            )
        request = M.ChatCompletionRequest(
            messages=text, model="default", logprobs=True, top_logprobs=k, max_tokens=1, temperature=0.0
        )
        try:
            reply = r.send_chat_completion_request(request)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - its refusal or a Rust panic (pyo3's PanicException), one line
            raise EngineError(f"mistral.rs could not complete {len(ids)} tokens ({_line(e)})") from None
        if reply.usage.prompt_tokens != len(ids):
            raise EngineError(f"mistral.rs read the step's {len(ids)} tokens as {reply.usage.prompt_tokens}")
        content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
        if not content:
            raise EngineError("mistral.rs returned no log-probabilities for its token")
        chosen = content[0]
        top = [(int(t.token), float(t.logprob)) for t in chosen.top_logprobs]
        best = [t for t in chosen.top_logprobs if t.logprob == chosen.logprob]
        best = [t for t in best if t.bytes == chosen.token] if len(best) > 1 else best  # a tie: its text decides
        if not top or chosen.logprob != top[0][1] or len(best) != 1:
            raise EngineError(
                f"mistral.rs's token {chosen.token!r} (log-probability {chosen.logprob}) is not its one top "
                f"log-probability {top[:2]}: no greedy choice to read its id from"
            )
        return ("token", int(best[0].token), float(chosen.logprob), top)

    def _load(self, folder: str, template: str):
        M = self.M
        which = M.Which.MultimodalPlain(model_id=folder, arch=M.MultimodalArchitecture.Gemma4, dtype=M.ModelDType.F32)
        try:
            self.runner = M.Runner(which=which, no_paged_attn=True, prefix_cache_n=0, jinja_explicit=template)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - its refusal of a checkpoint or a Rust panic, one line
            raise EngineError(f"mistral.rs cannot load the checkpoint ({_line(e)})") from None
        return ("ready", {"max_len": self.runner.max_sequence_length()})
