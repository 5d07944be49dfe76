"""The built-in runtimes: every family's rows discovered, and `--runtime TEXT` parsed once.

A runtime family declares its rows (spec.py's `RuntimeSpec`, with its facets) in its own spec
module beside its adapter: replayer/runtimes/NAME_spec.py, or spec.py in the family's package.
Each holds `ORDER` (where its rows stand in the table), `RUNTIMES` and, where it runs a file of
the user's, `FILES`. This module finds them (nothing imports torch: the command line reads the
table before anything heavy loads) and is everything that asks "which runtimes exist" or "does
this one support X": the `--runtime` help, the README's runtime table (tests/runtimes/
test_registry.py checks that they agree), the early refusals (an unknown name, a missing extra,
`--isolate`, an image for a text-only runtime, a bfloat16 REF for a float32-only one, `--device
cuda` for a CPU-only one, a user's file for the runtime that runs it), `trace export` and the
replay driver. A row names its factory as "module:function"; a built-in factory is

    create(loaded: LoadedModel, max_seq: int, choice: RuntimeChoice) -> runtime

(the plug-in contract, docs/runtime-api.md, plus the parsed choice). Adding a runtime family:
its adapter module(s) and spec module under replayer/runtimes/, its pyproject extra, its docs
page (docs/runtime-api.md, "Adding a built-in runtime"); no shared table is edited.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError, install_hint

from .spec import Decoders, Export, ExportRequest, FileInput, RuntimeSpec

__all__ = ["Decoders", "Export", "ExportRequest", "FileInput", "RuntimeSpec"]  # the types the rows are made of
DEFAULT = "static"  # --runtime's default
AUDIO_INPUT = "input_features"  # the extra input of an audio REF (its clips' log-mel features)


def _families() -> list:
    """Every family's spec module, in ORDER: NAME_spec.py here and spec.py in each subpackage."""
    here = Path(__file__).parent
    names = [f"{__package__}.{p.stem}" for p in here.glob("*_spec.py")]
    names += [f"{__package__}.{p.parent.name}.spec" for p in here.glob("*/spec.py")]
    modules = sorted((importlib.import_module(n) for n in names), key=lambda m: m.ORDER)
    orders = [m.ORDER for m in modules]
    if len(set(orders)) != len(orders):  # two families claiming one place: a bug of ours
        raise RuntimeError(f"runtime families share an ORDER: {sorted(m.__name__ for m in modules)}")
    return modules


FAMILIES = _families()
RUNTIMES: tuple[RuntimeSpec, ...] = tuple(s for m in FAMILIES for s in m.RUNTIMES)
FILES: tuple[FileInput, ...] = tuple(f for m in FAMILIES for f in getattr(m, "FILES", ()))
BY_NAME = {s.name: s for s in RUNTIMES}
FILE_BY_DEST = {f.dest: f for f in FILES}
if len(BY_NAME) != len(RUNTIMES) or len(FILE_BY_DEST) != len(FILES) or not {f.runtime for f in FILES} <= set(BY_NAME):
    raise RuntimeError("runtime families declare a name twice, or a file input for a runtime none declares")
PLUGIN = "MODULE:FACTORY"


def captures(capture: frozenset[str] | None, kind: str) -> bool:
    """Whether a runtime asked to capture `capture` (RuntimeChoice.capture: None every kind, empty
    none) exposes `kind`; logits always (they are every step's result)."""
    return capture is None or kind == "logits" or kind in capture


