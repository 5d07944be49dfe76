"""`--runtime litert-lm [--litertlm FILE]`: LiteRT-LM (Google's on-device LLM engine, `litert_lm`,
CPU) on a .litertlm bundle: the one litert-torch's export writes from REF's checkpoint
(replayer/runtimes/litert/export.py), or a user's file.

LiteRT-LM's Python API takes text and gives text: no token ids in, no logits or tensors out. A
step here is a new session prefilled with the step's context (REF's prompt and the tokens fed
so far, as text that LiteRT-LM's tokenizer reads back as exactly those ids, else refused) and one
greedy token decoded (its text read back as one id). The trace holds that token alone
(api.TokenOnly): the diff compares tokens; logits and every tensor kind are not compared.
Teacher-forced and free-running both work (each step starts from its own context).

An image prompt: LiteRT-LM takes an image only as a file, through its Conversation API (a Session
refuses one). Each image is written as a PNG rebuilt from REF's pixel_values (refused unless
transformers' processor gives REF's pixel_values back from it), the bundle is litert-torch's export
with its vision encoder (export.py's lm_vision_exported, its fixes said on stderr and in the
runtime's name), and a step is a new conversation whose chat template writes the context verbatim,
each image where REF's <|image> ... <image|> run stands (engine.py).

An audio prompt: LiteRT-LM takes the clip's waveform (an audio file), not REF's log-mel features, and
computes its own: the clip REF was recorded from is given with --audio-features native --audio FILE,
and the bundle is litert-torch's export with its audio encoder (lm_audio.py).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from gemma4_trace.traces.errors import TraceToolError

from ...api import TokenOnly
from ...child import ChildRuntime
from . import audio as A
from . import export as E
from . import lm_audio as LA

ENGINE = "gemma4_trace.replayer.runtimes.litert.engine:LiteRTLMEngine"
# LiteRT-LM 0.18.1 prefills at most L - 2 tokens in a session whose bundle's cache holds S positions,
# L being S rounded down to even (measured on litert-torch exports: caches 16, 17, 18 took prompts of
# 14, 14, 16 tokens and one decoded token; at L - 2, a session asked for two tokens gives one). The
# replay's last step prefills max_seq - 1 tokens and may ask for two (engine.py: a token withheld
# by a stop sequence), so the bundle exported for a replay has a cache of max_seq + 3 (a cache of
# max_seq failed there). Odd caches misbehave beyond that rule (a cache of 43 refused a prompt of 31
# tokens): the cache is rounded up to even, and the bundle's prefill takes it whole (LiteRT-LM's
# results do not depend on the prefill length; --prefill-chunk does not apply).
ROOM = 3


class LiteRTLM(ChildRuntime):
    """The bundle is exported (or taken from the artifact cache) when the driver prepares it: a cache
    of max_seq + ROOM positions rounded up to even, its prefill taking the cache whole (an export
    of its own, not the litert runtime's: LiteRT-LM needs the room)."""

    def __init__(self, loaded, max_seq: int, user_file=None, audio=None):
        from importlib.metadata import version

        ver = version("litert-lm-api")
        self.loaded, self.max_seq, self.user_file = loaded, int(max_seq), user_file
        self.clip = audio[0] if audio is not None else None  # --audio FILE's header: the clip's samples
        if user_file is not None and not Path(user_file).is_file():
            raise TraceToolError(f"--litertlm {user_file}: no such file")
        self.start(f"litert-lm (LiteRT-LM {ver})", ENGINE)
        note = "a user's file" if user_file is not None else "exported from REF's checkpoint by litert-torch"
        self.name = f"litert-lm (LiteRT-LM {ver}, CPU, greedy, text in and out: tokens only; {note})"
        self.ready = False
        self.context: list[int] = []
        self.runs: list = []  # the prompt's images and clips: [(start, end, file[, "audio"])] (lm_audio.py)
        self.folder = None  # the PNG and WAV files' temporary folder

    def _load(self, ids: list[int], extra: dict) -> None:
        loaded, max_seq = self.loaded, self.max_seq
        self.folder = Path(tempfile.mkdtemp(prefix="litert-lm-media-"))
        try:
            clips = LA.clip_files(loaded, extra, self.clip, self.folder) if "input_features" in extra else []
        except BaseException:
            self.close()
            raise
        pictures = images_of(loaded, extra) if "pixel_values" in extra else []
        spans = image_runs(loaded, ids, len(pictures)) if pictures else []
        notes, fixes = [], []
        try:
            if self.user_file is not None:
                path = Path(self.user_file)
                meta = self.child.call("load", str(path), max_seq, len(pictures), len(clips), phase="loading")[1]
            else:
                S = max_seq + ROOM + (max_seq + ROOM) % 2  # room past the replay's last position; even
                if pictures:
                    v = loaded.config.vision_config
                    soft = int(np.asarray(extra["pixel_values"]).shape[1]) // int(v.pooling_kernel_size) ** 2
                    said = ((E.adapter_note(v), "its adapter's input sized by the tower's hidden size"),
                            (E.metadata_note(v, soft), f"its vision metadata rebuilt for {v.pooling_kernel_size} x "
                             f"{v.pooling_kernel_size} pooling"))  # fmt: skip
                    notes, fixes = [n for n, _ in said if n], [f for n, f in said if n]
                    art = E.lm_vision_exported(loaded, S, soft)
                elif clips:
                    note = A.adapter_note(loaded.config.audio_config)
                    notes = [note] if note else []
                    fixes = ["its audio adapter's input sized by output_proj_dims"] if note else []
                    art = LA.lm_audio_exported(loaded, S)
                else:
                    art = E.exported(loaded, S, S)
                try:
                    path = art.path / E.BUNDLE
                    meta = self.child.call("load", str(path), S, len(pictures), len(clips), phase="loading")[1]
                finally:
                    art.close()
            if pictures:
                from PIL import Image

                for i, pixels in enumerate(pictures):
                    Image.fromarray(pixels).save(self.folder / f"image{i}.png")
                self.runs = [(a, b, str(self.folder / f"image{i}.png")) for i, (a, b) in enumerate(spans)]
            if clips:
                self.runs = [(a, b, f, "audio") for (a, b), f in zip(LA.audio_runs(loaded, ids, len(clips)), clips)]
        except BaseException:
            self.close()
            raise
        bos, want = meta.get("bos"), getattr(loaded.text_config, "bos_token_id", None)
        if bos is not None and want is not None and int(bos) != int(want):
            raise TraceToolError(f"{path}: its BOS token is {bos}; REF's model's is {want}")
        for note in notes:
            print(f"note: {note}", file=sys.stderr, flush=True)
        if pictures:
            how = "; ".join(["images: PNG files rebuilt from REF's pixel_values, through its Conversation API", *fixes])
            self.name = f"{self.name[:-1]}; {how})"
        if clips:
            how = (
                f"audio: {Path(self.clip.path).name}'s waveform through its Conversation API, its own log-mel features"
            )
            self.name = f"{self.name[:-1]}; {'; '.join([how, *fixes])})"
        self.ready = True

    def prepare(self, input_ids=None, extra_inputs=None) -> None:
        """Export (or take from the artifact cache) the bundle, or check the user's, and load it."""
        if not self.ready:
            ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)] if input_ids is not None else []
            self._load(ids, dict(extra_inputs or {}))

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        super().close()

    def _next(self, phase: str) -> TokenOnly:
        reply = self.child.call("next", list(self.context), self.runs, phase=phase)
        if len(reply) > 2:  # the token showed no text (engine.py): said, as the trace holds an id
            print(f"note: {phase}: LiteRT-LM's token {reply[1]}: {reply[2]}", file=sys.stderr, flush=True)
        return TokenOnly(reply[1])

    def prefill(self, input_ids, extra_inputs, probe):
        self.prepare()
        self.context = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        return self._next(self.phase(True))

    def decode(self, token_id, position, probe):
        self.context = self.context[:position] + [int(token_id)]
        return self._next(self.phase(False))


