"""The `trace` command: a thin click layer. Heavy imports happen inside each command.

Library errors (TraceToolError) become one line on stderr and exit 2; `trace diff`
exits 1 when it finds a divergence. Ctrl-C exits 130 with one line.
"""

from __future__ import annotations

import functools
import os
import signal
import sys

import click

from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.errors import TraceToolError, interrupted, one_line

EXIT_DIVERGENCE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int = EXIT_USAGE):
    click.echo(f"error: {one_line(message)}", err=True)
    sys.exit(code)


def _terminate(signum, frame):
    raise KeyboardInterrupt


_debug = [False]  # --debug on `trace` or on a command; reset by every `trace` invocation


def debug_enabled() -> bool:
    return _debug[0] or os.environ.get("GEMMA4_TRACE_DEBUG", "") not in ("", "0")


def _set_debug(ctx, param, value):
    if value:
        _debug[0] = True


DEBUG_HELP = (
    "print the full traceback of a failure (a plug-in's, chained) besides the one-line error; also GEMMA4_TRACE_DEBUG=1"
)


def debug_option(fn):
    """--debug on a command (as on `trace` itself): listed in every command's help."""
    return click.option(
        "--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug, help=DEBUG_HELP
    )(fn)


# --model of the commands that load a checkpoint: the embedded tiny model, or the one REF names
model_option = click.option(
    "--model",
    "model_dir",
    type=click.Path(),
    default=None,
    help="save_pretrained folder [default: embedded tiny model]",
)
ref_model_option = click.option(
    "--model",
    "model_dir",
    type=click.Path(),
    default=None,
    help="model folder [default: the one REF was recorded with]",
)


def user_errors(fn):
    """Map library exceptions to exit codes and one-line messages: never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            return fn(*args, **kwargs)
        except TraceToolError as e:
            # `raise ... from None` (a fault we explained: damage, a refusal) has no chain to show
            # only an explicit chain (`raise ... from e`: a plug-in's exception re-raised by the driver); a
            # refusal raised while handling another exception (bad UTF-8, say) is no failure to trace
            if debug_enabled() and e.__cause__ is not None:
                import traceback  # the chain: where a plug-in's exception was raised, then where we re-raised it

                click.echo("".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip(), err=True)
            _fail(str(e))
        except KeyboardInterrupt:
            _fail("interrupted; nothing was written", EXIT_INTERRUPTED)
        except MemoryError:
            _fail("out of memory")
        except Exception as e:  # a bug of ours: still one line, the traceback on request
            if interrupted(e):  # Ctrl-C inside C code (h5py) can arrive wrapped in another exception
                _fail("interrupted; nothing was written", EXIT_INTERRUPTED)
            if debug_enabled():
                raise
            _fail(
                f"internal error ({type(e).__name__}: {one_line(e, 200)}); "
                "set GEMMA4_TRACE_DEBUG=1 to see the traceback"
            )
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


class _OneLineErrors(click.Group):
    """click's usage errors as one line (`error: ...`, exit 2) instead of a usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
        except click.ClickException as e:
            hint = f" (see '{e.ctx.command_path} --help')" if getattr(e, "ctx", None) else ""
            _fail(e.format_message().replace("\n", " ") + hint, e.exit_code)
        except click.Abort:
            _fail("interrupted", EXIT_INTERRUPTED)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gemma4-trace")