@dataclass(frozen=True)
class RuntimeChoice:
    """`--runtime TEXT` parsed: a built-in (its row, and its type where it takes one) or a plug-in."""

    text: str
    spec: RuntimeSpec | None = None  # None: a plug-in
    type: str | None = None  # the ":TYPE" of a runtime with types (its default when not given)
    # the kinds the replay keeps (`--kinds`, with_capture): an adapter whose capture costs by what
    # it exposes (a graph's extra outputs, an interpreter keeping every tensor, hooks) exposes only
    # these; None: every kind; empty: none (tokens and logits only, the runtime alone)
    capture: frozenset[str] | None = None
    files: tuple = ()  # the companion files given ((dest, header, notes), ...): FileInput.companion
    audio_features: str = "hf"  # what feeds an audio tower (--audio-features): HF's features from REF, or native

    @property
    def name(self) -> str:
        """The built-in's name, or the plug-in's MODULE:FACTORY."""
        return self.spec.name if self.spec is not None else self.text

    @property
    def plugin(self) -> bool:
        return self.spec is None

    @property
    def gguf(self) -> bool:
        """A runtime on GGUF files of a type (llama.cpp:TYPE): its precision recipes are mixed GGUF files."""
        return self.spec is not None and bool(self.spec.types)

    @property
    def foreign_code(self) -> str | None:
        """What a failure inside the runtime names (a plug-in's MODULE:FACTORY, a third-party
        adapter's name); None for the project's own runtimes, whose failures are its bugs."""
        return self.text if self.spec is None or self.spec.third_party else None

    def captures(self, kind: str) -> bool:
        """Whether the replay keeps `kind` (logits always: they are every step's result)."""
        return captures(self.capture, kind)

    def with_capture(self, kinds) -> RuntimeChoice:
        """This choice asked to capture only `kinds` (None: every kind; a Selection's kinds)."""
        return replace(self, capture=None if kinds is None else frozenset(kinds) - {"logits", "token"})

    def with_files(self, files) -> RuntimeChoice:
        """This choice with its companion files ((dest, header, notes), ...)."""
        return replace(self, files=tuple(files))

    def file(self, dest: str):
        """(header, notes) of the companion file given by its option's keyword ("mmproj"), or None."""
        return next(((h, n) for d, h, n in self.files if d == dest), None)

    def __str__(self) -> str:
        return self.text


def names_text() -> str:
    """Every built-in name, for help and errors: "static, static-w8, ..., llama.cpp[:TYPE], ..."."""
    return ", ".join(s.name + ("[:TYPE]" if s.types else "") for s in RUNTIMES)


def parse_runtime(text) -> RuntimeChoice:
    """`--runtime TEXT` -> a RuntimeChoice, or one line saying what is wrong with it: an unknown
    name (with the nearest built-in), an unknown type, a MODULE:FACTORY of bad syntax. Nothing is
    imported or looked up (check_available does that)."""
    if isinstance(text, RuntimeChoice):
        return text
    text = str(text)
    name, sep, rest = text.partition(":")
    spec = BY_NAME.get(text) or (BY_NAME.get(name) if sep else None)
    if spec is not None and (spec.name == text or spec.types):
        if not spec.types:
            return RuntimeChoice(text, spec)
        gguf_type = rest if sep else spec.types[0]
        if gguf_type not in spec.types:
            raise TraceToolError(f"unknown GGUF type {gguf_type!r}; expected one of {', '.join(spec.types)}")
        return RuntimeChoice(text, spec, gguf_type)
    if not sep:
        near = difflib.get_close_matches(text, list(BY_NAME), n=1)
        raise TraceToolError(
            f"--runtime {text!r} is not a runtime"
            + (f" (did you mean {near[0]!r}?)" if near else "")
            + f": expected {', '.join(BY_NAME)} or {PLUGIN} (e.g. my_pkg.rt:make_runtime)"
        )
    if not all(part.isidentifier() for part in name.split(".")) or not rest.isidentifier():
        raise TraceToolError(
            f"--runtime {text!r}: {PLUGIN} needs a dotted module name and a function name (e.g. my_pkg.rt:make_runtime)"
        )
    return RuntimeChoice(text)


def check_available(choice, isolate: bool = False) -> RuntimeChoice:
    """Refuse, before any model loads, a runtime that cannot run here: a built-in whose extra is not
    installed, --isolate where it cannot work, a plug-in whose top-level module is not found. Nothing
    is imported (a plug-in's own checks run when it is loaded)."""
    choice = parse_runtime(choice)
    spec = choice.spec
    if spec is None:
        _check_plugin_module(choice.text)
        return choice
    missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise TraceToolError(
            f"--runtime {spec.name} needs {', '.join(missing)}, which is not installed: {install_hint(spec.extra)}"
        )
    for program, how in spec.tools:
        if shutil.which(program) is None:
            raise TraceToolError(f"--runtime {spec.name} needs {program}, which is not on PATH: {how}")
    if isolate and not spec.isolation:
        raise TraceToolError(
            f"runtime {spec.name} does not support --isolate (it does not continue with the tensors "
            "the probe returns); the static runtimes do"
        )
    return choice