def images_of(loaded, extra: dict) -> list:
    """REF's images as (H, W, 3) uint8 arrays rebuilt from its pixel_values (each real patch at its
    image_position_ids), refused in one line unless transformers' processor (REF's checkpoint's) gives
    exactly REF's pixel_values and positions back from each (it did not resize or otherwise change
    the image it was given: a file rebuilt from resized patches would not be REF's input)."""
    bad = sorted(k for k in extra if k not in ("pixel_values", "image_position_ids", "mm_token_type_ids"))
    if bad:
        raise TraceToolError(f"--runtime litert-lm takes images and text only; REF has {', '.join(bad)}")
    if "image_position_ids" not in extra:
        raise TraceToolError("pixel_values given without image_position_ids")
    p = int(loaded.config.vision_config.patch_size)
    pixels = np.asarray(torch.as_tensor(extra["pixel_values"]).float().numpy(), np.float32)
    places = np.asarray(torch.as_tensor(extra["image_position_ids"]).numpy())
    if pixels.ndim != 3 or pixels.shape[-1] != 3 * p * p or places.shape[:2] != pixels.shape[:2]:
        raise TraceToolError(f"REF's pixel_values {tuple(pixels.shape)} are not patches of 3 x {p} x {p} pixels")
    try:
        from PIL import Image
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(loaded.model_dir))
    except Exception as e:  # noqa: BLE001 - one line
        raise TraceToolError(f"--runtime litert-lm: REF's image processor does not load ({str(e)[:160]})") from None
    out = []
    for i in range(pixels.shape[0]):
        real = (places[i] >= 0).all(axis=-1)
        xy = places[i][real]
        w, h = (xy.max(axis=0) + 1) * p if real.any() else (0, 0)
        if int(w // p) * int(h // p) != int(real.sum()):  # not a whole grid of patches: no image file's
            raise TraceToolError(f"--runtime litert-lm: REF's image {i + 1} is not a whole grid of patches")
        image = np.zeros((int(h), int(w), 3), np.uint8)
        for row, (x, y) in zip(pixels[i][real], xy):
            image[y * p : (y + 1) * p, x * p : (x + 1) * p] = np.clip(np.round(row.reshape(p, p, 3) * 255), 0, 255)
        again = processor(images=[Image.fromarray(image)], return_tensors="np") if real.any() else {}
        if not (
            np.array_equal(np.asarray(again.get("pixel_values", [None]))[0], pixels[i])
            and np.array_equal(np.asarray(again.get("image_position_ids", [None]))[0], places[i])
        ):
            raise TraceToolError(
                f"--runtime litert-lm takes an image as a file, and REF's image {i + 1} is no file's: transformers' "
                "processor does not give REF's pixel_values back from the image its patches make (it resized or "
                "rescaled the original), so LiteRT-LM would not see REF's pixels"
            )
        out.append(image)
    return out


def image_runs(loaded, ids: list[int], count: int) -> list[tuple[int, int]]:
    """Each image's <|image> ... <image|> positions in REF's prompt, one run an image."""
    boi, eoi = int(loaded.config.boi_token_id), int(loaded.config.eoi_token_id)
    runs = []
    for a, t in enumerate(ids):
        if t == boi:
            b = next((j for j in range(a + 1, len(ids)) if ids[j] == eoi), None)
            if b is None:
                raise TraceToolError(f"REF's prompt opens an image at position {a} and never closes it")
            runs.append((a, b))
    if len(runs) != count:
        raise TraceToolError(f"REF's prompt has {len(runs)} image runs for {count} images")
    return runs


def create(loaded, max_seq: int, choice=None):
    return LiteRTLM(loaded, max_seq, audio=choice.file("audio") if choice is not None else None)


def run_bundle(loaded, max_seq: int, path, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --litertlm FILE`: LiteRT-LM on the user's bundle (litert/spec.py); the engine
    checks the bundle's BOS token against REF's model when it loads it."""
    return LiteRTLM(loaded, max_seq, path, audio=choice.file("audio") if choice is not None else None)
