"""Where HF's Gemma 4 computes each canonical kind: the one table the recorder's hooks
(recorder/record.py) and litert-convert's wrapper (replayer/runtimes/litert/convert.py) read.

A row (HFSite) names the module whose forward computes a kind, by its path in
Gemma4ForConditionalGeneration ("{layer}": each layer's index), and which of its tensors the kind
is: what forward returns (OUTPUT), an argument of forward (INPUT), or an argument of the attention
function the module calls (ATTENTION: hooked by wrapping that function, not the module). A
text-only checkpoint (Gemma4ForCausalLM) holds the text tower at TEXT_ONLY_ROOT; module_path
rewrites the rows' paths for it. The tensors keep HF's batch axis: the trace's row layout (batch
1's rows, heads after rows) is the users' business.

`install` hooks the INPUT and OUTPUT rows below the model; the model's own output (the logits)
is what its forward returns, and the attention rows need the attention function wrapped: both
are the caller's, read with `output_of` and `attention_tensors`.

Towers: each row carries its tower ("text" for the decoder's kinds, as traces/schema.py names
towers). TOWERS also places the encoder towers (checked against transformers 5.24's
modeling_gemma4.py and tests/test_hf_sites.py). The vision tower's rows keep HF's image axis
(every image runs in one batch, padding patches included), the audio tower's its clip axis
(padding frames included): the recorder drops the padding rows.
`install` skips the rows of a tower the model does not have (a text-only checkpoint).

No torch import: the rows are data, the helpers only call the modules they are given.
"""

from __future__ import annotations

from dataclasses import dataclass

from gemma4_trace.traces import schema
from gemma4_trace.traces.schema import LAYER_TYPE_SHORT, rope_kinds

TEXT, VISION, AUDIO = schema.TEXT, *schema.ENCODER_TOWERS  # the towers traces/schema.py names
OUTPUT, INPUT, ATTENTION = "output", "input", "attention"
LAYER = "{layer}"  # in a row's module path: the layer's index (the row stands for every layer)
# the text tower's rotary embedding runs once per layer type: forward(x, position_ids, layer_type)
LAYER_TYPE_ARG = (2, "layer_type")
# the attention function's tensor arguments: fn(module, query, key, value, attention_mask, **kwargs)
ATTENTION_ARGS = ("query", "key", "value", "attention_mask")


@dataclass(frozen=True)
class Tower:
    """Where one tower lives in Gemma4ForConditionalGeneration."""

    name: str
    root: str  # its model
    layers: str  # its list of layers, below the root
    embedder: str | None  # what projects its output into the text tower's embeddings (None: the text tower)


TOWERS: dict[str, Tower] = {
    t.name: t
    for t in (
        Tower(TEXT, "model.language_model", "layers", None),  # Gemma4TextModel
        Tower(VISION, "model.vision_tower", "encoder.layers", "model.embed_vision"),  # Gemma4VisionModel
        Tower(AUDIO, "model.audio_tower", "layers", "model.embed_audio"),  # Gemma4AudioModel
    )
}
TEXT_ONLY_ROOT = "model"  # Gemma4ForCausalLM's Gemma4TextModel


@dataclass(frozen=True)
class HFSite:
    """Where HF computes one kind of a tower."""

    kind: str  # its name in traces/schema.py (within the tower)
    tower: str
    module: str  # path in Gemma4ForConditionalGeneration ("" the model itself); LAYER: each layer's index
    tensor: str  # OUTPUT | INPUT | ATTENTION
    # OUTPUT: the part of what forward returns (a tuple index, a ModelOutput attribute; None: all of it);
    # INPUT: the argument's name (at `position`); ATTENTION: the attention function's argument (ATTENTION_ARGS)
    item: int | str | None = None
    position: int | None = None  # INPUT: the argument's position in forward
    layer_type: str | None = None  # the module's call for this layer type (LAYER_TYPE_ARG) computes it

    @property
    def key(self) -> str:
        """The kind's key across towers, as traces/schema.py writes it ("q", "vision.q")."""
        return schema.kind_key(self.kind, self.tower)

    @property
    def each_layer(self) -> bool:
        """The row stands for one module in each layer (a per-layer kind, or a global kind gathered
        from every layer: per_layer_inputs)."""
        return LAYER in self.module