def check_capture(choice: RuntimeChoice, kinds) -> None:
    """Refuse, before the model loads, kinds asked of a built-in (`--kinds`) that it cannot capture."""
    if choice.spec is not None:
        choice.spec.capture_map.check(kinds, f"runtime {choice.spec.name}")


def check_inputs(
    choice: RuntimeChoice, *, dtype: str | None = None, extra=None, device: str | None = None, config=None
) -> None:
    """Refuse, before the model loads, a REF this runtime cannot replay: audio for one that runs no
    audio tower (RuntimeSpec.runs_audio), an image for a text-only runtime (or one whose image path
    is not installed), a bfloat16 REF for a float32-only one, a GPU for a CPU-only one, a model
    (`config`: REF's model config, a dict) whose decoder it cannot run (RuntimeSpec.decoders)."""
    spec = choice.spec
    if spec is None:
        return
    if extra and AUDIO_INPUT in extra and not spec.runs_audio:
        raise TraceToolError(
            f"--runtime {spec.name} runs no audio tower (it captures {spec.kinds_text()}); replay an audio REF "
            f"with {', '.join(s.name for s in RUNTIMES if s.runs_audio)}"
        )
    if spec.text_only and extra:
        why = spec.text_only if isinstance(spec.text_only, str) else "replay a text prompt"
        raise TraceToolError(
            f"--runtime {spec.name} runs a text decoder, which takes token ids only; REF's prompt has an image: {why}"
        )
    missing = [m for m in spec.image_needs if importlib.util.find_spec(m) is None] if extra else []
    if missing:
        raise TraceToolError(
            f"--runtime {spec.name} runs an image prompt's vision tower with {', '.join(missing)}, which is not "
            f"installed: {install_hint(spec.extra)}"
        )
    if spec.float32_only and dtype is not None and dtype != "float32":
        raise TraceToolError(f"--runtime {spec.name} runs in float32; REF was recorded in {dtype}")
    if spec.cpu_only and device not in (None, "cpu"):
        raise TraceToolError(f"--runtime {spec.name} runs on the CPU; drop --device")
    check_decoder(spec, config)


def check_decoder(spec: RuntimeSpec, config) -> None:
    """Refuse a model config (a dict; None: not known yet) whose text decoder the row's `decoders`
    facet does not run, in one line naming what the checkpoint has."""
    lacks = spec.decoders.lacks(config) if spec.decoders is not None and isinstance(config, dict) else []
    if lacks:
        raise TraceToolError(
            f"--runtime {spec.name} runs {spec.decoders.what} only: this checkpoint has {' and '.join(lacks)}"
        )


def _check_plugin_module(text: str) -> None:
    module_name = text.partition(":")[0]
    top = module_name.split(".")[0]
    cwd = os.getcwd()  # found as the replay will import it: the current folder first
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        if added:
            sys.path.remove(cwd)
    if not found:
        raise TraceToolError(
            f"cannot import runtime plug-in module {module_name!r} (--runtime {text!r}): no module "
            f"{top!r} is installed or in the current folder"
        )


def quantized_runtime(name: str) -> RuntimeSpec | None:
    """The registry row of a trace's provenance runtime name when that runtime quantizes (static-w8,
    llama.cpp:Q8_0, mlx-q4, a recipe's static-w8+recipe, a quantized plug-in's bug+w8: the static
    scheme's row), else None: a float runtime, or a name the registry does not know."""
    base, *marks = str(name).split("+")
    for m in marks:
        if _SCHEME_MARK.fullmatch(m):
            return BY_NAME.get(f"static-{m}", BY_NAME["static-w8"])
    try:
        choice = parse_runtime(base)
    except TraceToolError:
        return None
    spec = choice.spec
    if spec is None:
        return None
    if spec.types:
        return spec if choice.type not in spec.float_types else None
    return spec if spec.precision.startswith("quantized") else None


