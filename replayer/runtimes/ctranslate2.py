"""`--runtime ctranslate2`: REF's checkpoint converted by CTranslate2's own converter and run by its
C++ engine on the CPU, in the child process (extra `gemma4-trace[ctranslate2]`).

CTranslate2 4.8.5 converts dense Gemma 4 text decoders (`ctranslate2.converters.TransformersConverter`,
its `Gemma4Loader`: no KV sharing, no per-layer inputs, no MoE; the 31B shape) into its own
`model.bin` and runs them with its own C++ Transformer decoder: an implementation independent of
PyTorch. The conversion is kept in the artifact cache (replayer/artifacts.py), keyed by the
checkpoint's content hash, the versions of CTranslate2 and transformers and this code.

Its Python API gives logits only (`Generator.forward_batch(ids)`: the logits of every position of
a sequence, from one pass over it with no cache kept), so the trace holds logits and tokens and
`trace diff` lists every other kind as not compared. Each step's logits are the last row of
forward_batch over the step's whole prefix: the prompt at the prefill, the prompt and the tokens fed
so far at decode step s (teacher-forced: REF's; free-running: its own). So every step is
CTranslate2's one-pass forward over a sequence (what `generate_batch(..., include_prompt_in_result=
False)` runs over a prompt, and `score_batch` over a text), never its incremental decoding with a KV
cache; a step costs a pass over its whole prefix.

Two shims, on the config the converter loads (transformers 5.24 keeps Gemma 4's head dims per layer,
in `per_layer_config`; the converter reads the older global fields; the checkpoint folder is never
written to):
- `text_config.head_dim` raises AmbiguousGlobalPerLayerAttributeError on such a config: we set
  `allow_global_per_layer_attribute_access`, whose global value is the sliding layers' head_dim (what
  the converter uses it for);
- the converter takes the full-attention layers' head_dim from `global_head_dim` (and their K/V heads
  from `num_global_key_value_heads`), which 5.24 folds into `per_layer_config` and drops: we set them
  from the full layers' per-layer values (all equal, else refused).
The converter also loads the checkpoint's tokenizer for its vocabulary (token strings); the replay
feeds token ids, so a stand-in with no tokens is given instead (the converter names the ids
`<extra_id_N>`), and a checkpoint without a tokenizer converts too. Each fix is said once on stderr
and kept in the trace's provenance (the runtime's name).
"""

from __future__ import annotations

import sys

import torch

from gemma4_trace.hf.model import config_dict
from gemma4_trace.traces.errors import TraceToolError

from ..artifacts import artifact_folder, code_digest, model_hash
from ..child import ChildRuntime
from ..functional import quiet
from . import head_fixes
from .ctranslate2_engine import ENGINE
from .ctranslate2_spec import RUNTIMES
from .registry import check_decoder

FORMAT = 1  # bump when what is saved changes (the cache key holds it)
_SAID: set = set()  # the model folders whose config fixes this process has said


def config_fixes(config: dict) -> dict:
    """{attribute: value} to set on the loaded text config so that CTranslate2 4.8.5's converter reads
    a transformers-5.24 Gemma 4 config as transformers does (module docstring, head_fixes.py); one
    line where no fix can (full-attention layers that differ among themselves)."""
    return head_fixes.config_fixes(config, "ctranslate2")


def fixes_words(config: dict, fixes: dict) -> str:
    """The fixes in words, for stderr and the provenance."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    words = [f"head_dim read as the sliding layers' {text.get('head_dim')} (allow_global_per_layer_attribute_access)"]
    words += head_fixes.fixes_words(fixes)
    return "; ".join(words)


class _NoTokens:
    """A tokenizer with no tokens, for the converter's vocabulary: the replay feeds token ids."""

    bos_token, unk_token, eos_token, chat_template = "<bos>", "<unk>", "<eos>", None

    def get_vocab(self) -> dict:
        return {}


def convert(model_dir, folder, fixes: dict) -> None:
    """The checkpoint converted by CTranslate2's TransformersConverter (float32 weights) into folder."""
    import ctranslate2

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_model(self, model_class, model_name_or_path, **kwargs):
            top = kwargs["config"]
            for c in {id(top): top, id(top.get_text_config()): top.get_text_config()}.values():
                if hasattr(c, "allow_global_per_layer_attribute_access"):
                    c.allow_global_per_layer_attribute_access = True
            for key, value in fixes.items():
                setattr(top.get_text_config(), key, value)
            return super().load_model(model_class, model_name_or_path, **kwargs)

        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return _NoTokens()

    with quiet():
        Converter(str(model_dir)).convert(str(folder), quantization="float32", force=True)


def cache_key(loaded) -> dict:
    from importlib.metadata import version

    return {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "ctranslate2": version("ctranslate2"),
        "transformers": version("transformers"),
        "code": code_digest("runtimes/ctranslate2.py"),
    }


class CTranslate2Runtime(ChildRuntime):
    """CTranslate2's Generator in the child; each step sends the whole prefix and gets the last row's logits."""

    def __init__(self, loaded, max_seq: int):
        from importlib.metadata import version

        config = config_dict(loaded.config)
        check_decoder(RUNTIMES[0], config)  # refused before the model loads by trace replay (registry.check_inputs)
        self.loaded, self.max_seq = loaded, max_seq
        self.fixes = config_fixes(config)
        words = fixes_words(config, self.fixes)
        self.version = version("ctranslate2")
        self.name = (
            f"ctranslate2 (ctranslate2 {self.version}, CPU, float32; converted by its TransformersConverter, "
            f"config fixed: {words}; logits: forward_batch over each step's prefix)"
        )
        key = str(loaded.model_dir)
        if key not in _SAID:
            print(f"ctranslate2: the config CTranslate2's converter reads, fixed: {words}", file=sys.stderr)
            _SAID.add(key)
        self.seq: list[int] = []

    def prepare(self, input_ids, extra_inputs) -> None:
        """The conversion (from the artifact cache, or made now) loaded by CTranslate2 in the child."""
        if self.child is not None:
            return
        art = artifact_folder(
            "ctranslate2",
            cache_key(self.loaded),
            lambda folder: convert(self.loaded.model_dir, folder, self.fixes),
            what=f"converting {self.loaded.name} with CTranslate2's TransformersConverter",
        )
        try:
            child = self.start(f"ctranslate2 (ctranslate2 {self.version})", ENGINE)
            child.call("load", str(art.path), phase="loading")
        except BaseException:
            self.close()
            raise
        finally:
            art.close()

    def _forward(self, prefill: bool) -> torch.Tensor:
        reply = self.child.call("forward", self.seq, phase=self.phase(prefill))
        return torch.from_numpy(reply[1])

    def prefill(self, input_ids, extra_inputs, probe):
        self.prepare(input_ids, extra_inputs)
        self.seq = [int(t) for t in input_ids]
        return self._forward(True)

    def decode(self, token_id, position, probe):
        if int(position) != len(self.seq):
            raise TraceToolError(f"ctranslate2: asked for position {position} after {len(self.seq)} tokens")
        self.seq.append(int(token_id))
        return self._forward(False)


def create(loaded, max_seq: int, choice=None):
    return CTranslate2Runtime(loaded, max_seq)
