"""What each built-in runtime captures, as data: one capture map per adapter.

A map's rows (`Capture`) take the engine's own name for a value it computes (a llama.cpp graph
node, a step graph's output, an mlx-lm module, a TICO hook, ...) to a site template of the trace:
a kind key of traces/schema.py and, for a per-layer kind, where the layer number is read: the
`{layer}` field of the name (`{layer:02d}` where the name pads it), or of another name the row
gives in `layer_from` (llama.cpp's masks: the attention node's first operand). `*` in a name
stands for any text. `via` says how the value is read where the name alone does not: an operator
("MatMul"), an operator's operand ("MUL_MAT[0]": its first operand bears the name), a call's
input, words. Each adapter reads its names from its map, and what the registry says a runtime
captures (RuntimeSpec.not_captured, the README's "kinds captured", the refusal of a `--kinds` it
cannot capture) is derived from the row's map; tests/runtimes/test_conformance.py replays every
runtime and checks that its trace holds exactly the sites its map declares (within the sites the
model has: K/V only where a layer writes its own, per-layer inputs only with PLE, RoPE tables of
the layer types it has).

The chosen token is every runtime's (the replay driver writes it); the logits are a row like any
other kind (a runtime that gives text alone, LiteRT-LM, has none). Nothing here imports torch or
an engine: the registry reads the maps before anything heavy loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache, cached_property

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError

_FIELD = re.compile(r"\{layer(?::[^}]*)?\}|\*")
_OP = re.compile(r"([A-Z]\w*)(?:\[(\d+)\])?|(\w+)\[(\d+)\]")  # an operator (capitalized) or a name with an index


@cache
def pattern(native: str) -> re.Pattern:
    """A name pattern as a regular expression: `{layer}` (any format) a number, `*` any text."""
    out, at, seen = [], 0, False
    for m in _FIELD.finditer(native):
        out.append(re.escape(native[at : m.start()]))
        if m.group() == "*":
            out.append(".*")
        else:
            out.append("(?P<layer>[0-9]+)" if not seen else "(?P=layer)")
            seen = True
        at = m.end()
    out.append(re.escape(native[at:]))
    return re.compile("".join(out))


@dataclass(frozen=True)
class Capture:
    """One row of a capture map: a native name or pattern, and the kind it is."""

    native: str  # the engine's name: `{layer}` the layer number, `*` any text
    kind: str  # the kind key (traces/schema.py: "q", "vision.q")
    via: str = ""  # how the value is read where the name does not say: "OP", "OP[i]" (operand i), words
    layer_from: tuple[str, ...] = ()  # names holding `{layer}` when `native` does not (or words saying where)

    def __post_init__(self) -> None:
        if self.kind not in S.KIND_BY_NAME:
            raise ValueError(f"capture {self.native!r}: unknown kind {self.kind!r}")
        if S.layered(self.kind) and "{layer" not in self.native and not self.layer_from:
            raise ValueError(f"capture {self.native!r}: {self.kind} is per layer; say where its layer is read")

    @cached_property
    def regex(self) -> re.Pattern:
        return pattern(self.native)

    def matches(self, name: str) -> bool:
        return self.regex.fullmatch(name) is not None

    def layer_of(self, name: str) -> int | None:
        """The layer number `name` gives: by `native`'s {layer}, else by the first of `layer_from`
        that matches; None when none does."""
        for p in (self.native, *self.layer_from) if "{layer" in self.native else self.layer_from:
            m = pattern(p).fullmatch(name) if "{layer" in p else None
            if m is not None:
                return int(m.group("layer"))
        return None

    def site_of(self, name: str) -> S.Site | None:
        """The site `name` is when it is this row's name (a per-layer row whose layer is in it)."""
        m = self.regex.fullmatch(name)
        if m is None:
            return None
        layer = m.groupdict().get("layer")
        if S.layered(self.kind) != (layer is not None):
            return None
        return S.Site.of(self.kind, None if layer is None else int(layer))

    def name(self, layer: int | None = None) -> str:
        """The native name at `layer` (for a per-layer row); `*` stays as it is."""
        return self.native.format(layer=layer) if "{layer" in self.native else self.native

    def prefix(self, layer: int | None = None) -> str:
        """The name up to its first `*` (the whole name when it has none)."""
        return self.name(layer).partition("*")[0]

    @property
    def ops(self) -> tuple[tuple[str, int | None], ...]:
        """`via` read as operators: ((op, operand index or None), ...); () when it is words."""
        words = self.via.split()
        found = [_OP.fullmatch(w) for w in words]
        if not words or not all(found):
            return ()
        return tuple(
            (m.group(1), None if m.group(2) is None else int(m.group(2)))
            if m.group(1)
            else (m.group(3), int(m.group(4)))
            for m in found
        )