@click.option("--debug", is_flag=True, help=DEBUG_HELP)
def main(debug):
    """Record, replay and diff layer-by-layer traces of Gemma 4."""
    _debug[0] = debug


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        ids = [int(x) for x in value.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers, e.g. 2,10,11") from None
    if not ids:
        raise click.BadParameter("no ids given")
    if min(ids) < 0:
        raise click.BadParameter("token ids must be >= 0")
    return ids


def _max_memory(value):
    """'0=20GiB,cpu=60GiB' -> {0: '20GiB', 'cpu': '60GiB'} (accelerate's max_memory)."""
    if value is None:
        return None
    out = {}
    for part in value.replace(" ", "").split(","):
        dev, sep, size = part.partition("=")
        if not sep or not dev or not size:
            raise click.BadParameter(f"expected DEVICE=SIZE pairs like 0=20GiB,cpu=60GiB, got {part!r}")
        out[int(dev) if dev.isdigit() else dev] = size
    return out


def progress_option(fn):
    """--progress/--no-progress: the live line on a terminal, plain lines otherwise, unless forced."""
    return click.option(
        "--progress/--no-progress",
        "progress",
        default=None,
        help="draw progress in place [default: only on a terminal; otherwise one line per phase]",
    )(fn)


def selection_options(fn):
    """--layers / --kinds / --steps: a selective trace (logits and tokens are always kept)."""
    fn = click.option("--steps", default=None, help="keep only these steps, e.g. 0-4 (0 = prefill) [default: all]")(fn)
    fn = click.option("--kinds", default=None, help="keep only these kinds, e.g. q,k,v,layer_out [default: all]")(fn)
    return click.option("--layers", default=None, help="keep only these layers, e.g. 0-3,17 [default: all]")(fn)


def _selection(layers, kinds, steps):
    from gemma4_trace.traces.selection import Selection

    return Selection.parse(layers, kinds, steps)


@main.command()
@model_option
@click.option("--prompt", default=None, help="prompt text (needs a tokenizer in the model folder)")
@click.option("--input-ids", callback=_int_list, default=None, help="comma-separated prompt token ids")
@click.option("--image", "images", multiple=True, type=click.Path(), help="image file (repeatable)")
@click.option("--max-new-tokens", type=click.IntRange(1, 100_000), default=16, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--no-chat", is_flag=True, help="feed the prompt as raw text, without the chat template")
@click.option("-o", "--output", required=True, type=click.Path(), help="trace file to write")
@click.option("--force", is_flag=True, help="replace an existing output")
@click.option(
    "--device-map",
    type=click.Choice(["auto"]),
    default=None,
    help="place the model over GPUs, CPU and disk with accelerate (extra [big]); --device is ignored",
)
@click.option(
    "--max-memory",
    callback=lambda c, p, v: _max_memory(v),
    default=None,
    help="with --device-map: memory per device, e.g. 0=20GiB,cpu=60GiB",
)
@click.option(
    "--offload-folder",
    type=click.Path(file_okay=False),
    default=None,
    help="with --device-map: folder for the layers offloaded to disk",
)
@click.option(
    "--shared-kv-prefill",
    type=click.Choice(["all", "last"]),
    default="all",
    show_default=True,
    help="prefill rows of the KV-sharing layers (and final_hidden): all, or only the last as generate() "
    "computes them (faster on long prompts; the others are stored absent and not compared)",
)
@selection_options
@debug_option
@progress_option
@user_errors
def record(
    model_dir,
    prompt,
    input_ids,
    images,
    max_new_tokens,
    dtype,
    device,
    no_chat,
    output,
    force,
    device_map,
    max_memory,
    offload_folder,
    shared_kv_prefill,
    layers,
    kinds,
    steps,
    progress,
):
    """Run HF Gemma 4 greedy generation with hooks and write a reference trace."""
    from gemma4_trace.progress import Progress

    check_output_path(output, force, inputs=[*images, *_model_files(model_dir)])
    selection = _selection(layers, kinds, steps)
    _check_model_dir(model_dir)  # cheap checks first: nothing below loads before they pass
    if device_map is not None:
        _check_installed("accelerate", "--device-map")
    from gemma4_trace.recorder.record import record_trace  # torch: after the checks

    bar = Progress("recording", progress)
    try:
        summary = record_trace(
            model_dir=model_dir,
            output=output,
            prompt=prompt,
            input_ids=input_ids,
            images=list(images),
            max_new_tokens=max_new_tokens,
            dtype=dtype,
            device=device,
            chat=not no_chat,
            force=force,
            progress=bar,
            selection=selection,
            device_map=device_map,
            max_memory=max_memory,
            offload_folder=offload_folder,
            shared_kv_prefill=shared_kv_prefill,
        )
        bar.close()
    finally:
        bar.close(completed=False)
    click.echo(one_line(summary))


@main.command()
@click.argument("trace_path", metavar="TRACE.h5", type=click.Path())
@click.option("--hash", "show_hash", is_flag=True, help="print the content hash only")
@click.option(
    "--model", "model_dir", type=click.Path(), default=None, help="folder with a tokenizer.json to decode tokens"
)
@debug_option
@user_errors
def show(trace_path, show_hash, model_dir):
    """Print a readable summary of a trace."""
    from pathlib import Path

    from gemma4_trace.hf.model import decoder_for
    from gemma4_trace.show import summarize
    from gemma4_trace.traces.reader import TraceReader

    with TraceReader(trace_path) as r:
        if show_hash:
            click.echo(r.content_hash())
            return
        folder = Path(model_dir) if model_dir else _embedded_model_dir(r.provenance["model_name"])
        click.echo(summarize(r, decoder_for(folder / "tokenizer.json" if folder else None)))


def cache_options(fn):
    """--cache-dir and --no-cache (replayer/artifacts.py), for the commands that build artifacts."""
    fn = click.option(
        "--no-cache",
        is_flag=True,
        help="build artifacts (ONNX, mobius, GGUF, ...) in a temporary folder, not in the cache",
    )(fn)
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="artifact cache folder (exported ONNX graphs, GGUF files, ...) "
        "[default: $GEMMA4_TRACE_CACHE, else ~/.cache/gemma4-trace]",
    )(fn)


def _configure_artifacts(cache_dir, no_cache: bool) -> None:
    """--cache-dir / --no-cache for this command only: the defaults come back when it ends (the
    command may run inside a longer-lived process: a test session, a notebook)."""
    from gemma4_trace.replayer import artifacts

    artifacts.configure(cache_dir, enabled=not no_cache)
    click.get_current_context().call_on_close(artifacts.configure)


def _check_model_dir(model_dir) -> None:
    """A --model folder's config.json, read before anything loads (no torch import)."""
    if model_dir is not None:
        from pathlib import Path

        from gemma4_trace.hf.model import read_config_json

        read_config_json(Path(model_dir))


def _check_installed(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise TraceToolError(f"{what} needs {module}, which is not installed")


def _model_files(model_dir) -> list:
    """The files of a model folder (the embedded one by default): inputs an output must not replace."""
    from pathlib import Path

    from gemma4_trace.hf.model import embedded_model_dir

    try:
        return [p for p in Path(model_dir or embedded_model_dir()).iterdir() if p.is_file()]
    except OSError:
        return []


def _embedded_model_dir(model_name: str):
    """The embedded model's folder when a trace was recorded from it (no torch import)."""
    from gemma4_trace.hf.model import EMBEDDED_NAME, embedded_model_dir

    return embedded_model_dir() if model_name == EMBEDDED_NAME else None


@main.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@ref_model_option
@click.option(
    "--runtime",
    default="static",
    show_default=True,
    help="'static', a quantized 'static-w8' / 'static-w4g32' / 'static-w8a8' (needs torchao), 'tico' / 'tico-quant' "
    "(extra [tico]), 'onnx' (extra [onnx]), 'llama.cpp[:TYPE]' (extra [llamacpp]), "
    "or MODULE:FACTORY of a plug-in runtime",
)
@click.option(
    "--max-seq",
    type=click.IntRange(1, 1_000_000),
    default=None,
    help="static sequence length [default: prompt + new tokens, rounded up to 8]",
)
@click.option(
    "--teacher-forcing/--free-running", default=True, show_default=True, help="feed REF's tokens, or the runtime's own"
)
@click.option(
    "--isolate", is_flag=True, help="feed every layer REF's input: each layer's error is its own (teacher-forced)"
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="where the model and the static runtime run",
)
@click.option(
    "--prefill-chunk",
    type=click.IntRange(0, 1_000_000),
    default=None,
    help="static and executorch runtimes: prefill in chunks of N rows, shapes (N, max_seq); 0 = one step over max_seq "
    "[default: 256 when max_seq >= 1024, else 0]",
)
@click.option("-o", "--output", required=True, type=click.Path(), help="trace file to write")
@click.option("--force", is_flag=True, help="replace an existing output")
@debug_option
@click.option(
    "--recipe",
    type=click.Path(),
    default=None,
    help="precision recipe TOML (trace precision) for a quantized static runtime or llama.cpp:TYPE",
)
@click.option(
    "--gguf", "gguf_path", type=click.Path(), default=None, help="run this GGUF file in llama.cpp (extra [llamacpp])"
)
@click.option(
    "--weights-from",
    type=click.Path(),
    default=None,
    help="static runtime on this GGUF's weights, dequantized (extra [llamacpp])",
)
@click.option(
    "--allow-config-mismatch", is_flag=True, help="replay a GGUF whose metadata differs from REF's model config"
)
@cache_options
@progress_option
@selection_options
@user_errors
def replay(
    reference,
    model_dir,
    runtime,
    max_seq,
    teacher_forcing,
    isolate,
    device,
    prefill_chunk,
    output,
    force,
    layers,
    kinds,
    steps,
    progress,
    recipe=None,
    gguf_path=None,
    weights_from=None,
    allow_config_mismatch=False,
    cache_dir=None,
    no_cache=False,
):
    """Run a static-shape runtime on REF's inputs and write a candidate trace."""
    from gemma4_trace.progress import Progress
    from gemma4_trace.replayer.api import check_runtime_name

    check_runtime_name(runtime, isolate)  # cheap checks first: a typo is refused before torch or the model loads
    _configure_artifacts(cache_dir, no_cache)  # before any runtime builds an artifact
    gguf_files = [p for p in (gguf_path, weights_from) if p]
    check_output_path(
        output, force, inputs=[reference, *_model_files(model_dir), *([recipe] if recipe else []), *gguf_files]
    )
    _check_model_dir(model_dir)
    if recipe is not None:
        from gemma4_trace.replayer.recipe import load_recipe

        recipe = load_recipe(recipe)
    from gemma4_trace.replayer.replay import replay_trace  # torch: after the checks

    bar = Progress("replaying", progress)
    try:
        summary = replay_trace(
            reference,
            output,
            model_dir=model_dir,
            runtime=runtime,
            max_seq=max_seq,
            mode="teacher-forced" if teacher_forcing else "free-running",
            force=force,
            progress=bar,
            isolate=isolate,
            prefill_chunk=prefill_chunk,
            selection=_selection(layers, kinds, steps),
            device=device,
            recipe=recipe,
            gguf=gguf_path,
            weights_from=weights_from,
            allow_config_mismatch=allow_config_mismatch,
        )
        bar.close()
    finally:
        bar.close(completed=False)
    click.echo(one_line(summary))  # it names the runtime, which a plug-in chose


@main.command("export-onnx")
@model_option
@click.option(
    "--max-seq", type=click.IntRange(2, 1_000_000), required=True, help="static sequence length of the graphs"
)
@click.option(
    "-o",
    "--output",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="folder for prefill.onnx and decode.onnx",
)
@click.option("--force", is_flag=True, help="replace existing .onnx files")
@cache_options
@debug_option
@user_errors
def export_onnx_cmd(model_dir, max_seq, out_dir, force, cache_dir, no_cache):
    """Export the static runtime's prefill and decode steps to ONNX (what --runtime onnx runs)."""

    _configure_artifacts(cache_dir, no_cache)
    _check_model_dir(model_dir)
    for module in ("onnx", "onnxscript"):
        _check_installed(module, "trace export-onnx")
    from gemma4_trace.replayer.onnx_runtime import export_command  # torch: after the checks

    click.echo(export_command(model_dir, max_seq, out_dir, force=force))


@main.command("export-pte")
@model_option
@click.option(
    "--runtime",
    type=click.Choice(["executorch", "executorch-int8"]),
    default="executorch",
    show_default=True,
    help="float32, or PT2E int8 (XNNPACKQuantizer) calibrated on --calibrate's prompt",
)
@click.option(
    "--max-seq", type=click.IntRange(2, 1_000_000), required=True, help="static sequence length of the programs"
)
@click.option("--calibrate", "calibrate", type=click.Path(), help="REF.h5 whose prompt calibrates executorch-int8")
@click.option(
    "--prefill-chunk",
    type=click.IntRange(0, 1_000_000),
    default=None,
    help="a prefill program over N rows (run once per chunk), as replay's --prefill-chunk; 0 = over max_seq "
    "[default: 256 when max_seq >= 1024, else 0]",
)
@click.option(
    "-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False), help="folder for the .pte files"
)
@click.option("--force", is_flag=True, help="replace existing .pte files")
@debug_option
@user_errors
def export_pte_cmd(model_dir, runtime, max_seq, calibrate, prefill_chunk, out_dir, force):
    """Lower the static runtime's prefill and decode steps to ExecuTorch XNNPACK .pte programs (what
    --runtime executorch runs): prefill.pte and decode.pte, both or neither."""
    _check_model_dir(model_dir)
    from gemma4_trace.replayer.api import check_runtime_name

    check_runtime_name(runtime)  # the extra installed
    from gemma4_trace.replayer.executorch_runtime import export_command  # torch: after the checks

    click.echo(
        export_command(
            model_dir, runtime, max_seq, out_dir, force=force, calibration_ref=calibrate, prefill_chunk=prefill_chunk
        )
    )


@main.command("import")
@click.argument("dump_dir", metavar="DUMP_DIR", type=click.Path())
@click.option(
    "--reference",
    required=True,
    type=click.Path(),
    help="REF.h5: inputs, model metadata (and tokens when the dump has none)",
)
@click.option(
    "--map",
    "map_path",
    required=True,
    type=click.Path(),
    help="TOML map: which file holds which kind, and its layout (docs/import.md)",
)
@click.option("-o", "--output", required=True, type=click.Path(), help="trace file to write")
@click.option("--force", is_flag=True, help="replace an existing output")
@debug_option
@user_errors
def import_cmd(dump_dir, reference, map_path, output, force):
    """Build a candidate trace from a folder of dumped tensors (.npy, .safetensors, raw)."""
    from gemma4_trace.importer import import_dump

    click.echo(import_dump(dump_dir, reference, map_path, output, force=force))


@main.command("diff")
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.argument("candidate", metavar="RUN.h5", type=click.Path())
@click.option(
    "--tolerances",
    type=click.Path(),
    default=None,
    help="TOML file of tolerance rules, or a shipped profile by name (llamacpp-f32)",
)
@click.option("--json", "as_json", is_flag=True, help="print the JSON report instead of text")
@click.option("--report", type=click.Path(), default=None, help="also write a self-contained HTML report")
@click.option("--force", is_flag=True, help="replace an existing --report file")
@click.option(
    "--model", "model_dir", type=click.Path(), default=None, help="folder with a tokenizer.json to show generated text"
)
@click.option(
    "--baseline",
    "baseline",
    type=click.Path(),
    default=None,
    help="BASE.h5: a trusted run; RUN fails only outside BASE's error envelope",
)
@click.option(
    "--baseline-factor",
    type=float,
    default=4.0,
    show_default=True,
    help="with --baseline: RUN's error must exceed this many times BASE's",
)
@click.option(
    "--full",
    is_flag=True,
    help="compare every row of every tensor, also after the first divergence (the whole error map)",
)
@debug_option
@user_errors
def diff_cmd(reference, candidate, tolerances, as_json, report, force, model_dir, baseline, baseline_factor, full):
    """Find the first divergence between two traces (exit 1 if they diverge)."""
    import json
    from pathlib import Path

    from gemma4_trace.diff import diff_traces, format_text, write_html
    from gemma4_trace.hf.model import decoder_for

    if report:  # before the work: never onto an input, a device or a FIFO
        check_output_path(
            report, force, inputs=[reference, candidate, tolerances, model_dir and Path(model_dir) / "tokenizer.json"]
        )
    result = diff_traces(reference, candidate, tolerances, baseline, baseline_factor, full=full)
    folder = Path(model_dir) if model_dir else _embedded_model_dir(result.reference.model_name)
    decode = decoder_for(folder / "tokenizer.json" if folder else None)
    if decode is not None:
        result.tokens.reference_text = decode(result.tokens.reference)
        result.tokens.candidate_text = decode(result.tokens.candidate)
    if report:
        write_html(result, report, force=force)
    text = json.dumps(result.to_json(), indent=2) if as_json else format_text(result)
    click.echo("\n".join(one_line(line) for line in text.splitlines()))  # trace text never drives the terminal
    sys.exit(0 if result.match else EXIT_DIVERGENCE)


@main.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.argument("bases", metavar="BASE.h5...", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(), help="tolerances TOML file to write")
@click.option(
    "--margin", type=float, default=2.0, show_default=True, help="thresholds = worst known-good error x margin (>= 1)"
)
@click.option("--force", is_flag=True, help="replace an existing output")
@debug_option
@user_errors
def calibrate(reference, bases, output, margin, force):
    """Write tolerances from known-good runs: `trace diff REF BASE --tolerances` then matches."""
    from gemma4_trace.diff.calibrate import write_calibration

    click.echo(one_line(write_calibration(reference, list(bases), output, margin=margin, force=force)))  # names OUT


@main.command("export-gguf")
@model_option
@click.option(
    "--type",
    "gguf_type",
    default="F32",
    show_default=True,
    help="F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0 or Q3_K_M (all but F32 need the llamacpp extra)",
)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="GGUF file to write")
@click.option("--force", is_flag=True, help="replace an existing output")
@user_errors
def export_gguf_cmd(model_dir, gguf_type, output, force):
    """Convert the checkpoint to GGUF (what --runtime llama.cpp:TYPE runs), cached by content."""
    from gemma4_trace.replayer.llamacpp_runtime import export_command

    click.echo(export_command(model_dir, gguf_type, output, force=force))


@main.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.argument("candidate", metavar="RUN.h5", type=click.Path())
@click.option("--at", "at", default=None, help="STEP,LAYER to extract [default: the first divergence]")
@ref_model_option
@click.option(
    "-o", "--output", "out_dir", required=True, type=click.Path(), help="folder for repro.py and its .npz files"
)
@click.option("--force", is_flag=True, help="replace an existing repro in the folder")
@click.option("--onnx", is_flag=True, help="also write the layer as an ONNX graph (layer.onnx; the onnx extra)")
@debug_option
@user_errors
def repro(reference, candidate, at, model_dir, out_dir, force, onnx):
    """Write a standalone repro (numpy + torch only) of one layer at one step."""
    from gemma4_trace.replayer.repro import check_onnx_export, parse_site, write_repro

    if onnx:
        check_onnx_export()

    if at is not None:
        site = parse_site(at)
    else:  # the first divergence, as `trace diff` finds it
        from gemma4_trace.diff import diff_traces

        d = diff_traces(reference, candidate).first_divergence
        if d is None:
            raise TraceToolError("RUN matches REF (no divergence): pass --at STEP,LAYER to choose a layer")
        if d.layer is None:
            raise TraceToolError(
                f"the first divergence is in {d.kind} at step {d.step}, not in a decoder layer: "
                "pass --at STEP,LAYER to choose one"
            )
        site = (int(d.step), int(d.layer))
    click.echo(
        one_line(write_repro(reference, candidate, out_dir, at=site, model_dir=model_dir, force=force, onnx=onnx))
    )


def _baseline_judge(reference, baseline):
    """For `trace precision --target baseline`: BASE checked against REF now (one line, exit 2,
    as `trace diff --baseline` checks it), then a judge: does `trace diff --baseline BASE` of a
    replay's trace pass?"""
    if baseline is None:
        return None
    from gemma4_trace.diff import diff_traces
    from gemma4_trace.diff.baseline import check_baseline
    from gemma4_trace.traces.reader import TraceReader

    with TraceReader(reference) as ref, TraceReader(baseline) as base:
        check_baseline(ref, ref, base)  # REF stands in for the replays: same prompt, steps and mode
    return lambda run: diff_traces(reference, run, None, baseline).match


def _load_start_recipe(path):
    if path is None:
        return None
    from gemma4_trace.replayer.recipe import load_recipe

    return load_recipe(path)


@main.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.option(
    "--runtime",
    required=True,
    help="static-w8, static-w4g32, static-w8a8, or llama.cpp:TYPE (Q8_0, Q4_K_M, ...: full replays only)",
)
@click.option(
    "--unit",
    "granularity",
    type=click.Choice(["layer", "module"]),
    default="layer",
    show_default=True,
    help="a unit is a decoder layer, or a module group (qkv, o, mlp, ple of a layer); plus ple_model_proj",
)
@click.option(
    "--recipe",
    type=click.Path(),
    default=None,
    help="a recipe TOML: the quantized configuration to start from [default: every unit at --runtime]",
)
@click.option(
    "--replays",
    type=click.IntRange(0, 10_000),
    default=4,
    show_default=True,
    help="full replays (only quantized, only float) for this many units, the isolated ranking's first",
)
@ref_model_option
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of text")
@click.option("--report", type=click.Path(), default=None, help="also write a self-contained HTML report")
@click.option("--force", is_flag=True, help="replace an existing --report file")
@debug_option
@user_errors
def sensitivity(reference, runtime, granularity, recipe, replays, model_dir, as_json, report, force):
    """Rank quantized units by their effect: only one unit quantized, or only one kept in float."""
    import json
    from pathlib import Path

    from gemma4_trace.diff.sensitivity_html import write_sensitivity_html
    from gemma4_trace.replayer.sensitivity import format_sensitivity, make_runner
    from gemma4_trace.replayer.sensitivity import sensitivity as run_sensitivity

    if report:  # before the work: never onto an input
        check_output_path(report, force, inputs=[reference, *_model_files(model_dir), *([recipe] if recipe else [])])
    runner = make_runner(reference, runtime, model_dir, _load_start_recipe(recipe))
    result = run_sensitivity(runner, granularity, replays)
    summary = format_sensitivity(result, Path(reference).name)
    if report:
        write_sensitivity_html(result.to_json(), summary, Path(reference).name, report, force)
    text = json.dumps(result.to_json(), indent=2) if as_json else summary
    click.echo("\n".join(one_line(line) for line in text.splitlines()))


@main.command()
@click.argument("reference", metavar="REF.h5", type=click.Path())
@click.option(
    "--runtime",
    required=True,
    help="static-w8, static-w4g32, static-w8a8, or llama.cpp:TYPE (Q8_0, Q4_K_M, ...: full replays only)",
)
@click.option(
    "--target",
    required=True,
    help="e.g. 'kl_mean<=0.01 and top1>=0.98' (metrics: kl_mean, kl_p99, top1, layer_out; "
    "baseline: trace diff --baseline BASE of the replay passes)",
)
@click.option(
    "--baseline",
    type=click.Path(),
    default=None,
    help="BASE.h5 for the target's baseline (as in trace diff --baseline)",
)
@click.option(
    "--fallback",
    default="float",
    show_default=True,
    help="the precision units kept back get: float, static-w8, or for llama.cpp a GGUF type (e.g. Q8_0)",
)
@click.option("--unit", "granularity", type=click.Choice(["layer", "module"]), default="layer", show_default=True)
@click.option(
    "--recipe", type=click.Path(), default=None, help="a recipe TOML to start from [default: every unit at --runtime]"
)
@ref_model_option
@click.option("-o", "--output", required=True, type=click.Path(), help="recipe TOML to write")
@click.option("--force", is_flag=True, help="replace an existing output")
@debug_option
@user_errors
def precision(reference, runtime, target, baseline, fallback, granularity, recipe, model_dir, output, force):
    """Keep the most sensitive units at a fallback precision until a target holds; write the recipe."""
    from pathlib import Path

    from gemma4_trace.replayer.recipe import write_quantize_options, write_recipe
    from gemma4_trace.replayer.sensitivity import (
        Target,
        check_target_baseline,
        format_precision,
        make_runner,
        precision_search,
    )

    inputs = [reference, *_model_files(model_dir), *([recipe] if recipe else []), *([baseline] if baseline else [])]
    check_output_path(output, force, inputs=inputs)
    llama = runtime.startswith("llama.cpp")
    if llama:  # the recipe as llama-quantize options goes beside it
        check_output_path(Path(output).with_suffix(".llama-quantize.txt"), force, inputs=inputs)
    goal = Target.parse(target)
    check_target_baseline(goal, baseline)
    if fallback == runtime:
        raise TraceToolError(f"--fallback {fallback} is the runtime itself")
    start = _load_start_recipe(recipe)
    runner = make_runner(reference, runtime, model_dir, start, baseline=_baseline_judge(reference, baseline))
    result = precision_search(runner, goal, fallback, granularity, start)
    write_recipe(
        result.recipe,
        output,
        force,
        comments=[
            f"trace precision --runtime {runtime} --target '{goal}' --fallback {fallback}"
            + (f" --baseline {Path(baseline).name}" if baseline else "")
        ],
    )
    click.echo(format_precision(result, output, goal, fallback, runner.replays, runner.seconds))
    if llama:
        options = write_quantize_options(runner, result.recipe, output, force)
        click.echo(f"wrote {options}: the recipe as llama-quantize --tensor-type options")


@main.command()
@click.argument("prompts_path", metavar="PROMPTS", type=click.Path())
@click.option("--runtime", required=True, help="the runtime to judge (as `trace replay --runtime`)")
@click.option(
    "--baseline-runtime",
    default=None,
    help="a trusted runtime also replayed on every prompt; RUN diverges only outside its error envelope",
)
@model_option
@click.option("--max-new-tokens", type=click.IntRange(1, 100_000), default=16, show_default=True)
@click.option("--no-chat", is_flag=True, help="text prompts as raw text, without the chat template")
@click.option("--workers", type=click.IntRange(1, 1024), default=1, show_default=True, help="processes on this machine")
@click.option(
    "--ray",
    "ray_address",
    default=None,
    help="one Ray task per prompt: 'auto' (the running cluster) or its ADDRESS (extra [cluster])",
)
@click.option(
    "--shared-dir/--no-shared-dir",
    "shared_dir",
    default=None,
    help="with --ray: tasks write DIR themselves, or return their files to be written here "
    "[default: each task checks whether it sees DIR]",
)
@click.option(
    "--keep-traces", is_flag=True, help="also keep each prompt's REF, RUN (and BASE) traces under DIR/prompts"
)
@click.option(
    "--tolerances",
    type=click.Path(),
    default=None,
    help="TOML file of tolerance rules, or a shipped profile by name (as `trace diff`)",
)
@click.option("--baseline-factor", type=float, default=4.0, show_default=True, help="as `trace diff --baseline-factor`")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(), help="folder for the results")
@click.option(
    "--progress/--no-progress",
    "progress",
    default=None,
    help="a line on stderr per finished prompt [default: only on a terminal]",
)
@debug_option
@user_errors
def sweep(
    prompts_path,
    runtime,
    baseline_runtime,
    model_dir,
    max_new_tokens,
    no_chat,
    workers,
    ray_address,
    shared_dir,
    keep_traces,
    tolerances,
    baseline_factor,
    out_dir,
    progress,
):
    """Record, replay and diff every prompt of a set; KL, top-1 and perplexity statistics over all (exit 1 if any
    prompt diverges)."""
    from pathlib import Path

    from gemma4_trace import sweep as S
    from gemma4_trace.diff.baseline import check_factor
    from gemma4_trace.diff.tolerances import load_tolerances
    from gemma4_trace.hf.model import embedded_model_dir
    from gemma4_trace.replayer import artifacts
    from gemma4_trace.replayer.api import check_runtime_name

    prompts = S.read_prompts(prompts_path)  # cheap checks first: nothing heavy loads before they pass
    for rt in (runtime, baseline_runtime):
        if rt is not None:
            check_runtime_name(rt)
    if ray_address is not None:
        if workers != 1:
            raise TraceToolError("give --workers or --ray, not both")
        S.check_ray()
    _check_model_dir(model_dir)
    load_tolerances(tolerances)
    if baseline_runtime is not None:
        check_factor(baseline_factor)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TraceToolError(f"output {out} is a file; give a folder")
    settings = S.make_settings(
        artifacts.model_hash(model_dir or embedded_model_dir()),
        runtime,
        baseline_runtime,
        max_new_tokens,
        tolerances,
        baseline_factor,
    )
    settings["chat"] = not no_chat
    cfg = S.Config(
        model_dir=str(Path(model_dir).resolve()) if model_dir else None,
        runtime=runtime,
        baseline_runtime=baseline_runtime,
        max_new_tokens=max_new_tokens,
        tolerances=str(Path(tolerances).resolve()) if tolerances and Path(tolerances).is_file() else tolerances,
        baseline_factor=baseline_factor,
        chat=not no_chat,
        keep_traces=keep_traces,
        cache=str(artifacts.cache_dir().resolve()),
        settings=settings,
        sys_path=[os.getcwd()],
    )
    loud = progress if progress is not None else sys.stderr.isatty()
    say = (lambda line: click.echo(one_line(line), err=True)) if loud else None
    try:
        outcome = S.run_sweep(prompts, cfg, out, workers=workers, ray_address=ray_address, say=say, shared=shared_dir)
    except KeyboardInterrupt:
        done = len(list((out / "prompts").glob("*.json"))) if (out / "prompts").is_dir() else 0
        _fail(f"interrupted; {done} finished prompt(s) kept in {out}/prompts (run again to resume)", EXIT_INTERRUPTED)
    click.echo("\n".join(one_line(line) for line in S.describe(outcome).splitlines()))
    sys.exit(EXIT_DIVERGENCE if outcome.summary["diverging"] else 0)
