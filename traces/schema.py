"""Every HDF5 name of the trace format, and the table of canonical kinds.

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

Step 0 is the prefill over positions 0..T-1; decode step s >= 1 feeds one token at
position T+s-1, so every position belongs to exactly one step.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_NAME = "gemma4-trace"
SCHEMA_VERSION = 1

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
    "/": (GROUP_INPUTS, GROUP_MODEL, GROUP_STEPS, GROUP_TENSORS),
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


# what bounds an axis's size (the reader refuses a row ROW_SLACK times wider than the config says)
WIDTHS = ("hidden", "ple", "layers", "heads", "head_dim", "vocab", "keys")

_HIDDEN = Axis("hidden", "hidden")
_HEAD_DIM = Axis("head_dim", "head_dim")


@dataclass(frozen=True)
class Kind:
    name: str
    per_layer: bool
    index: str  # "position": one row per absolute position; "step": one row per step
    dtype: str  # "float" (stored float32, source dtype in an attribute) | "bool" | "int" (int64)
    axes: tuple[Axis, ...]  # one row's axes (after the row axis)
    doc: str
    residual: bool = False  # the residual stream: the inputs a divergence's origin is judged against
    layer_input: bool = False  # some layer's input: what --isolate hands back from REF

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
KIND_BY_NAME = {k.name: k for k in KINDS}
KIND_NAMES = tuple(k.name for k in KINDS)
LAYER_KIND_NAMES = tuple(k.name for k in KINDS if k.per_layer)
RESIDUAL_KINDS = tuple(k.name for k in KINDS if k.residual)
LAYER_INPUT_KINDS = tuple(k.name for k in KINDS if k.layer_input)


def rope_kinds(layer_type: str) -> tuple[str, str]:
    """The (cos, sin) kind names for an HF layer type."""
    short = LAYER_TYPE_SHORT[layer_type]
    return f"rope_cos_{short}", f"rope_sin_{short}"


def layer_group(layer: int) -> str:
    return f"{GROUP_TENSORS}/{LAYER_GROUP_PREFIX}{layer:02d}"


def tensor_path(kind: str, layer: int | None) -> str:
    """The HDF5 path of a kind's dataset: the only place names are composed."""
    spec = KIND_BY_NAME[kind]
    if spec.per_layer != (layer is not None):
        raise ValueError(f"kind {kind!r} is {'per layer' if spec.per_layer else 'global'}; got layer={layer}")
    return f"{layer_group(layer)}/{kind}" if layer is not None else f"{GROUP_TENSORS}/{kind}"


ROWS_PRESENT_SUFFIX = ".rows_present"


def rows_present_path(kind: str, layer: int | None) -> str:
    """The HDF5 path of a position-indexed kind's row-presence flags (written only when some row is absent)."""
    return tensor_path(kind, layer) + ROWS_PRESENT_SUFFIX


def model_field_path(field: str) -> str:
    return f"{GROUP_MODEL}/{field}"


def input_extra_path(name: str) -> str:
    return f"{GROUP_INPUT_EXTRA}/{name}"