_SCHEME_MARK = re.compile(r"w\d+(?:g\d+)?(?:a\d+)?")  # a static scheme in a derived name: bug+w8, x+w4g32


def exporters() -> list[RuntimeSpec]:
    """The runtimes `trace export --runtime NAME` writes the artifacts of."""
    return [s for s in RUNTIMES if s.export is not None]


def exporter(alias: str) -> list[RuntimeSpec]:
    """The runtimes a family's own export command (`trace export-onnx`, ...) writes for."""
    return [s for s in RUNTIMES if s.export is not None and s.export.alias == alias]


def check_export(choice, command: str = "export") -> RuntimeChoice:
    """Refuse `trace export --runtime NAME` (or the family's alias, `command`) in one line for a
    runtime that builds no artifacts or whose extra is not installed."""
    choice = parse_runtime(choice)
    if choice.spec is None or choice.spec.export is None:
        raise TraceToolError(
            f"--runtime {choice.text} builds no artifacts to export; these do: {', '.join(s.name for s in exporters())}"
        )
    spec = choice.spec
    missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise TraceToolError(
            f"trace {command} needs {', '.join(missing)}, which is not installed: {install_hint(spec.extra)}"
        )
    return choice


def run_export(choice: RuntimeChoice, request: ExportRequest) -> str:
    """Build (or take from the artifact cache) the runtime's artifacts and write them where
    `request.out` says; the summary line."""
    module, _, function = choice.spec.export.function.partition(":")
    return getattr(importlib.import_module(module), function)(request)


def resolve_file(choice, files: dict, *, isolate: bool = False, recipe=None) -> tuple[RuntimeChoice, FileInput | None]:
    """The runtime a replay runs when a file of the user's is given (`files`: {dest: path or None},
    e.g. {"gguf": "m.gguf"}), with its file input; one line for a combination it cannot run: two
    files, a --runtime other than the one that runs the file, --isolate or --recipe where that
    runtime cannot take them, a reader not installed. No file: the choice as it was."""
    choice = parse_runtime(choice)
    given = [FILE_BY_DEST[d] for d, path in files.items() if path is not None and not FILE_BY_DEST[d].companion]
    if not given:
        return choice, None
    if len(given) > 1:
        a, b = given[:2]
        raise TraceToolError(f"{a.option} runs {a.what} in {a.runtime}, {b.option} in {b.runtime}: give one")
    (fi,) = given
    if choice.text not in (DEFAULT, fi.runtime):
        raise TraceToolError(f"{fi.option} FILE is run by --runtime {fi.runtime}; it takes no --runtime {choice.text}")
    if isolate and not BY_NAME[fi.runtime].isolation:
        raise TraceToolError(f"runtime {fi.runtime} does not support --isolate")
    if recipe is not None:
        raise TraceToolError(f"--recipe is for the quantized static runtimes; {fi.what} brings its own quantization")
    for module in fi.needs:
        if importlib.util.find_spec(module) is None:
            raise TraceToolError(f"{fi.option} needs {module}, which is not installed: {install_hint(fi.extra)}")
    return parse_runtime(fi.runtime), fi


def companion_files(choice: RuntimeChoice, files: dict) -> list[FileInput]:
    """The companion files given (`files` as resolve_file's), each refused in one line unless the
    replay runs its row (`choice`: after resolve_file) and its reader is installed."""
    out = []
    for dest, path in files.items():
        fi = FILE_BY_DEST[dest]
        if path is None or not fi.companion:
            continue
        # --audio (the clip's waveform) goes with every row that computes its own audio features
        waveform = fi.dest == "audio" and choice.spec is not None and choice.spec.native_audio_features
        if not waveform and (choice.spec is None or choice.spec.name != fi.runtime):
            rows = [s.name for s in RUNTIMES if s.native_audio_features] if fi.dest == "audio" else [fi.runtime]
            raise TraceToolError(
                f"{fi.option} FILE goes with --runtime {' or '.join(rows)}; not with --runtime {choice.text}"
            )
        for module in fi.needs if choice.spec.name == fi.runtime else ():  # another row's needs: checked already
            if importlib.util.find_spec(module) is None:
                raise TraceToolError(f"{fi.option} needs {module}, which is not installed: {install_hint(fi.extra)}")
        out.append(fi)
    return out


