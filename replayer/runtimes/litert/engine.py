"""The child side of `--runtime litert*` (replayer/child.py's protocol): ai-edge-litert's
interpreter on the exported .tflite files.

    ("load", {name: path}, keep)  -> ("ready", {name: {signature: (inputs {name: (shape, dtype)}, outputs [name])}},
                                      [the names loaded with keep])
                                     keep: the names whose interpreter keeps every op's output
                                     (experimental_preserve_all_tensors: XNNPACK then runs op by op)
    ("run", name, signature, {input: array}, taps [(tensor, kind, layer)])
                                  -> each tap streamed (the child's emit: "tensors" messages), then
                                     ("outputs", {output: array})

A file the interpreter refuses is one line (EngineError); a crash inside it kills this process
only, and the parent names it.
"""

from __future__ import annotations

import numpy as np

from gemma4_trace.replayer.child import EngineError, quiet_fd2


class LiteRTEngine:
    def __init__(self, emit):
        with quiet_fd2():
            from ai_edge_litert.interpreter import Interpreter

        self.Interpreter, self.emit = Interpreter, emit
        self.models, self.runners = {}, {}

    def handle(self, command: str, *args):
        if command == "load":
            return self._load(*args)
        name, sig, inputs, taps = args
        runner = self.runners[(name, sig)]
        outs = runner(**inputs)
        sg = runner._subgraph_index
        for index, kind, layer in taps:
            self.emit(kind, layer, np.array(self.models[name].get_tensor(index, sg)))
        return ("outputs", {k: np.array(v) for k, v in outs.items()})

    def _load(self, paths: dict, keep):
        meta, kept = {}, []
        for name, path in paths.items():
            try:
                with quiet_fd2():
                    m = self.Interpreter(model_path=path, experimental_preserve_all_tensors=name in keep)
                kept += [name] if name in keep else []
                sigs = m.get_signature_list()
            except Exception as e:  # noqa: BLE001 - the interpreter's refusal of a file, one line
                raise EngineError(f"{path}: LiteRT cannot load it ({' '.join(str(e).split())[:160]})") from None
            self.models[name] = m
            meta[name] = {}
            for sig in sigs:
                r = self.runners[(name, sig)] = m.get_signature_runner(sig)
                ins = {
                    k: (tuple(int(d) for d in v["shape"]), np.dtype(v["dtype"]).name)
                    for k, v in r.get_input_details().items()
                }
                meta[name][sig] = (ins, list(r.get_output_details()))
        return ("ready", meta, kept)