_TEXT = TOWERS[TEXT].root
_LAYER = f"{_TEXT}.layers.{LAYER}"
_VISION = TOWERS[VISION].root
_VLAYER = f"{_VISION}.{TOWERS[VISION].layers}.{LAYER}"
_AUDIO = TOWERS[AUDIO].root
_ALAYER = f"{_AUDIO}.{TOWERS[AUDIO].layers}.{LAYER}"


def _rope_rows() -> tuple[HFSite, ...]:
    rows = []
    for layer_type in LAYER_TYPE_SHORT:
        cos, sin = rope_kinds(layer_type)
        for kind, item in ((cos, 0), (sin, 1)):  # forward returns (cos, sin)
            rows.append(HFSite(kind, TEXT, f"{_TEXT}.rotary_emb", OUTPUT, item, layer_type=layer_type))
    return tuple(rows)


# Every canonical kind HF computes (the chosen token is generate()'s), in traces/schema.py's order.
SITES: tuple[HFSite, ...] = (
    # the first decoder layer's input: the input embeddings (images merged, scaled)
    HFSite("embeddings", TEXT, f"{_TEXT}.layers.0", INPUT, "hidden_states", position=0),
    # each decoder layer's own slice (None without per-layer inputs): stacked on the layer axis
    HFSite("per_layer_inputs", TEXT, _LAYER, INPUT, "per_layer_input", position=1),
    *_rope_rows(),
    HFSite("mask", TEXT, f"{_LAYER}.self_attn", ATTENTION, "attention_mask"),
    HFSite("q", TEXT, f"{_LAYER}.self_attn", ATTENTION, "query"),
    HFSite("k", TEXT, f"{_LAYER}.self_attn", ATTENTION, "key"),
    HFSite("v", TEXT, f"{_LAYER}.self_attn", ATTENTION, "value"),
    HFSite("attn_out", TEXT, f"{_LAYER}.self_attn", OUTPUT, 0),  # (o_proj's output, attention weights)
    HFSite("layer_out", TEXT, _LAYER, OUTPUT),
    HFSite("final_hidden", TEXT, f"{_TEXT}.norm", OUTPUT),
    HFSite("logits", TEXT, "", OUTPUT, "logits"),  # lm_head, soft-capped, in the model's forward
    # the vision tower (Gemma4VisionModel), run once in the prefill on every image at once
    HFSite("patch_embeddings", VISION, f"{_VISION}.patch_embedder", OUTPUT),
    HFSite("q", VISION, f"{_VLAYER}.self_attn", ATTENTION, "query"),
    HFSite("k", VISION, f"{_VLAYER}.self_attn", ATTENTION, "key"),
    HFSite("v", VISION, f"{_VLAYER}.self_attn", ATTENTION, "value"),
    HFSite("attn_out", VISION, f"{_VLAYER}.self_attn", OUTPUT, 0),
    HFSite("mlp_out", VISION, f"{_VLAYER}.mlp", OUTPUT),
    HFSite("layer_out", VISION, _VLAYER, OUTPUT),
    # pooled, padding stripped and standardized: no image axis (soft tokens image after image)
    HFSite("pooled", VISION, _VISION, OUTPUT, "last_hidden_state"),
    HFSite("soft_tokens", VISION, TOWERS[VISION].embedder, OUTPUT),  # embed_vision: no image axis either
    # the audio tower (Gemma4AudioModel), run once in the prefill on every clip at once: every row keeps
    # the clip axis and the padding frames (the recorder drops them)
    HFSite("subsampled", AUDIO, f"{_AUDIO}.subsample_conv_projection", OUTPUT, 0),  # (frames, mask)
    HFSite("ff1_out", AUDIO, f"{_ALAYER}.feed_forward1", OUTPUT),
    HFSite("attn_out", AUDIO, f"{_ALAYER}.self_attn", OUTPUT, 0),  # (post's output, attention weights)
    HFSite("lconv_out", AUDIO, f"{_ALAYER}.lconv1d", OUTPUT),
    HFSite("ff2_out", AUDIO, f"{_ALAYER}.feed_forward2", OUTPUT),
    HFSite("layer_out", AUDIO, _ALAYER, OUTPUT),
    HFSite("output_proj", AUDIO, f"{_AUDIO}.output_proj", OUTPUT),
    HFSite("soft_tokens", AUDIO, TOWERS[AUDIO].embedder, OUTPUT),  # embed_audio, before HF strips the padding
)
BY_KEY: dict[str, HFSite] = {s.key: s for s in SITES}
LOGITS = BY_KEY["logits"]


