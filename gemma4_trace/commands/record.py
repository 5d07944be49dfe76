"""`trace record`: run HF Gemma 4 greedy generation with hooks and write a reference trace."""

from __future__ import annotations

import click

from gemma4_trace import options as O
from gemma4_trace.traces.atomic import check_output_path

from . import check_installed, check_model_dir, model_files, selection_of, user_errors, with_progress


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


@click.command()
@O.model()
@click.option("--prompt", default=None, help="prompt text (needs a tokenizer in the model folder)")
@click.option("--input-ids", callback=_int_list, default=None, help="comma-separated prompt token ids")
@click.option("--image", "images", multiple=True, type=click.Path(), help="image file (repeatable)")
@click.option(
    "--audio",
    "audios",
    multiple=True,
    type=click.Path(),
    help="audio clip: WAV, FLAC, OGG, ... (repeatable; extra [audio]; no --model: the embedded audio model)",
)
@O.max_new_tokens
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@O.device()
@O.no_chat()
@O.output("trace file to write")
@O.force()
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
@O.selection
@O.debug
@O.progress()
@user_errors
def record(model_dir, images, audios, output, force, device_map, no_chat, layers, kinds, steps, progress, **kw):
    """Run HF Gemma 4 greedy generation with hooks and write a reference trace."""
    check_output_path(output, force, inputs=[*images, *audios, *model_files(model_dir)])
    selection = selection_of(layers, kinds, steps)
    check_model_dir(model_dir)  # cheap checks first: nothing below loads before they pass
    if device_map is not None:
        check_installed("accelerate", "--device-map")
    from gemma4_trace.recorder.record import record_trace  # torch: after the checks

    with_progress(
        "recording",
        progress,
        record_trace,
        model_dir=model_dir,
        output=output,
        images=list(images),
        audios=list(audios),
        chat=not no_chat,
        force=force,
        selection=selection,
        device_map=device_map,
        **kw,
    )
