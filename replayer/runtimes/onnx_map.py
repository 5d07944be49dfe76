"""`--onnx-map`: which tensor of the user's ONNX graph is which canonical kind, and how its inputs are fed.

A map is TOML (docs/runtime-onnx.md, "Your own file"):

    format = 1
    layout = "kv-cache"                     # one graph with past/present caches; or "step-graphs"
    [inputs]                                # kv-cache only; these are the defaults
    input_ids = "input_ids"
    attention_mask = "attention_mask"
    position_ids = "position_ids"
    past_key = "past_key_values.{cache}.key"
    past_value = "past_key_values.{cache}.value"
    [outputs]
    logits = "logits"
    present_key = "present.{cache}.key"
    present_value = "present.{cache}.value"
    [kinds]                                 # each a value's name, or a node's input or output
    embeddings = { value = "embeds" }
    layer_out = { node = "model/layers.{layer}/*", pick = "last", output = 0 }
    q = { node = "model/layers.{layer}/self_attn/*", op = "Attention", input = 0 }

A node is found by its name (`*` any run of characters; `{layer}` the layer, `{layer:02}` it
zero-padded), narrowed by `op` (its op type), `fed_by` (one of its inputs made by a node of that
name) and `after` (a node of that name upstream of it, any number of steps); `pick` says which of
several: "only" (the default: more than one is refused), "first" or "last" in graph order. Kinds the
map does not name are not captured. Two built-in maps: `export` (the tool's own step graphs, `trace
export-onnx`) and `mobius` (mobius-onnx's Gemma 4, its node names); the maps are untrusted input,
read bounded (traces/inputs.py) and checked here before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError, one_line
from gemma4_trace.traces.inputs import read_toml, tomllib

OPTION = "--onnx-map"
MAX_MAP = 64 << 10  # bytes of a map file
MAX_TEXT = 512  # characters of one name or pattern
MAX_INDEX = 1 << 16  # a node's input or output index
FORMAT = 1
KV, STEPS = "kv-cache", "step-graphs"
# the kinds a map may name: the text tower's, but logits (the layout's output) and the token (the driver's)
KINDS = tuple(k for k in S.KIND_NAMES if k not in ("logits", S.KIND_TOKEN))
PER_LAYER = frozenset(S.LAYER_KIND_NAMES)
INPUTS = {
    "input_ids": "input_ids",
    "attention_mask": "attention_mask",
    "position_ids": "position_ids",
    "past_key": "past_key_values.{cache}.key",
    "past_value": "past_key_values.{cache}.value",
}
OUTPUTS = {"logits": "logits", "present_key": "present.{cache}.key", "present_value": "present.{cache}.value"}
ENTRY_KEYS = {"value", "node", "op", "input", "output", "pick", "fed_by", "after"}
PICKS = ("only", "first", "last")
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")

_FORMATS = {"layer": ("{layer}", "{layer:02}"), "cache": ("{cache}",)}

EXPORT = """\
# the tool's own step graphs (trace export-onnx): every kind an output named <kind> or L07.<kind>
format = 1
layout = "step-graphs"
[kinds]
embeddings = { value = "embeddings" }
per_layer_inputs = { value = "per_layer_inputs" }
rope_cos_sliding = { value = "rope_cos_sliding" }
rope_sin_sliding = { value = "rope_sin_sliding" }
rope_cos_full = { value = "rope_cos_full" }
rope_sin_full = { value = "rope_sin_full" }
mask = { value = "L{layer:02}.mask" }
q = { value = "L{layer:02}.q" }
k = { value = "L{layer:02}.k" }
v = { value = "L{layer:02}.v" }
attn_out = { value = "L{layer:02}.attn_out" }
layer_out = { value = "L{layer:02}.layer_out" }
final_hidden = { value = "final_hidden" }
"""

MOBIUS = """\
# mobius-onnx's Gemma 4 text decoder (its node names; docs/runtime-mobius.md, "Kinds captured")
format = 1
layout = "kv-cache"
[kinds]
embeddings = { node = "model/embed_tokens/Mul_node_*", output = 0 }
per_layer_inputs = { node = "model/Mul_node_*", fed_by = "model/Add_node_*", output = 0 }
q = { node = "model/layers.{layer}/self_attn/*", op = "Attention", input = 0 }
k = { node = "model/layers.{layer}/self_attn/*", op = "Attention", input = 1 }
v = { node = "model/layers.{layer}/self_attn/*", op = "Attention", input = 2 }
attn_out = { node = "model/layers.{layer}/self_attn/o_proj/*", op = "MatMul", output = 0 }
layer_out = { node = "model/layers.{layer}/*", pick = "last", output = 0 }
final_hidden = { node = "model/norm/*", op = "RMSNormalization", output = 0 }
"""
BUILT_IN = {"export": EXPORT, "mobius": MOBIUS}
MOBIUS_NODES = ("model/embed_tokens/", "model/layers.0/self_attn/")  # a graph whose node names start so: mobius's


@dataclass(frozen=True)
class Entry:
    """Where one kind is in the graph: a value's name, or a node's input or output (patterns)."""

    kind: str
    value: str | None = None
    node: str | None = None
    op: str | None = None
    port: tuple[str, int] | None = None  # ("input" | "output", index)
    pick: str = "only"
    fed_by: str | None = None
    after: str | None = None  # a node of this name upstream of it (any number of steps)

    def text(self) -> str:
        if self.value is not None:
            return f"value {self.value!r}"
        return f"{self.port[0]} {self.port[1]} of node {self.node!r}" + (f" ({self.op})" if self.op else "")


@dataclass(frozen=True)
class NameMap:
    """A map read and checked: its name for the provenance, its layout, its kinds' entries."""

    name: str  # "built-in mobius", or "map.toml sha256:..."
    digest: str  # sha256 of its text (a cache key part)
    layout: str
    entries: tuple[Entry, ...]
    inputs: dict = field(default_factory=lambda: dict(INPUTS))
    outputs: dict = field(default_factory=lambda: dict(OUTPUTS))
    option: str = OPTION  # the option that gave it (in refusals): --onnx-map, --ir-map

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(e.kind for e in self.entries)