def root_path(model, tower: str = TEXT) -> str:
    """The path of a tower's model in `model` (the text tower of Gemma4ForCausalLM: TEXT_ONLY_ROOT)."""
    root = TOWERS[tower].root
    if tower == TEXT and not _has(model, root):
        return TEXT_ONLY_ROOT
    return root


def module_path(model, site: HFSite, layer: int | None = None) -> str:
    """The path in `model` of the module a row names (at `layer` for a per-layer row)."""
    path = site.module.replace(LAYER, str(layer)) if site.each_layer else site.module
    root = TOWERS[site.tower].root
    actual = root_path(model, site.tower)
    if actual != root and (path == root or path.startswith(root + ".")):
        path = actual + path[len(root) :]
    return path


def submodule(model, site: HFSite, layer: int | None = None):
    return model.get_submodule(module_path(model, site, layer))


def tower_model(model, tower: str = TEXT):
    """A tower's model in `model` (Gemma4TextModel for the text tower)."""
    return model.get_submodule(root_path(model, tower))


def layer_count(model, tower: str = TEXT) -> int:
    return len(tower_model(model, tower).get_submodule(TOWERS[tower].layers))


def output_of(site: HFSite, out):
    """The row's tensor in what its module's forward returned."""
    if site.item is None:
        return out
    return getattr(out, site.item) if isinstance(site.item, str) else out[site.item]


def input_of(site: HFSite, args: tuple, kwargs: dict):
    """The row's tensor among its module's forward arguments (None where not given)."""
    return _arg(args, kwargs, site.position, site.item)


def attention_tensors(query, key, value, attention_mask, tower: str = TEXT) -> dict[str, object]:
    """{kind: tensor} of a tower's ATTENTION rows, from one call of the attention function."""
    given = dict(zip(ATTENTION_ARGS, (query, key, value, attention_mask)))
    return {s.kind: given[s.item] for s in SITES if s.tensor == ATTENTION and s.tower == tower}


def has_tower(model, tower: str) -> bool:
    """Does `model` hold this tower (a text-only checkpoint has the text tower alone)?"""
    return tower == TEXT or _has(model, TOWERS[tower].root)


def install(model, put, sites: tuple[HFSite, ...] = SITES) -> list:
    """Hook every INPUT and OUTPUT row of `sites` below `model`: put(site, layer, tensor) is called
    with the tensor HF computes there (batch axis kept; an absent input is skipped), `layer` the
    layer's index for a per-layer row, else None. Returns the hooks' handles (remove() each)."""
    handles = []
    for site in sites:
        if site.tensor == ATTENTION or site.module == "":  # the caller's (see the module docstring)
            continue
        if not has_tower(model, site.tower):
            continue
        for layer in range(layer_count(model, site.tower)) if site.each_layer else (None,):
            module = submodule(model, site, layer)
            if site.tensor == OUTPUT:
                handles.append(module.register_forward_hook(_output_hook(site, layer, put), with_kwargs=True))
            else:
                handles.append(module.register_forward_pre_hook(_input_hook(site, layer, put), with_kwargs=True))
    return handles


def _output_hook(site: HFSite, layer, put):
    def hook(module, args, kwargs, out):
        if site.layer_type is not None and _arg(args, kwargs, *LAYER_TYPE_ARG) != site.layer_type:
            return
        put(site, layer, output_of(site, out))

    return hook


def _input_hook(site: HFSite, layer, put):
    def hook(module, args, kwargs):
        t = input_of(site, args, kwargs)
        if t is not None:
            put(site, layer, t)

    return hook


def _arg(args: tuple, kwargs: dict, position: int, name: str):
    return args[position] if len(args) > position else kwargs.get(name)


def _has(model, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True
