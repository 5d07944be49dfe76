"""Every HDF5 name of the trace format, the towers and their tables of canonical kinds, and sites.

Nothing outside `traces/` writes an HDF5 path string. A trace holds, for one prompt:

    /                       attrs: schema, schema_version, provenance (see PROVENANCE_KEYS)
    /inputs                 attrs: max_new_tokens, eos_token_ids, prompt_text, chat_template_applied
    /inputs/prompt_ids      (T,) int64, raw prompt ids (image tokens kept)
    /inputs/extra/<name>    model inputs besides ids (pixel_values, image_position_ids, ...)
    /model/<field>          per-layer metadata, one entry per decoder layer
    /steps/positions        (n_steps, 2) int64, [start, stop) absolute positions fed at each step
    /tensors/<kind>         global kinds, rows indexed by position (or by step)
    /tensors/L07/<kind>     per-layer kinds, rows indexed by absolute position
    /tensors/<path>.rows_present  (rows,) bool, only where a runtime reported a subset of some
                            step's rows: False rows hold zeros and are no data (never compared)
  and, in a trace with encoder towers (schema version 2; a text-only trace is version 1):
    /towers/<tower>         attrs: layers, hidden, heads, head_dim; datasets item_rows, item_tokens
                            (rows and soft tokens of each image or clip, in prompt order)
    /tensors/<tower>/<kind>       the tower's global kinds (rows: patches or frames, or soft tokens)
    /tensors/<tower>/L03/<kind>   its per-layer kinds (encoder layer 3)

A site `(tower, kind, layer)` addresses one dataset: `Site.path` composes its path and
`Site.parse` reads one back; nothing else composes or parses a `tensors/` path.

Step 0 is the prefill over positions 0..T-1; decode step s >= 1 feeds one token at
position T+s-1, so every position belongs to exactly one step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

SCHEMA_NAME = "gemma4-trace"
SCHEMA_VERSION = 2  # the newest version written and read
TEXT_SCHEMA_VERSION = 1  # a trace of the text tower alone is written as version 1, byte for byte as before

# root attributes
ATTR_SCHEMA = "schema"
ATTR_SCHEMA_VERSION = "schema_version"
ATTR_SOURCE_DTYPE = "source_dtype"
# optional attribute of a float kind's dataset: its values are not stored as floats. STORAGE_BF16:
# the dataset is uint16 holding each value's bfloat16 bit pattern (the upper half of its float32
# bits); a reader widens it to float32 exactly ((uint32(bits) << 16) viewed as float32). Written
# when the source dtype is bfloat16, so that no bit is lost. Absent: float16/32/64 as stored.
# Schema version unchanged: a reader without this refuses such a dataset's dtype; it never misreads it.
ATTR_STORAGE = "storage"
STORAGE_BF16 = "bfloat16-bits"
# optional: what a selective recording kept (JSON {"layers", "kinds", "steps"}; traces/selection.py).
# Absent: everything. Schema version unchanged: a reader without it still reads such a trace right
# (left-out kinds are absent, left-out steps are rows flagged absent); it cannot say why.
ATTR_SELECTION = "selection"
# optional: the positions the runtime that wrote a replay held (its KV cache, --max-seq). Absent in a
# recording, an import, or a replay written before it existed. Schema version unchanged: a reader without
# it reads such a trace right; it cannot check a graph's length against the run (trace diff --graph).
ATTR_MAX_SEQ = "max_seq"
# provenance: root attributes, one text each (model_config: JSON text)
ATTR_MODE = "mode"  # "teacher-forced" | "free-running" | "reference" | "isolated" (MODES)
ATTR_MODEL_CONFIG = "model_config"  # JSON text
PROVENANCE_KEYS = (
    "creator_version",
    "torch_version",
    "transformers_version",
    "h5py_version",
    "dtype",
    "device",
    "runtime",
    ATTR_MODE,
    "model_name",
    ATTR_MODEL_CONFIG,
    "model_config_sha256",
)

# groups and datasets
GROUP_INPUTS = "inputs"
DSET_PROMPT_IDS = f"{GROUP_INPUTS}/prompt_ids"
GROUP_INPUT_EXTRA = f"{GROUP_INPUTS}/extra"
GROUP_MODEL = "model"
# per-layer metadata: one dataset per traces.layers.LayerInfo field, named as the field
FIELD_LAYER_TYPE, FIELD_KV_ROLE, FIELD_KV_SOURCE = "layer_type", "kv_role", "kv_source"
FIELD_HEAD_DIM, FIELD_NUM_HEADS, FIELD_NUM_KV_HEADS = "head_dim", "num_heads", "num_kv_heads"
LAYER_FIELDS = (FIELD_LAYER_TYPE, FIELD_HEAD_DIM, FIELD_NUM_HEADS, FIELD_NUM_KV_HEADS, FIELD_KV_ROLE, FIELD_KV_SOURCE)
LAYER_TEXT_FIELDS = (FIELD_LAYER_TYPE, FIELD_KV_ROLE)  # stored as text; the other fields as integers
GROUP_STEPS = "steps"
DSET_STEP_POSITIONS = f"{GROUP_STEPS}/positions"
GROUP_TENSORS = "tensors"
LAYER_GROUP_PREFIX = "L"  # tensors/L07: the per-layer group of layer 7
GROUP_TOWERS = "towers"  # version 2: one group per encoder tower the trace holds
# the encoder tower table's fields: integer attributes of towers/<tower> (read from its sub-config) ...
TOWER_ATTRS = ("layers", "hidden", "heads", "head_dim")
# ... and its datasets: rows (patches or frames) and soft tokens of each image or clip, in prompt order
DSET_ITEM_ROWS, DSET_ITEM_TOKENS = "item_rows", "item_tokens"
TOWER_DSETS = (DSET_ITEM_ROWS, DSET_ITEM_TOKENS)

# attributes of the inputs group
ATTR_MAX_NEW_TOKENS = "max_new_tokens"
ATTR_EOS_TOKEN_IDS = "eos_token_ids"  # every EOS id, sorted
ATTR_PROMPT_TEXT = "prompt_text"
ATTR_CHAT_TEMPLATE_APPLIED = "chat_template_applied"


def leaf(path: str) -> str:
    """The last name of an HDF5 path (a member's name in its group)."""
    return path.rsplit("/", 1)[-1]


# the names each group above tensors/ may hold (tensors/ is checked kind by kind)
MEMBERS = {
    "/": (GROUP_INPUTS, GROUP_MODEL, GROUP_STEPS, GROUP_TENSORS, GROUP_TOWERS),
    GROUP_INPUTS: (leaf(DSET_PROMPT_IDS), leaf(GROUP_INPUT_EXTRA)),
    GROUP_MODEL: LAYER_FIELDS,
    GROUP_STEPS: (leaf(DSET_STEP_POSITIONS),),
}

MODES = (
    "reference",
    "teacher-forced",
    "free-running",
    "isolated",
)  # isolated: teacher-forced, every layer fed REF's input
KV_ROLES = ("owns", "stores", "reuses")

# layer types as HF names them, and their short suffix in RoPE kind names
LAYER_TYPE_SHORT = {"sliding_attention": "sliding", "full_attention": "full"}


# numpy dtype kinds (dtype.kind) a kind may be stored with, by the table's dtype word
DTYPE_KINDS = {"float": "f", "bool": "b", "int": "iu"}


@dataclass(frozen=True)
class Axis:
    """One axis of a kind's row: every fact about it that some part of the tool needs."""

    name: str  # as docs/trace-format.md writes the row shape
    width: str  # the config fact that bounds it (traces/limits.py row_limits): see WIDTHS
    report: str | None = None  # its name in a diff's element report (None: only "channel")
    dump: str = "d"  # its name in a dump map's `axes` (docs/import.md)
    meta: str | None = None  # the layer metadata (or "layers") its size must equal, checked on read


# what bounds an axis's size (the reader refuses a row ROW_SLACK times wider than the config says); an
# encoder tower's own widths are read from its sub-config, "model_hidden" is the text tower's width
WIDTHS = ("hidden", "ple", "layers", "heads", "head_dim", "vocab", "keys", "model_hidden")

_HIDDEN = Axis("hidden", "hidden")
_HEAD_DIM = Axis("head_dim", "head_dim")

# What one row of a kind is: the row index types. Only traces/ compares a kind's index with these;
# everything else asks a Kind (`by_step`, `by_position`, `encoder`) or traces/rows.py.
ROW_POSITION = "position"  # one row per absolute token position (text tower)
ROW_STEP = "step"  # one row per step (logits, the chosen token)
ROW_PATCH = "patch"  # one row per real image patch, image after image (vision tower)
ROW_FRAME = "frame"  # one row per subsampled audio frame, clip after clip (audio tower)
ROW_SOFT_TOKEN = "soft_token"  # one row per soft token of an encoder tower, item after item
ROW_INDEXES = (ROW_POSITION, ROW_STEP, ROW_PATCH, ROW_FRAME, ROW_SOFT_TOKEN)

TEXT = "text"  # the text decoder's tower: every kind of a version-1 trace


@dataclass(frozen=True)
class Kind:
    name: str
    per_layer: bool
    index: str  # one of ROW_INDEXES: what one row is
    dtype: str  # "float" (stored float32, source dtype in an attribute) | "bool" | "int" (int64)
    axes: tuple[Axis, ...]  # one row's axes (after the row axis)
    doc: str
    residual: bool = False  # the residual stream: the inputs a divergence's origin is judged against
    layer_input: bool = False  # some layer's input: what --isolate hands back from REF
    tower: str = TEXT

    @property
    def key(self) -> str:
        """The kind's name across towers: "layer_out" (text), "vision.layer_out" (an encoder's)."""
        return self.name if self.tower == TEXT else f"{self.tower}.{self.name}"

    @property
    def by_step(self) -> bool:
        """One row per step (logits, token)."""
        return self.index == ROW_STEP

    @property
    def by_position(self) -> bool:
        """One row per absolute token position of the text tower."""
        return self.index == ROW_POSITION

    @property
    def encoder(self) -> bool:
        """A kind of an encoder tower: rows are its patches, frames or soft tokens, all made in the prefill."""
        return self.tower != TEXT

    @property
    def row_ndim(self) -> int:
        return len(self.axes)

    @property
    def shape(self) -> str:
        """The row shape as docs/trace-format.md writes it."""
        names = [a.name for a in self.axes]
        text = "()" if not names else f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"
        return text + (" bool" if self.dtype == "bool" else "")

    @property
    def grows(self) -> bool:
        """The key axis grows with the run (its rows get wider step by step)."""
        return any(a.width == "keys" for a in self.axes)


def _rope(name: str, layer_type: str) -> Kind:
    head_dim = Axis(f"head_dim_{layer_type}", "head_dim")
    return Kind(name, False, "position", "float", (head_dim,), f"RoPE {name.split('_')[1]}, {layer_type} layers")


_HEADS = Axis("heads", "heads", report="head", dump="head", meta=FIELD_NUM_HEADS)
_KV_HEADS = Axis("kv_heads", "heads", report="head", dump="head", meta=FIELD_NUM_KV_HEADS)

KIND_TOKEN = "token"  # the chosen tokens: every trace holds them

# The canonical kinds in data-flow order: the order `trace diff` searches them in.
KINDS: tuple[Kind, ...] = (
    Kind(
        "embeddings",
        False,
        "position",
        "float",
        (_HIDDEN,),
        "input embeddings after vision merge",
        residual=True,
        layer_input=True,
    ),
    Kind(
        "per_layer_inputs",
        False,
        "position",
        "float",
        (Axis("L", "layers", report="ple_layer", dump="layer", meta="layers"), Axis("ple_dim", "ple")),
        "per-layer inputs as fed to layers",
        layer_input=True,
    ),
    _rope("rope_cos_sliding", "sliding"),
    _rope("rope_sin_sliding", "sliding"),
    _rope("rope_cos_full", "full"),
    _rope("rope_sin_full", "full"),
    Kind(
        "mask",
        True,
        "position",
        "bool",
        (Axis("K", "keys", dump="key"),),
        "allowed[query_pos, key_pos] over absolute key positions",
    ),
    Kind("q", True, "position", "float", (_HEADS, _HEAD_DIM), "query after q_norm and RoPE"),
    Kind("k", True, "position", "float", (_KV_HEADS, _HEAD_DIM), "key row written at this position (k_norm, RoPE)"),
    Kind("v", True, "position", "float", (_KV_HEADS, _HEAD_DIM), "value row written at this position (v_norm)"),
    Kind("attn_out", True, "position", "float", (_HIDDEN,), "attention output after o_proj"),
    Kind(
        "layer_out",
        True,
        "position",
        "float",
        (_HIDDEN,),
        "decoder layer output (residual stream)",
        residual=True,
        layer_input=True,
    ),
    Kind("final_hidden", False, "position", "float", (_HIDDEN,), "hidden state after the final norm", residual=True),
    Kind(
        "logits",
        False,
        "step",
        "float",
        (Axis("vocab", "vocab", report="vocab_id"),),
        "soft-capped logits at the predicting position",
    ),
    Kind(KIND_TOKEN, False, "step", "int", (), "token chosen at this step"),
)
KIND_NAMES = tuple(k.name for k in KINDS)
LAYER_KIND_NAMES = tuple(k.name for k in KINDS if k.per_layer)
RESIDUAL_KINDS = tuple(k.name for k in KINDS if k.residual)
LAYER_INPUT_KINDS = tuple(k.name for k in KINDS if k.layer_input)


# ---------------------------------------------------------------------- encoder towers
_ENC_HEADS = Axis("heads", "heads", report="head", dump="head")


def _encoder_kinds(
    tower: str, row: str, first: Kind, last: tuple[Kind, ...], mlp: str | None = None
) -> tuple[Kind, ...]:
    """An encoder tower's kinds in data-flow order: its input rows, q/k/v, attention (and MLP, where
    `mlp` says what it is) and layer outputs per encoder layer, then what it hands the text tower."""
    layer = (
        Kind("q", True, row, "float", (_ENC_HEADS, _HEAD_DIM), "query after q_norm and RoPE"),
        Kind("k", True, row, "float", (_ENC_HEADS, _HEAD_DIM), "key after k_norm and RoPE"),
        Kind("v", True, row, "float", (_ENC_HEADS, _HEAD_DIM), "value after v_norm"),
        Kind("attn_out", True, row, "float", (_HIDDEN,), "attention output after o_proj"),
        *((Kind("mlp_out", True, row, "float", (_HIDDEN,), mlp),) if mlp else ()),
        Kind("layer_out", True, row, "float", (_HIDDEN,), "encoder layer output", residual=True),
    )
    return tuple(replace(k, tower=tower) for k in (first, *layer, *last))


_SOFT_TOKENS = Kind(
    "soft_tokens",
    False,
    ROW_SOFT_TOKEN,
    "float",
    (Axis("model_hidden", "model_hidden"),),
    "soft tokens as merged into the text tower's embeddings (unscaled)",
)


@dataclass(frozen=True)
class Tower:
    """One tower of the model: its kinds in data-flow order, where it reads its sizes, where it joins."""

    name: str
    config: str  # the sub-config its layer count and widths are read from
    rows: str  # the row index of its per-layer kinds
    kinds: tuple[Kind, ...]
    joins: str | None  # the text kind its soft tokens become rows of (None: the text tower itself)
    token_id: str | None  # the top-level config key of the token its soft tokens replace
    doc: str
    item: str = "prompt"  # what one of its inputs is, for people: "image", "clip"


TOWERS: tuple[Tower, ...] = (
    Tower(
        "vision",
        "vision_config",
        ROW_PATCH,
        _encoder_kinds(
            "vision",
            ROW_PATCH,
            Kind(
                "patch_embeddings",
                False,
                ROW_PATCH,
                "float",
                (_HIDDEN,),
                "patch projection + 2D position table",
                residual=True,
            ),
            (
                Kind("pooled", False, ROW_SOFT_TOKEN, "float", (_HIDDEN,), "patches pooled k x k (std scaled)"),
                _SOFT_TOKENS,
            ),
            mlp="MLP output (down_proj, before post_feedforward_layernorm)",
        ),
        "embeddings",
        "image_token_id",
        "the vision encoder: rows are real image patches (padding stripped), image after image",
        "image",
    ),
    Tower(
        "audio",
        "audio_config",
        ROW_FRAME,
        tuple(
            replace(k, tower="audio")
            for k in (
                Kind(
                    "subsampled",
                    False,
                    ROW_FRAME,
                    "float",
                    (_HIDDEN,),
                    "log-mel frames after the subsampling convs and their projection",
                    residual=True,
                ),
                Kind("ff1_out", True, ROW_FRAME, "float", (_HIDDEN,), "feed_forward1's output, its half step added"),
                Kind("attn_out", True, ROW_FRAME, "float", (_HIDDEN,), "chunked local attention's output (post)"),
                Kind("lconv_out", True, ROW_FRAME, "float", (_HIDDEN,), "lconv1d's output (causal depthwise conv)"),
                Kind("ff2_out", True, ROW_FRAME, "float", (_HIDDEN,), "feed_forward2's output, its half step added"),
                Kind("layer_out", True, ROW_FRAME, "float", (_HIDDEN,), "conformer layer output", residual=True),
                # output_proj_dims wide: bounded by the text tower's width (E2B/E4B: equal to it)
                Kind("output_proj", False, ROW_FRAME, "float", (Axis("proj", "model_hidden"),), "output_proj"),
                _SOFT_TOKENS,
            )
        ),
        "embeddings",
        "audio_token_id",
        "the audio encoder (conformer): rows are subsampled frames, padding dropped, clip after clip",
        "clip",
    ),
    Tower("text", "text_config", ROW_POSITION, KINDS, None, None, "the text decoder: rows are token positions"),
)
TOWER_BY_NAME = {t.name: t for t in TOWERS}
ENCODER_TOWERS = tuple(t.name for t in TOWERS if t.name != TEXT)
# every kind of every tower, by key ("layer_out", "vision.layer_out"), towers in data-flow order
KIND_BY_NAME = {k.key: k for t in TOWERS for k in t.kinds}
ALL_KIND_KEYS = tuple(KIND_BY_NAME)


def rope_kinds(layer_type: str) -> tuple[str, str]:
    """The (cos, sin) kind names for an HF layer type."""
    short = LAYER_TYPE_SHORT[layer_type]
    return f"rope_cos_{short}", f"rope_sin_{short}"


def spec_of(key: str) -> Kind:
    """The Kind of a key ("q", "vision.q"); KeyError names the key when no tower has it."""
    return KIND_BY_NAME[key]


def kind_key(kind: str, tower: str = TEXT) -> str:
    """A kind's key in a tower: ("layer_out", "vision") -> "vision.layer_out"."""
    return kind if tower == TEXT else f"{tower}.{kind}"


@dataclass(frozen=True)
class Site:
    """The address of one dataset of a trace: a kind of a tower, at a layer of that tower (None: global)."""

    tower: str
    kind: str
    layer: int | None = None

    def __post_init__(self) -> None:
        spec = KIND_BY_NAME.get(kind_key(self.kind, self.tower))
        if spec is None or spec.tower != self.tower or spec.name != self.kind:
            raise ValueError(f"no kind {self.kind!r} in the {self.tower!r} tower")
        if spec.per_layer != (self.layer is not None):
            what = "per layer" if spec.per_layer else "global"
            raise ValueError(f"kind {self.key!r} is {what}; got layer={self.layer}")
        if self.layer is not None:
            try:  # an integer of any kind (numpy's too), never a bool
                layer = operator.index(self.layer) if not isinstance(self.layer, bool) else -1
            except TypeError:
                layer = -1
            if layer < 0:
                raise ValueError(f"layer {self.layer!r} of {self.key!r} is not a layer number")
            object.__setattr__(self, "layer", layer)

    @classmethod
    def of(cls, key: str, layer: int | None = None) -> Site:
        """The site of a kind key and a layer: ("vision.q", 3) -> Site("vision", "q", 3)."""
        spec = KIND_BY_NAME.get(key)
        if spec is None:
            raise ValueError(f"unknown kind {key!r}")
        return cls(spec.tower, spec.name, layer)

    @property
    def key(self) -> str:
        return kind_key(self.kind, self.tower)

    @property
    def spec(self) -> Kind:
        return KIND_BY_NAME[self.key]

    @property
    def path(self) -> str:
        """The HDF5 path of the site's dataset: the only place tensor paths are composed."""
        group = GROUP_TENSORS if self.tower == TEXT else f"{GROUP_TENSORS}/{self.tower}"
        if self.layer is None:
            return f"{group}/{self.kind}"
        return f"{group}/{LAYER_GROUP_PREFIX}{self.layer:02d}/{self.kind}"

    @classmethod
    def parse(cls, path: str) -> Site:
        """A tensor path back to its site; ValueError when no site has that path (names checked,
        a layer group's number written as the writer writes it: L07, L123)."""
        parts = path.split("/")
        if len(parts) < 2 or parts[0] != GROUP_TENSORS:
            raise ValueError(f"{path!r} is not under {GROUP_TENSORS}/")
        tower = parts[1] if len(parts) > 2 and parts[1] in ENCODER_TOWERS else TEXT
        rest = parts[2:] if tower != TEXT else parts[1:]
        layer = None
        if len(rest) == 2:
            layer = layer_number(rest[0])
            if layer is None:
                raise ValueError(f"{path!r}: {rest[0]!r} is not a layer group (L00, L01, ...)")
        elif len(rest) != 1:
            raise ValueError(f"{path!r} is not a tensor path")
        site = cls(tower, rest[-1], layer)
        if site.path != path:
            raise ValueError(f"{path!r} is not a tensor path")
        return site

    def __str__(self) -> str:
        return self.key if self.layer is None else f"{self.key} layer {self.layer}"


def layer_number(group: str) -> int | None:
    """The layer of a layer group's name ("L07" -> 7), None when it is not one as the writer names them."""
    digits = group[len(LAYER_GROUP_PREFIX) :]
    if not group.startswith(LAYER_GROUP_PREFIX) or not digits.isdigit() or not digits.isascii() or len(digits) > 6:
        return None  # (int() of thousands of digits raises: no trace has a million layers)
    n = int(digits)
    return n if f"{LAYER_GROUP_PREFIX}{n:02d}" == group else None


def layered(key: str) -> bool:
    """Is a kind one dataset per layer of its tower (q, layer_out), or one for the trace (logits)?"""
    return KIND_BY_NAME[key].per_layer


def layer_rule(key: str) -> str:
    """'per layer' or 'global (layer=None)': where a kind's rows are reported."""
    return "per layer" if layered(key) else "global (layer=None)"


def tower_group(tower: str) -> str:
    """tensors/ or tensors/<tower>: where a tower's datasets live."""
    return GROUP_TENSORS if tower == TEXT else f"{GROUP_TENSORS}/{tower}"


def layer_group(layer: int, tower: str = TEXT) -> str:
    return f"{tower_group(tower)}/{LAYER_GROUP_PREFIX}{layer:02d}"


def sites_of(key: str, n_layers: int) -> list[Site]:
    """Every site of a kind key in a tower of n_layers layers (one for a global kind)."""
    spec = KIND_BY_NAME[key]
    return [Site(spec.tower, spec.name, l) for l in (range(n_layers) if spec.per_layer else [None])]


def dataflow(layers: dict[str, int]) -> list[Site]:
    """Every site of the towers given ({tower: its layer count}), in data-flow order: the encoder
    towers first (their soft tokens join the text tower's embeddings), then the text tower; within
    a tower its global kinds before the first per-layer kind, each layer's kinds, then the rest."""
    out = []
    for t in TOWERS:
        if t.name not in layers:
            continue
        first = next(i for i, k in enumerate(t.kinds) if k.per_layer)
        per = [k for k in t.kinds if k.per_layer]
        out += [Site(t.name, k.name) for k in t.kinds[:first]]
        out += [Site(t.name, k.name, l) for l in range(layers[t.name]) for k in per]
        out += [Site(t.name, k.name) for k in t.kinds[first:] if not k.per_layer]
    return out


def tensor_path(kind: str, layer: int | None) -> str:
    """The HDF5 path of a kind key's dataset (Site.path composes it)."""
    return Site.of(kind, layer).path


ROWS_PRESENT_SUFFIX = ".rows_present"


def rows_present_path(kind: str, layer: int | None) -> str:
    """The HDF5 path of a position-indexed kind's row-presence flags (written only when some row is absent)."""
    return tensor_path(kind, layer) + ROWS_PRESENT_SUFFIX


def model_field_path(field: str) -> str:
    return f"{GROUP_MODEL}/{field}"


def tower_path(tower: str, dataset: str | None = None) -> str:
    """towers/<tower> (its table's group) or one of its datasets."""
    return f"{GROUP_TOWERS}/{tower}" + (f"/{dataset}" if dataset else "")


def input_extra_path(name: str) -> str:
    return f"{GROUP_INPUT_EXTRA}/{name}"