@dataclass(frozen=True)
class CaptureMap:
    """An adapter's capture map: every value it reads from its engine, as the kinds it reports."""

    engine: str  # whose names the rows hold
    rows: tuple[Capture, ...]

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        """Every kind key a replay by this runtime holds, in traces/schema.py's order (the token too)."""
        have = {r.kind for r in self.rows} | {S.KIND_TOKEN}
        return tuple(k for k in S.KIND_BY_NAME if k in have)

    @cached_property
    def towers(self) -> tuple[str, ...]:
        """The encoder towers whose kinds a replay by this runtime holds ("vision", "audio"). A map
        without the audio tower's is a runtime that runs none: an audio REF is refused before the
        model loads (RuntimeSpec.runs_audio, registry.check_inputs)."""
        return tuple(t for t in S.ENCODER_TOWERS if any(S.KIND_BY_NAME[k].tower == t for k in self.kinds))

    def not_captured(self) -> tuple[str, ...]:
        """The text tower's kinds a replay by this runtime never holds (absent, never zeros)."""
        return tuple(k for k in S.KIND_NAMES if k not in self.kinds)

    def text(self) -> str:
        """What it captures, for people (the README's "kinds captured"): "all kinds", "tokens only",
        "logits only", "all but mask and RoPE"; "; the vision tower's too" (or "the vision and audio
        towers' too") where it captures an encoder tower's."""
        missing, towers = self.not_captured(), self.towers
        more = f"; the {' and '.join(towers)} tower{'s' if len(towers) > 1 else ''}'s too" if towers else ""
        more = more.replace("towers's", "towers'")
        if not missing:
            return "all kinds" + more
        if set(missing) >= set(S.KIND_NAMES) - {S.KIND_TOKEN}:
            return "tokens only" + more
        if set(missing) >= set(S.KIND_NAMES) - {S.KIND_TOKEN, "logits"}:
            return "logits only" + more
        return "all but " + " and ".join(_kind_words(missing)) + more

    def check(self, kinds, who: str) -> None:
        """Refuse kinds asked of `who` (`--kinds`) that this map does not capture, in one line."""
        asked = set(kinds or ())
        missing = [k for k in S.ALL_KIND_KEYS if k in asked and k not in self.kinds]  # an encoder's too
        if missing:
            raise TraceToolError(
                f"--kinds {','.join(missing)}: {who} cannot capture {' or '.join(missing)} (it captures {self.text()})"
            )

    def sites(self, n_layers: int, towers: dict[str, int] | None = None) -> list[S.Site]:
        """Every site of the kinds captured in a text tower of n_layers layers and the encoder towers
        `towers` ({tower: its layer count}; a tower not given: none of its sites) (the model may lack some)."""
        counts = {S.TEXT: n_layers, **(towers or {})}
        out = []
        for k in self.kinds:
            tower = S.KIND_BY_NAME[k].tower
            if tower in counts:
                out += S.sites_of(k, counts[tower])
        return out

    def rows_of(self, kind: str) -> tuple[Capture, ...]:
        return tuple(r for r in self.rows if r.kind == kind)

    def row(self, kind: str) -> Capture:
        """The (first) row of a kind; KeyError when the map has none."""
        for r in self.rows:
            if r.kind == kind:
                return r
        raise KeyError(f"{self.engine}: no capture of {kind!r}")

    def site_of(self, name: str) -> S.Site | None:
        """The site a native name is (the first row whose name it is), None when it is none."""
        for r in self.rows:
            site = r.site_of(name)
            if site is not None:
                return site
        return None

    def name_of(self, kind: str, layer: int | None = None) -> str:
        return self.row(kind).name(layer)


