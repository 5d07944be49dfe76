"""What a built-in runtime is, as a type: `RuntimeSpec` and its facets.

A runtime family (replayer/runtimes/*_spec.py, */spec.py) declares its rows with these types and
nothing else; the registry (registry.py) discovers the families, parses `--runtime` and checks a
choice against its row. A facet is one thing a runtime may have, typed, so that what the
command line, the replay driver and the docs do with it is written once:

- `Export`: the artifacts it builds, written by `trace export --runtime NAME -o OUT` (and the
  family's `trace export-*` alias);
- `FileInput`: a file of the user's it runs (`--gguf FILE`): the option, the check of its header
  before the model loads, and how the file reaches the engine;
- `Baseline`: the run whose trace is its natural `--baseline` (a runtime, or the static runtime
  on the weights of RUN's own file);
- `Decoders`: the Gemma 4 text decoders it runs, where it cannot run every one (a dense decoder
  only: no KV sharing, per-layer inputs or MoE): a REF of another is refused before the model loads;
- tokens-only (a capture map without rows), with `media`: the prompt media such an engine takes
  itself (an image or audio file through its own API, no tower kind captured), and `recipe` (a
  quantized runtime a precision recipe can vary).

Nothing here imports torch or an engine: the command line reads the rows before anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import captures as C


@dataclass(frozen=True)
class Export:
    """`trace export --runtime NAME -o OUT`: what the runtime's artifacts are and which of the
    command's options its builder takes. `function` ("module:function") is called with an
    `ExportRequest` and returns the summary line."""

    alias: str  # the family's own command, kept: "export-onnx"
    function: str
    output: str  # what -o names: "folder for prefill.onnx and decode.onnx"
    doing: str  # the progress line's words while it builds: "exporting the ONNX graphs"
    file: bool = False  # -o is one file (a GGUF), not a folder
    max_seq: bool = True  # needs --max-seq (the static length of its graphs)
    prefill_chunk: bool = False  # takes --prefill-chunk
    calibrate: bool = False  # takes --calibrate REF.h5 (the prompt a quantized build calibrates on)


@dataclass(frozen=True)
class ExportRequest:
    """One export, as `trace export` (or an alias) parsed it: handed to `Export.function`."""

    model_dir: str | None
    runtime: str  # the row's name (with its :TYPE where it takes one)
    type: str | None  # the :TYPE, for a runtime with types
    out: str
    force: bool = False
    max_seq: int | None = None
    prefill_chunk: int | None = None
    calibration_prompt: tuple | None = None  # (ids, extra inputs) of --calibrate's REF

    def basics(self) -> tuple:
        """(model_dir, runtime, max_seq, out, force): what every builder reads."""
        return self.model_dir, self.runtime, self.max_seq, self.out, self.force


@dataclass(frozen=True)
class FileInput:
    """A file of the user's that a runtime runs instead of the tool's own conversion.

    `check` ("module:function") reads the file's header within bounds before any model loads:
    `check(path) -> header` or one line; `create` ("module:function") hands it to the engine:
    `create(loaded, max_seq, header, allow_config_mismatch, base) -> runtime`, where `base()`
    makes the row's own runtime (for a file that only brings weights). The header's config is
    compared with REF's checkpoint there, a difference refused unless --allow-config-mismatch."""

    option: str  # "--gguf"
    runtime: str  # the row that runs it
    what: str  # "a GGUF file" (in refusals)
    help: str
    check: str
    create: str
    extra: str | None = None  # the pip extra its reader needs
    needs: tuple[str, ...] = ()  # modules its reader and engine need
    weightless: bool = True  # the engine never computes with HF's weights: the model loads without them
    float32_only: bool = False  # replays against float32 references only
    # a file that goes with the row's own run or its other file input (--mmproj with llama.cpp or
    # --gguf) instead of replacing it: `create(loaded, header, allow_config_mismatch) -> notes` checks
    # it against REF's checkpoint, and the runtime finds it in RuntimeChoice.files
    companion: bool = False

    @property
    def dest(self) -> str:
        """The option's keyword: "--weights-from" -> "weights_from"."""
        return self.option.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Baseline:
    """The run whose trace is a runtime's natural `--baseline`: `runtime`, on the weights of RUN's
    own file when `weights` names the file input that takes them (llama.cpp: the static runtime
    with --weights-from the GGUF)."""

    runtime: str
    weights: str | None = None

    def __str__(self) -> str:
        return self.runtime + (f" {self.weights}" if self.weights else "")


