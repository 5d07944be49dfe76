"""Loading Gemma 4 checkpoints (safetensors only, never remote code) and describing them.

No torch or transformers import at module level: the CLI asks embedded_model_dir() and
EMBEDDED_NAME from here in commands that must start without torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path

from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces.errors import TraceToolError, install_hint, one_line

from . import config_check, memory

EMBEDDED_NAME = "tiny-gemma4 (embedded)"
# the same text and vision weights with an audio tower (scripts/build_tiny_audio_model.py): a second
# folder, so that the text and image goldens and every runtime's artifacts of the first stay as they are
EMBEDDED_AUDIO_NAME = "tiny-gemma4-audio (embedded)"


def embedded_model_dir() -> Path:
    """The tiny checkpoint shipped with the package (hf/tiny_model in the repository): the one
    place that knows where it lives."""
    return Path(str(files("gemma4_trace.hf") / "tiny_model"))


def embedded_audio_model_dir() -> Path:
    """The tiny checkpoint with an audio tower (hf/tiny_audio_model): the default for audio prompts."""
    return Path(str(files("gemma4_trace.hf") / "tiny_audio_model"))


def embedded_dir(model_name: str) -> Path | None:
    """The folder of the embedded model a trace names (its provenance's model_name), else None."""
    return {EMBEDDED_NAME: embedded_model_dir, EMBEDDED_AUDIO_NAME: embedded_audio_model_dir}.get(
        model_name, lambda: None
    )()


# what `trace record` asks the embedded model when no prompt is given
DEMO_PROMPT = "Tell me a story."
DEMO_IMAGE_PROMPT = "Describe the image."
DEMO_IMAGE = embedded_model_dir() / "example.png"
DEMO_WIDE_IMAGE = embedded_model_dir() / "example_wide.png"  # another size: two images pad differently
DEMO_AUDIO_PROMPT = "Transcribe the audio."
DEMO_AUDIO = embedded_audio_model_dir() / "example.wav"  # espeak-ng reading DEMO_AUDIO_TEXT, 22.05 kHz
DEMO_AUDIO_TEXT = "The quick brown fox jumps over the lazy dog."
GEMMA4_TYPES = ("gemma4", "gemma4_text")
# config keys that say nothing about the network: left out of the config hash
VOLATILE_CONFIG_KEYS = (
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "architectures",
    "_commit_hash",
)
DTYPES = ("float32", "bfloat16")


@dataclass
class LoadedModel:
    model: object  # Gemma4ForConditionalGeneration | Gemma4ForCausalLM, eval mode
    processor: object | None  # processor (image+text) or tokenizer or None
    name: str
    model_dir: Path
    dtype: str
    device: str
    # the weights serve one runtime only (`trace replay`): a runtime may free what it has
    # converted (the quantized static runtimes free each float weight once quantized)
    single_use: bool = False

    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def has_weights(self) -> bool:
        """False for a model built without its weights (load_model(weights=False))."""
        return not any(p.is_meta for p in self.model.parameters())

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def multimodal(self) -> bool:
        return getattr(self.model.config, "vision_config", None) is not None


def resolve_model_dir(model_dir: str | Path | None, audio: bool = False) -> tuple[Path, str]:
    """The folder to load and the name a trace records for it (never an absolute path); with no
    folder, the embedded model (the one with an audio tower for an audio prompt)."""
    if model_dir is None:
        return (embedded_audio_model_dir(), EMBEDDED_AUDIO_NAME) if audio else (embedded_model_dir(), EMBEDDED_NAME)
    path = Path(model_dir)
    return path, path.resolve().name


def read_config_json(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise TraceToolError(f"model folder {model_dir} does not exist")
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise TraceToolError(f"{model_dir} has no config.json; pass a save_pretrained folder")
    data = config_check.load(cfg)  # an object of the shape every reader relies on, or one line
    mtype = data.get("model_type")
    if mtype not in GEMMA4_TYPES:
        raise TraceToolError(f"{model_dir} holds a {mtype!r} model, not Gemma 4 (model_type gemma4 or gemma4_text)")
    return data


def config_dict(config) -> dict:
    """The config as JSON-ready data, without keys that do not change the network."""
    d = config.to_dict()

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VOLATILE_CONFIG_KEYS}
        return x

    return strip(d)


def config_sha256(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def load_model(
    model_dir: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder=None,
    weights: bool = True,
    audio: bool = False,
) -> LoadedModel:
    """Load a Gemma 4 checkpoint folder (None: the embedded one, with its audio tower if `audio`);
    raise TraceToolError (one line) on anything wrong.

    device_map ("auto" or an explicit map) places the model with accelerate (extra [big]) over
    the GPUs, the CPU (max_memory {device: size}) and disk (offload_folder), for a model larger
    than one device; then `device` is where its inputs go (the embeddings' device).
    `weights=False`: the model is built on the meta device from its config (shapes, no values,
    no memory), for a runtime that never computes with HF's weights (llama.cpp on a cached or a
    user's GGUF); `has_weights` says which.
    """
    path, name = resolve_model_dir(model_dir, audio)
    data = read_config_json(path)
    if not any(path.glob("*.safetensors")):
        raise TraceToolError(f"{path} has no *.safetensors weights (only safetensors are loaded)")
    if dtype not in DTYPES:
        raise TraceToolError(f"--dtype must be one of {', '.join(DTYPES)}")
    # a config can claim any size (10^6 layers): refuse what cannot fit before building it
    memory.check_config(data, f"{path}/config.json")
    if device_map is None:  # a device map offloads what does not fit: that is its point
        if weights:  # (a model built without its weights takes no memory)
            LIM.check_fits(memory.model_bytes(data, 2 if dtype == "bfloat16" else 4), f"the model in {path}")
    else:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise TraceToolError(f"--device-map needs accelerate: {install_hint('big')}") from None

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise TraceToolError("--device cuda given but no CUDA device is available")
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cls = Gemma4ForConditionalGeneration if data["model_type"] == "gemma4" else Gemma4ForCausalLM
    if not weights:
        try:
            config = cls.config_class.from_pretrained(path, local_files_only=True)
            with torch.device("meta"):
                model = cls._from_config(config, dtype=getattr(torch, dtype))
        except Exception as e:  # noqa: BLE001 - transformers' loader on the user's config (strict-dataclass errors too)
            raise TraceToolError(f"cannot load {path}: {one_line(e, 300)}") from None
        return LoadedModel(model.eval(), _load_processor(path), name, path, dtype, device)
    placement = (
        {} if device_map is None else dict(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    )
    try:
        model = cls.from_pretrained(
            path,
            dtype=getattr(torch, dtype),
            use_safetensors=True,
            local_files_only=True,
            trust_remote_code=False,
            **placement,
        )
    except Exception as e:  # noqa: BLE001 - transformers' loader on the user's files: a damaged file, a config it rejects
        raise TraceToolError(f"cannot load {path}: {one_line(e, 300)}") from None
    if device_map is None:
        model.to(device)
    else:
        device = _input_device(model)
    model.eval()
    return LoadedModel(model, _load_processor(path), name, path, dtype, device)


def _input_device(model) -> str:
    """Where a device-mapped model's inputs go: where its input embeddings execute.

    accelerate dispatches (and sets `hf_device_map`) only a model spread over several devices
    or offloaded to disk; a model that fits on one device (any checkpoint class) is simply
    placed there. Disk-offloaded modules execute on the CPU.
    """
    embeddings = model.get_input_embeddings()
    placed = getattr(model, "hf_device_map", None)
    if not placed:
        return str(embeddings.weight.device)
    name = next(n for n, m in model.named_modules() if m is embeddings)
    owners = [k for k in placed if k == "" or name == k or name.startswith(k + ".")]
    where = placed[max(owners, key=len)] if owners else "cpu"
    if isinstance(where, int):
        return f"cuda:{where}"
    return "cpu" if where == "disk" else str(where)


def _load_processor(path: Path):
    """A processor when the folder has one, else a tokenizer, else None."""
    from transformers import AutoProcessor, AutoTokenizer

    has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    has_proc = any((path / f).exists() for f in ("processor_config.json", "preprocessor_config.json"))
    try:
        if has_proc:
            try:
                return AutoProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            except ImportError as e:
                if "orchvision" not in str(e):
                    raise
                return _processor_without_torchvision(path)
        if has_tok:
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer file fails in transformers' many ways (KeyError: ...)
        raise TraceToolError(
            f"cannot load the tokenizer/processor in {path}: {type(e).__name__}: {one_line(e, 200)}"
        ) from None
    return None


class Decoder:
    """decode(ids) -> text, or None when some id is not in the tokenizer's vocabulary.

    Token ids come from a trace (untrusted: a buggy runtime's dump may hold any int64), and the
    tokenizer takes only its own ids: it would skip an unknown id below 2^32 without a word and
    fail on a larger one. An id outside the vocabulary means no text; `unknown(ids)` says which."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def unknown(self, ids) -> tuple[int, int] | None:
        """(index, id) of the first id outside the tokenizer's vocabulary, or None."""
        for i, t in enumerate(ids):
            if not 0 <= int(t) < self.vocab_size:
                return i, int(t)
        return None

    def __call__(self, ids) -> str | None:
        if self.unknown(ids) is not None:
            return None
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def decoder_for(tokenizer_json: Path | None) -> Decoder | None:
    """A Decoder from a tokenizer.json via the `tokenizers` package (no torch), or None."""
    if tokenizer_json is None or not tokenizer_json.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return Decoder(Tokenizer.from_file(str(tokenizer_json)))
    except Exception:  # noqa: BLE001 - any unreadable tokenizer just means no text
        return None


def _processor_without_torchvision(path: Path):
    """Gemma4Processor for images and text where torchvision (needed only for video) is missing.

    transformers 5.24 type-checks the mandatory video processor against
    VideoProcessorMixin, which it exports only with torchvision installed. Images use the
    PIL image processor, so a placeholder video processor is enough here.
    """
    import transformers.processing_utils as pu
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer, Gemma4Processor
    from transformers.video_processing_utils import VideoProcessorMixin

    if not hasattr(pu.transformers_module, "VideoProcessorMixin"):
        pu.transformers_module.VideoProcessorMixin = VideoProcessorMixin
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = json.loads((path / "processor_config.json").read_text())
    return Gemma4Processor(
        feature_extractor=AutoFeatureExtractor.from_pretrained(path, local_files_only=True),
        image_processor=AutoImageProcessor.from_pretrained(path, local_files_only=True),
        tokenizer=tok,
        video_processor=VideoProcessorMixin(),
        chat_template=tok.chat_template,
        image_seq_length=cfg.get("image_seq_length", 280),
    )


def provenance(lm: LoadedModel, runtime: str, mode: str) -> dict:
    import h5py
    import torch
    import transformers

    cfg = config_dict(lm.config)
    return dict(
        creator_version=version("gemma4-trace"),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        h5py_version=h5py.__version__,
        dtype=lm.dtype,
        device=lm.device,
        runtime=runtime,
        mode=mode,
        model_name=lm.name,
        model_config=cfg,
        model_config_sha256=config_sha256(cfg),
    )


def config_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two config dicts."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        name = f"{prefix}{k}"
        if k not in a or k not in b:
            out.append(name)
        elif isinstance(a[k], dict) and isinstance(b[k], dict):
            out += config_differences(a[k], b[k], name + ".")
        elif a[k] != b[k]:
            out.append(name)
    return out


def load_for_reference(prov: dict, model_dir=None, device: str = "cpu", weights: bool = True) -> LoadedModel:
    """Load the model a trace was recorded with (its dtype), checking the config hash;
    `weights=False` builds it without its weights (load_model).

    `model_dir` None means the embedded model, which only fits traces recorded from it:
    a trace stores the model's folder name, never its path.
    """
    if model_dir is None and embedded_dir(prov["model_name"]) is None:
        raise TraceToolError(
            f"the reference was recorded with model {prov['model_name']!r}; pass its folder with --model"
        )
    audio = model_dir is None and prov["model_name"] == EMBEDDED_AUDIO_NAME  # the embedded audio variant
    lm = load_model(model_dir, dtype=prov["dtype"], device=device, weights=weights, audio=audio)
    cfg = config_dict(lm.config)
    if config_sha256(cfg) != prov["model_config_sha256"]:
        try:
            ref_cfg = json.loads(prov["model_config"])
        except ValueError:
            ref_cfg = {}
        diff = config_differences(ref_cfg, cfg)
        shown = ", ".join(diff[:8]) + (f" (+{len(diff) - 8} more)" if len(diff) > 8 else "")
        raise TraceToolError(
            f"the model in {lm.model_dir} differs from the one the reference was recorded with "
            f"(config fields differ: {shown or 'unknown'})"
        )
    return lm
