"""Every option of the `trace` commands, defined once (defaults from the libraries' constants).

A command stacks the decorators it takes: `@O.model()`, `@O.output("trace file to write")`,
`@O.force()`, ... Nothing here imports torch: the CLI reads these while it starts.
"""

from __future__ import annotations

import click

from gemma4_trace.diff.baseline import DEFAULT_FACTOR
from gemma4_trace.diff.calibrate import DEFAULT_MARGIN
from gemma4_trace.replayer.runtimes import registry

MODEL_HELP = {
    "embedded": "save_pretrained folder [default: embedded tiny model]",
    "ref": "model folder [default: the one REF was recorded with]",
    "tokenizer": "folder with a tokenizer.json to decode tokens",
}
DEBUG_HELP = (
    "print the full traceback of a failure (a plug-in's, chained) besides the one-line error; also GEMMA4_TRACE_DEBUG=1"
)
_debug = [False]  # --debug on `trace` or on a command; reset by every `trace` invocation


def debug_requested() -> bool:
    """--debug was given (on `trace` or on the command)."""
    return _debug[0]


def reset_debug(value: bool) -> None:
    """`trace --debug` (and every `trace` invocation: the flag does not outlive one)."""
    _debug[0] = bool(value)


def model(default: str = "embedded"):
    """--model: the embedded tiny model by default, or the one REF names, or a tokenizer's folder."""
    return click.option("--model", "model_dir", type=click.Path(), default=None, help=MODEL_HELP[default])


def output(help: str, dest: str = "output", folder: bool = False, file: bool = False):
    """-o/--output, required: a path to write, a folder (folder=True) or a file (file=True)."""
    kind = click.Path(file_okay=False) if folder else click.Path(dir_okay=False) if file else click.Path()
    return click.option("-o", "--output", dest, required=True, type=kind, help=help)


def force(what: str = "an existing output"):
    return click.option("--force", is_flag=True, help=f"replace {what}")


def set_debug(ctx, param, value):
    if value:
        _debug[0] = True


def debug(fn):
    """--debug on a command (as on `trace` itself): listed in every command's help."""
    return click.option(
        "--debug", is_flag=True, expose_value=False, is_eager=True, callback=set_debug, help=DEBUG_HELP
    )(fn)


def progress(help: str = "draw progress in place [default: only on a terminal; otherwise one line per phase]"):
    """--progress/--no-progress: the live line on a terminal, plain lines otherwise, unless forced."""
    return click.option("--progress/--no-progress", "progress", default=None, help=help)


def selection(fn):
    """--layers / --kinds / --steps: a selective trace (logits and tokens are always kept)."""
    fn = click.option("--steps", default=None, help="keep only these steps, e.g. 0-4 (0 = prefill) [default: all]")(fn)
    fn = click.option("--kinds", default=None, help="keep only these kinds, e.g. q,k,v,layer_out [default: all]")(fn)
    return click.option(
        "--layers",
        default=None,
        help="keep only these layers, e.g. 0-3,17 (the text tower's) or vision:0-1 (a tower's) [default: all]",
    )(fn)


def cache(fn):
    """--cache-dir and --no-cache (replayer/artifacts.py), for the commands that build artifacts."""
    fn = click.option(
        "--no-cache",
        is_flag=True,
        help="build artifacts (ONNX, .pte, GGUF, ...) in a temporary folder, not in the cache",
    )(fn)
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="artifact cache folder (exported ONNX graphs, GGUF files, ...) "
        "[default: $GEMMA4_TRACE_CACHE, else ~/.cache/gemma4-trace]",
    )(fn)


def runtime(help: str | None = None, required: bool = False, choices=None, default="static"):
    """--runtime: a built-in's name (the registry's) or MODULE:FACTORY; or one of `choices`."""
    if choices is not None:
        return click.option("--runtime", type=click.Choice(choices), default=default, show_default=True, help=help)
    if required:
        return click.option("--runtime", required=True, help=help or registry.help_text())
    return click.option("--runtime", default="static", show_default=True, help=help or registry.help_text())


def quantized_runtime(fn):
    """--runtime of trace sensitivity / precision: the runtimes a precision recipe can vary."""
    names = [n for n in registry.quantized_names() if not registry.parse_runtime(n).gguf]
    gguf = [s.name for s in registry.RUNTIMES if s.recipe and s.types]
    kinds = ", ".join(f"{n}:TYPE" for n in gguf)
    return runtime(f"{', '.join(names)}, or {kinds} (Q8_0, Q4_K_M, ...: full replays only)", required=True)(fn)


def max_seq(required: bool = False, help: str = "static sequence length"):
    if required:
        return click.option("--max-seq", type=click.IntRange(2, 1_000_000), required=True, help=help)
    return click.option(
        "--max-seq",
        type=click.IntRange(1, 1_000_000),
        default=None,
        help=f"{help} [default: prompt + new tokens, rounded up to 8]",
    )


def prefill_chunk(help: str):
    return click.option(
        "--prefill-chunk",
        type=click.IntRange(0, 1_000_000),
        default=None,
        help=f"{help}; 0 = one step over max_seq [default: 256 when max_seq >= 1024, else 0]",
    )


def device(help: str = "where the model runs"):
    return click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True, help=help)


def max_new_tokens(fn):
    return click.option("--max-new-tokens", type=click.IntRange(1, 100_000), default=16, show_default=True)(fn)


def no_chat(help: str = "feed the prompt as raw text, without the chat template"):
    return click.option("--no-chat", is_flag=True, help=help)


def tolerances(fn):
    from gemma4_trace.diff.tolerances import profile_names

    return click.option(
        "--tolerances",
        type=click.Path(),
        default=None,
        help=f"TOML file of tolerance rules, or a shipped profile by name ({', '.join(profile_names())})",
    )(fn)


def baseline(help: str = "BASE.h5: a trusted run; RUN fails only outside BASE's error envelope"):
    return click.option("--baseline", "baseline", type=click.Path(), default=None, help=help)


def baseline_factor(fn):
    return click.option(
        "--baseline-factor",
        type=float,
        default=DEFAULT_FACTOR,
        show_default=True,
        help="with a baseline: RUN's error must exceed this many times BASE's",
    )(fn)


def margin(fn):
    return click.option(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        show_default=True,
        help="thresholds = worst known-good error x margin (>= 1)",
    )(fn)


def as_json(help: str = "print JSON instead of text"):
    return click.option("--json", "as_json", is_flag=True, help=help)


def report(fn):
    return click.option("--report", type=click.Path(), default=None, help="also write a self-contained HTML report")(fn)


def unit(fn):
    return click.option(
        "--unit",
        "granularity",
        type=click.Choice(["layer", "module"]),
        default="layer",
        show_default=True,
        help="a unit is a decoder layer, or a module group (qkv, o, mlp, ple of a layer); plus ple_model_proj",
    )(fn)


def recipe(help: str):
    return click.option("--recipe", type=click.Path(), default=None, help=help)