class LiteRTLMEngine:
    """LiteRT-LM's `Engine` (CPU) on a .litertlm bundle: text (and image or audio files) in, text out.

    ("load", path, max_tokens, images, clips) -> ("ready", {"bos": id, "eos": [[ids]]}); images,
                                  clips: how many image and audio files a step takes (then the
                                  bundle must hold vision, audio sections; each gets a CPU backend)
    ("next", context_ids, runs) -> ("token", id[, note]): one greedy token after the context, its
                                  text turned back into its one id (a note when it showed no text).
                                  No runs: a new session prefilled with the context (as the text
                                  LiteRT-LM's tokenizer turns back into exactly these ids). Runs
                                  [(start, end, file[, "audio"])], each an image's <|image> ... <image|>
                                  positions (or a clip's <|audio> ... <audio|>, said so): a new
                                  conversation whose chat template (LM_TEMPLATE) writes the context's
                                  text verbatim, each file where its run stands (LiteRT-LM adds the BOS
                                  itself and writes the soft tokens). Anything else is refused in one line.
    """

    def __init__(self, emit):
        with quiet_fd2():
            import litert_lm

        self.lm, self.engine = litert_lm, None

    def handle(self, command: str, *args):
        if command == "load":
            return self._load(*args)
        context, runs = list(args[0]), list(args[1])
        e = self.engine
        prompt = self._parts(context, runs) if runs else self._text(context)
        out = self._decode(prompt, 1, len(context))
        if out:
            ids = e.tokenize(out)
            if len(ids) != 1:
                raise EngineError(f"LiteRT-LM decoded {out!r}, which is {len(ids)} tokens, not one")
            return ("token", int(ids[0]))
        # no text: LiteRT-LM withholds a token that begins one of its stop sequences (the bundle's
        # [".", "<turn|>", "\n"], say) and leaves a stop token out. Two tokens show the first, unless
        # it was a stop token: then the bundle's first one-token stop is recorded, and said.
        out = self._decode(prompt, 2, len(context))
        if out:
            return ("token", int(e.tokenize(out)[0]), f"its text withheld by a stop sequence; read from {out!r}")
        stops = [int(seq[0]) for seq in (e.eos_token_ids or []) if len(seq) == 1]
        if not stops:
            raise EngineError("LiteRT-LM decoded no text, and its bundle has no one-token stop to record")
        return ("token", stops[0], f"no text: a stop token, recorded as its first one, id {stops[0]}")

    def _load(self, path: str, max_tokens: int, images: int = 0, clips: int = 0):
        lm = self.lm
        try:
            with quiet_fd2():
                wants = (("vision", "text only", "an image", images), ("audio", "without audio", "a clip", clips))
                for modality, reads, what, wanted in wants:
                    if wanted:
                        with lm.model_info.ModelInfo(path) as info:
                            has = bool(getattr(info.input_modalities, modality, False))
                        if not has:
                            raise EngineError(
                                f"{path}: the bundle has no {modality} sections (LiteRT-LM reads it as {reads}); "
                                f"REF's prompt has {what}: a .litertlm exported with its {modality} encoder is needed"
                            )
                cpu = lm.interfaces.Backend.CPU()
                media = dict(max_num_images=int(images), vision_backend=cpu) if images else {}
                media.update(audio_backend=cpu) if clips else None
                self.engine = lm.Engine(path, backend=cpu, max_num_tokens=int(max_tokens), **media)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's refusal of a file, one line
            raise EngineError(f"{path}: LiteRT-LM cannot load it ({' '.join(str(e).split())[:160]})") from None
        return ("ready", {"bos": self.engine.bos_token_id, "eos": self.engine.eos_token_ids})

    def _text(self, ids: list) -> str:
        """The text LiteRT-LM's tokenizer reads back as exactly `ids`, else refused."""
        e = self.engine
        text = e.detokenize(list(ids))
        again = e.tokenize(text)
        if list(again) != list(ids):
            raise EngineError(
                f"LiteRT-LM's tokenizer reads the context back as {len(again)} other ids "
                f"(first difference at {_first_difference(again, ids)}): it takes text, and this text is ambiguous"
            )
        return text

    def _parts(self, context: list, runs: list) -> list:
        """The conversation's message content: the context's text between the runs (its BOS left
        out: LiteRT-LM adds its own), each image or audio file in its run's place."""
        bos = self.engine.bos_token_id
        if not context or context[0] != bos:
            raise EngineError(f"LiteRT-LM's conversation begins with its BOS token {bos}; REF's prompt does not")
        parts, at = [], 1
        for start, end, file, *kind in runs:
            parts += [{"type": "text", "text": self._text(context[at:start])}] if start > at else []
            parts.append({"type": kind[0] if kind else "image", "path": file})
            at = end + 1
        return parts + ([{"type": "text", "text": self._text(context[at:])}] if len(context) > at else [])

    def _decode(self, prompt, count: int, n: int) -> str:
        """The text of `count` greedy tokens after a new session prefilled with `prompt` (n tokens),
        or after a new conversation's message of `prompt`'s parts (text and images)."""
        greedy = self.lm.interfaces.SamplerConfig(top_k=1, temperature=0.0)
        with quiet_fd2():
            if isinstance(prompt, list):
                return self._converse(prompt, count, greedy, n)
            s = self.engine.create_session(apply_prompt_template=False, sampler_config=greedy, max_output_tokens=count)
            try:
                s.run_prefill([prompt])
                out = s.run_decode().texts
            except Exception as e:  # noqa: BLE001 - the engine's refusal, one line with what it was asked
                raise EngineError(
                    f"LiteRT-LM could not prefill {n} tokens and decode {count} "
                    f"({' '.join(str(e).split())[:120]}); it runs at most its bundle's cache length - 2 per "
                    "session (rounded down to even): a bundle of yours needs a longer cache"
                ) from None
            finally:
                s.close()
        return out[0] if out else ""

    def _converse(self, parts: list, count: int, greedy, n: int) -> str:
        c = self.engine.create_conversation(sampler_config=greedy, chat_template=LM_TEMPLATE, max_output_tokens=count)
        try:
            m = c.send_message({"role": "user", "content": parts})
        except Exception as e:  # noqa: BLE001 - the engine's refusal, one line with what it was asked
            images, clips = (sum(p["type"] == t for p in parts) for t in ("image", "audio"))
            media = " and ".join(f"{k} {w}(s)" for k, w in ((images, "image"), (clips, "clip")) if k)
            why = (
                "; a litert-torch bundle of a model that does not pool 3 x 3 needs its vision metadata rebuilt "
                "(docs/upstream/litert-torch-litertlm-vision-metadata.md)"
                if images
                else ""
            )
            raise EngineError(
                f"LiteRT-LM's conversation could not take {n} tokens with {media} and decode {count} "
                f"({' '.join(str(e).split())[:160]}){why}"
            ) from None
        finally:
            c.close()
        content = m.get("content", []) if isinstance(m, dict) else [{"type": "text", "text": str(m)}]
        return "".join(item.get("text", "") for item in content if item.get("type") == "text")


# a conversation's chat template for LiteRTLMEngine's steps with images or clips: the message's parts
# verbatim, each image or clip as LiteRT-LM's placeholder (it writes the <|image> ... <image|> or
# <|audio> ... <audio|> run there)
LM_TEMPLATE = (
    "{%- for item in messages[0]['content'] -%}{%- if item['type'] == 'image' -%}<|image|>"
    "{%- elif item['type'] == 'audio' -%}<|audio|>{%- else -%}{{- item['text'] -}}{%- endif -%}{%- endfor -%}"
)


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