def check_companion(fi: FileInput, loaded, header, allow_config_mismatch: bool) -> list[str]:
    """A companion file checked against REF's loaded checkpoint: its notes, or one line."""
    module, _, function = fi.create.partition(":")
    return getattr(importlib.import_module(module), function)(loaded, header, allow_config_mismatch)


def read_file_header(fi: FileInput, path):
    """The file's header, read and checked within bounds by its family's reader (one line if bad)."""
    module, _, function = fi.check.partition(":")
    return getattr(importlib.import_module(module), function)(path)


def file_runtime(fi: FileInput, loaded, max_seq: int, header, allow_config_mismatch: bool, base, choice=None):
    """The runtime that runs the user's file (the family's hand-over); `base()` makes the row's own;
    `choice` holds the companion files given with it (RuntimeChoice.files)."""
    module, _, function = fi.create.partition(":")
    make = getattr(importlib.import_module(module), function)
    return make(loaded, max_seq, header, allow_config_mismatch, base, choice=choice)


def recipe_runtime(choice: RuntimeChoice, loaded, max_seq: int, units: dict):
    """The runtime of a precision recipe over `choice` (its row's `recipe` facet)."""
    module, _, function = choice.spec.recipe.partition(":")
    return getattr(importlib.import_module(module), function)(loaded, max_seq, choice, units)


def typed_recipe_choice(text) -> RuntimeChoice | None:
    """`NAME:TYPE` of a recipe runtime with types (llama.cpp:Q4_K_M), parsed; None for anything else."""
    try:
        choice = parse_runtime(text)
    except TraceToolError:
        return None
    spec = choice.spec
    return choice if spec is not None and spec.recipe and spec.types and choice.text != spec.name else None


def quantized_names() -> list[str]:
    """The runtimes a precision recipe can vary, as --runtime takes them (llama.cpp:TYPE, quantized types)."""
    out = []
    for s in RUNTIMES:
        if s.recipe:
            out += [f"{s.name}:{t}" for t in s.types if t not in s.float_types] if s.types else [s.name]
    return out


def help_text() -> str:
    """The `--runtime` help of `trace replay`."""
    return f"{names_text()}, or {PLUGIN} of a plug-in runtime (see the README's runtime table)"


def markdown_table() -> str:
    """The README's table of built-in runtimes (tests/test_registry.py keeps the README equal to it)."""
    lines = [
        "| `--runtime` | what runs | precision | kinds captured | `--isolate` | your own file | "
        "extra; built artifacts (cached) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in RUNTIMES:
        name = f"`{s.name}[:TYPE]`" if s.types else f"`{s.name}`"
        what = s.what + (f", {s.doc}" if s.doc else "")
        extra = "none" if s.extra is None else f"`{s.extra}`" + (f"; {s.artifacts}" if s.artifacts else "")
        lines.append(
            f"| {name} | {what} | {s.precision} | {s.kinds_text()} | {'yes' if s.isolation else 'no'} | "
            f"{own_files(s.name)} | {extra} |"
        )
    lines.append(
        f"| `{PLUGIN}` | your runtime (plug-in), docs/runtime-api.md | yours | what it reports | "
        "when it continues with the tensors the probe returns | yours | yours |"
    )
    return "\n".join(lines)


def own_files(runtime: str) -> str:
    """The README's "your own file" cell: the file options (FileInput) a row runs instead of the tool's
    own conversion, and the companions that go with them; "no" where it has none."""
    mine = [f for f in FILES if f.runtime == runtime]
    main = [f"`{f.option}` ({f.what})" for f in mine if not f.companion]
    more = [f"`{f.option}`" for f in mine if f.companion]
    return "; ".join(main) + (f"; with {', '.join(more)}" if more else "") if main else "no"