def _fail(where: str, why: str):
    raise TraceToolError(f"{where}: {why}")


def read_map(path, option: str = OPTION, maps: dict | None = None) -> NameMap:
    """`--onnx-map FILE` (or a built-in's name: export, mobius) read within bounds and checked; `option`
    and `maps` (its built-in maps, default BUILT_IN): another format's map option (`--ir-map`)."""
    maps = BUILT_IN if maps is None else maps
    text = str(path)
    if text in maps and not Path(text).exists():
        return built_in(text, option, maps)
    where = one_line(Path(text).name, 100)
    data = read_toml(path, option, MAX_MAP)  # a FIFO, device, folder or huge file: one line
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()  # its content
    return parse(data, f"{where} sha256:{digest[:16]}", digest, where, option)


def built_in(name: str, option: str = OPTION, maps: dict | None = None) -> NameMap:
    text = (BUILT_IN if maps is None else maps)[name]
    data = tomllib.loads(text)
    return parse(data, f"built-in {name}", hashlib.sha256(text.encode()).hexdigest(), f"built-in {name}", option)


def parse(data: dict, name: str, digest: str, where: str, option: str = OPTION) -> NameMap:
    """A map's parsed TOML checked: known keys of the right types, known kinds, placeholders that exist."""
    where = f"{option} {where}"
    unknown = sorted(set(data) - {"format", "layout", "inputs", "outputs", "kinds"})
    if unknown:
        _fail(where, f"unknown key {one_line(unknown[0], 60)!r} (format, layout, inputs, outputs, kinds)")
    if data.get("format", FORMAT) != FORMAT or isinstance(data.get("format"), bool):
        _fail(where, f"format {one_line(repr(data.get('format')), 40)} (this tool reads format {FORMAT})")
    layout = data.get("layout")
    if layout not in (KV, STEPS):
        _fail(where, f"layout {one_line(repr(layout), 60)}: expected {KV!r} or {STEPS!r}")
    tables = {}
    for table, defaults in (("inputs", INPUTS), ("outputs", OUTPUTS)):
        given = data.get(table, {})
        if not isinstance(given, dict):
            _fail(where, f"[{table}] is not a table")
        if given and layout == STEPS:
            _fail(where, f"[{table}] is for the {KV} layout (the step graphs' names are fixed)")
        for key, value in given.items():
            if key not in defaults:
                _fail(where, f"[{table}] has no key {one_line(key, 60)!r} ({', '.join(defaults)})")
            _pattern(where, f"[{table}] {key}", value, "cache" if "{cache}" in defaults[key] else None)
        tables[table] = {**defaults, **given}
    kinds = data.get("kinds")
    if not isinstance(kinds, dict) or not kinds:
        _fail(where, "[kinds] is missing or empty: name at least one kind")
    entries = tuple(_entry(where, kind, e) for kind, e in kinds.items())
    return NameMap(name, digest, layout, entries, tables["inputs"], tables["outputs"], option)