@dataclass(frozen=True)
class Decoders:
    """The Gemma 4 text decoders a runtime runs, where it cannot run every one: a REF whose model
    config has a feature it lacks is refused before the model loads (registry.check_inputs), in one
    line: "--runtime NAME runs `what` only: this checkpoint has ..."."""

    what: str  # "dense Gemma 4 text decoders"
    kv_sharing: bool = False  # layers that reuse another layer's K/V (num_kv_shared_layers > 0)
    per_layer_inputs: bool = False  # per-layer embeddings, PLE (hidden_size_per_layer_input > 0)
    moe: bool = False  # mixture-of-experts blocks (enable_moe_block)

    def lacks(self, config: dict) -> list[str]:
        """What a model config (config.json's dict, or its text_config) has that this runtime cannot
        run, in words ([] when it runs it)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        shared, ple = _count(text.get("num_kv_shared_layers")), _count(text.get("hidden_size_per_layer_input"))
        out = []
        if not self.kv_sharing and shared:
            out.append(f"KV sharing (num_kv_shared_layers {shared})")
        if not self.per_layer_inputs and ple:
            out.append(f"per-layer inputs (PLE: hidden_size_per_layer_input {ple})")
        if not self.moe and text.get("enable_moe_block") is True:
            out.append(f"MoE blocks (enable_moe_block, {_count(text.get('num_experts'))} experts)")
        return out


def _count(value) -> int:
    """A config's count as read from an untrusted REF: an int above 0, else 0 (another type is the
    model loader's to refuse)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass(frozen=True)
class RuntimeSpec:
    """What one built-in runtime is, needs and can do."""

    name: str  # the --runtime name ("llama.cpp"; with `types`, "llama.cpp:Q8_0" too)
    # (third_party below: an adapter to another project's engine, whose failures are one line naming
    # the adapter's code, as a plug-in's are; the project's own runtimes' failures are its bugs)
    factory: str  # "module:function", imported only when the runtime is made
    what: str  # what runs (the README table's second column)
    precision: str
    extra: str | None = None  # the pip extra that installs what it needs
    needs: tuple[str, ...] = ()  # importable modules it needs (checked with importlib.util.find_spec)
    image_needs: tuple[str, ...] = ()  # the modules an image prompt needs besides those (checked where REF has one)
    native_audio_features: bool = False  # computes an audio prompt's features itself (--audio-features native)
    tools: tuple[tuple[str, str], ...] = ()  # (program on PATH it needs, how to install it)
    types: tuple[str, ...] = ()  # ":TYPE" suffixes it takes; the first is the default (and a recipe's float)
    float_types: tuple[str, ...] = ()  # those of its types that do not quantize
    isolation: bool = False  # continues with the tensors the probe returns (--isolate)
    # takes token ids only: an image prompt is refused before the model loads (a str: why, said in that line)
    text_only: bool | str = False
    float32_only: bool = False  # a bfloat16 REF is refused before the model loads
    cpu_only: bool = False  # --device cuda is refused before the model loads
    weightless: bool = False  # never computes with HF's weights: the model is built without them
    profile: str | None = None  # its float tolerance profile (diff/profiles/NAME.toml), where its kernels need one
    export: Export | None = None  # the artifacts `trace export --runtime NAME` writes
    artifacts: str = ""  # what it builds (kept in the artifact cache)
    doc: str | None = None  # its docs page
    # a quantized runtime a precision recipe (trace precision) can vary: "module:function" making it
    # with the recipe's units at their precisions, (loaded, max_seq, choice, units) -> runtime
    recipe: str | None = None
    baseline: Baseline | None = None  # the run whose trace is its natural --baseline
    third_party: bool = True  # False: the project's own runtime (static and its quantized variants)
    decoders: Decoders | None = None  # the text decoders it runs, where not every Gemma 4 one (None: every one)
    # the prompt media ("image", "audio") a tokens-only engine takes itself, through its own API (LiteRT-LM's
    # conversation: image and audio files): its towers run inside the engine, none of their kinds captured
    media: tuple[str, ...] = ()
    # what its adapter reads from its engine, as which kinds (captures.py): what it captures is derived from it
    capture_map: C.CaptureMap = field(kw_only=True)

    @property
    def not_captured(self) -> tuple[str, ...]:
        """The canonical kinds it cannot expose (absent, never zeros): those its capture map lacks."""
        return self.capture_map.not_captured()

    @property
    def runs_audio(self) -> bool:
        """Runs an audio prompt's audio tower: its capture map declares the audio tower's kinds, or its
        engine takes audio itself (`media`); an audio REF is refused before the model loads by every
        other row (registry.check_inputs)."""
        return "audio" in self.capture_map.towers or "audio" in self.media

    @property
    def tokens_only(self) -> bool:
        """An engine that gives the chosen token alone (text out): no logits, no tensor kinds."""
        return not self.capture_map.rows

    def kinds_text(self) -> str:
        return self.capture_map.text()