def _kind_words(kinds: tuple[str, ...]) -> list[str]:
    """Kind names for people: the four RoPE tables are "RoPE", named last."""
    rope = [k for k in kinds if k in ROPE]
    return [k for k in kinds if k not in rope] + (["RoPE"] if rope else [])


def _probe_rows(name, towers: tuple[str, ...] = ()) -> tuple[Capture, ...]:
    """One row per kind the static runtime hands its probe: `name(kind)` its native name; the kinds
    of the text tower, and of the encoder `towers` it ports."""
    kinds = [k for k in S.KIND_NAMES if k not in ("logits", S.KIND_TOKEN)]
    kinds += [k.key for t in towers for k in S.TOWER_BY_NAME[t].kinds]
    return tuple(Capture(name(k), k) for k in kinds)


def _probe_call(key: str) -> str:
    """The static runtime's probe call of a kind key: probe.tensor("q", layer={layer}, tower="vision")."""
    spec = S.KIND_BY_NAME[key]
    args = [f'"{spec.name}"'] + (["layer={layer}"] if S.layered(key) else [])
    args += [f'tower="{spec.tower}"'] if spec.encoder else []
    return f"probe.tensor({', '.join(args)})"


ROPE = tuple(k for t in S.LAYER_TYPE_SHORT for k in S.rope_kinds(t))

# the static runtime (replayer/runtime.py) and its quantized variants: its probe calls
PROBE = CaptureMap(
    "the static runtime's probe calls (replayer/runtime.py)",
    (
        # the encoder towers' ports: replayer/static_vision.py, replayer/static_audio.py
        *_probe_rows(_probe_call, towers=("vision", "audio")),
        Capture("prefill() / decode()", "logits", via="the step's result"),
    ),
)

# onnx, openvino, executorch: replayer/functional.py's step graphs, the probe's kinds as extra outputs
STEP_GRAPH = CaptureMap(
    "the step graphs' output names (replayer/functional.py)",
    (Capture("logits", "logits"), *_probe_rows(lambda k: f"L{{layer:02d}}.{k}" if S.layered(k) else k)),
)


def _tower_graph_rows(tower: str) -> tuple[Capture, ...]:
    """A tower graph's output names (replayer/functional.py's VisionGraph, AudioGraph): "vision.L00.q"."""
    return tuple(
        Capture(f"{tower}.L{{layer:02d}}.{k.name}" if S.layered(k.key) else f"{tower}.{k.name}", k.key)
        for k in S.TOWER_BY_NAME[tower].kinds
    )


# the step graphs and the vision tower's graph (replayer/functional.py's VisionGraph)
STEP_GRAPH_VISION = CaptureMap(
    "the step graphs' and the vision graph's output names (replayer/functional.py)",
    (*STEP_GRAPH.rows, *_tower_graph_rows("vision")),
)

# onnx, openvino, executorch: the step graphs and the encoder towers' graphs (VisionGraph, AudioGraph)
STEP_GRAPH_TOWERS = CaptureMap(
    "the step graphs' and the vision and audio graphs' output names (replayer/functional.py)",
    (*STEP_GRAPH_VISION.rows, *_tower_graph_rows("audio")),
)

# replayer/runtimes/litert/lm.py: text in, text out, the token alone
TOKENS_ONLY = CaptureMap("LiteRT-LM's text (the chosen token alone)", ())