def _pattern(where: str, what: str, value, placeholder: str | None) -> str:
    """A name or pattern: a string of at most MAX_TEXT characters whose placeholders are `placeholder`'s."""
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        _fail(where, f"{what} must be a name of 1 to {MAX_TEXT} characters")
    allowed = _FORMATS.get(placeholder, ())
    for m in PLACEHOLDER.finditer(value):
        if m.group(0) not in allowed:
            ok = " or ".join(allowed) if allowed else "none here"
            _fail(where, f"{what}: placeholder {one_line(m.group(0), 40)} (allowed: {ok})")
    if placeholder == "cache" and "{cache}" not in value:
        _fail(where, f"{what} must hold {{cache}} (the cache's index)")
    return value


def _entry(where: str, kind: str, e) -> Entry:
    if kind not in KINDS:
        _fail(where, f"[kinds] {one_line(kind, 60)!r} is no kind a map names ({', '.join(KINDS)})")
    what = f"[kinds] {kind}"
    if not isinstance(e, dict):
        _fail(where, f"{what} must be a table (value = NAME, or node = PATTERN with input or output)")
    extra = sorted(set(e) - ENTRY_KEYS)
    if extra:
        _fail(where, f"{what} has unknown key {one_line(extra[0], 40)!r} ({', '.join(sorted(ENTRY_KEYS))})")
    layer = "layer" if kind in PER_LAYER else None
    if ("value" in e) == ("node" in e):
        _fail(where, f"{what} needs exactly one of value and node")
    if "value" in e:
        if set(e) != {"value"}:
            _fail(where, f"{what}: a value takes no {sorted(set(e) - {'value'})[0]}")
        return Entry(kind, value=_need_layer(where, what, _pattern(where, what, e["value"], layer), layer))
    ports = [p for p in ("input", "output") if p in e]
    if len(ports) != 1:
        _fail(where, f"{what}: a node needs exactly one of input and output (its index)")
    index = e[ports[0]]
    if type(index) is not int or not 0 <= index < MAX_INDEX:
        _fail(where, f"{what}: {ports[0]} must be an index from 0 to {MAX_INDEX - 1}")
    pick = e.get("pick", "only")
    if pick not in PICKS:
        _fail(where, f"{what}: pick {one_line(repr(pick), 40)} (one of {', '.join(PICKS)})")
    op = e.get("op")
    if op is not None:
        _pattern(where, f"{what} op", op, None)
    fed_by = e.get("fed_by")
    if fed_by is not None:
        _pattern(where, f"{what} fed_by", fed_by, layer)
    node = _need_layer(where, what, _pattern(where, what, e["node"], layer), layer)
    after = e.get("after")
    if after is not None:
        _pattern(where, f"{what} after", after, layer)
    return Entry(kind, node=node, op=op, port=(ports[0], index), pick=pick, fed_by=fed_by, after=after)


def _need_layer(where: str, what: str, value: str, layer) -> str:
    if layer and "{layer" not in value:
        _fail(where, f"{what} is a per-layer kind: its name must hold {{layer}} or {{layer:02}}")
    return value


def fill(pattern: str, **values: int) -> str:
    """A pattern's placeholders replaced ({layer}, {layer:02}, {cache}; a None value: left as it is)."""
    for key, v in values.items():
        if v is None:
            continue
        pattern = pattern.replace(f"{{{key}:02}}", f"{v:02d}").replace(f"{{{key}}}", str(v))
    return pattern


def matcher(pattern: str) -> re.Pattern:
    """A node-name pattern as a regular expression: `*` any run of characters, the rest literal."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)


def check_map(loaded, header: NameMap, allow_config_mismatch: bool) -> list[str]:
    """The companion's hand-over (spec.py FileInput.create): nothing to compare with REF's config
    until the graph is known (onnx_user.py resolves the map against it); no notes."""
    return []
