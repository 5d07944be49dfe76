"""Selective recording: which layers, kinds and steps a trace keeps (`--layers 0-3,17
--kinds q,k,v,layer_out --steps 0-4` on `trace record` and `trace replay`).

`--layers` names the text tower's layers; `TOWER:` names another tower's from there on
(`--layers vision:0-1`, `--layers 0-3,vision:0,1`). A tower it does not name keeps every layer.

Logits and the chosen token are always kept (the diff and free-running replay need them).
A (kind, layer) left out is not written at all; a step left out is written as zero rows
flagged absent (`<kind>.rows_present`), so every kept dataset still has one row per position.
The writer stores the selection as the root attribute `selection` (JSON, schema.ATTR_SELECTION);
readers that predate it read such a trace correctly, they only cannot say why rows are absent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import schema as S
from .errors import TraceToolError

ALWAYS_KEPT = ("logits", "token")
MAX_SELECTED = 1 << 20  # values one --layers / --steps may select (no run has more steps: limits.MAX_POSITIONS)


def parse_ranges(text: str, what: str) -> tuple[int, ...]:
    """'0-3,17' -> (0, 1, 2, 3, 17); a bad range is a TraceToolError naming the option."""
    out: set[int] = set()
    total = 0
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        a, sep, b = part.partition("-")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise TraceToolError(f"--{what} {text!r}: expected numbers and ranges like 0-3,17") from None
        if lo < 0 or hi < lo:
            raise TraceToolError(f"--{what} {text!r}: bad range {part!r} (want a-b with 0 <= a <= b)")
        if hi - lo > 1_000_000:
            raise TraceToolError(f"--{what} {text!r}: range {part!r} is too large")
        total += hi - lo + 1
        if total > MAX_SELECTED:  # checked before the set grows: a trace's attribute is untrusted
            raise TraceToolError(f"--{what}: more than {MAX_SELECTED} values selected ({text[:40]}...)")
        out.update(range(lo, hi + 1))
    if not out:
        raise TraceToolError(f"--{what} {text!r}: nothing selected")
    return tuple(sorted(out))


def unknown_tower_kind(option: str, key: str) -> str:
    """The one line for a TOWER.KIND that names no kind of any tower."""
    tower, _, kind = key.partition(".")
    if tower not in S.ENCODER_TOWERS:
        towers = ", ".join(S.ENCODER_TOWERS)
        return f"{option}: unknown tower {tower!r} in {key!r} (towers: {towers}; the text tower's kinds have no prefix)"
    names = [k.name for k in S.TOWER_BY_NAME[tower].kinds]
    return f"{option}: the {tower} tower has no kind {kind!r} (its kinds: {', '.join(names)})"


def ranges_text(values) -> str:
    """(0, 1, 2, 3, 17) -> '0-3,17'."""
    vals, parts = sorted(values), []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(parts)


def parse_layers(text: str) -> tuple[tuple[int, ...] | None, tuple[tuple[str, tuple[int, ...]], ...]]:
    """'0-3,vision:0,1' -> ((0, 1, 2, 3), (("vision", (0, 1)),)): the text tower's layers (None when
    only other towers are named) and each named encoder tower's."""
    groups: dict[str, list[str]] = {}
    tower = S.TEXT
    for part in text.replace(" ", "").split(","):
        if ":" in part:
            tower, _, part = part.partition(":")
            if tower not in S.TOWER_BY_NAME:
                towers = ", ".join(t.name for t in S.TOWERS)
                raise TraceToolError(f"--layers {text[:60]!r}: unknown tower {tower[:40]!r} (towers: {towers})")
            if tower in groups:
                raise TraceToolError(f"--layers {text[:60]!r}: the {tower} tower is named twice")
        groups.setdefault(tower, []).append(part)
    parsed = {t: parse_ranges(",".join(parts), "layers") for t, parts in groups.items()}
    text_layers = parsed.pop(S.TEXT, None)
    return text_layers, tuple((t, parsed[t]) for t in S.ENCODER_TOWERS if t in parsed)


@dataclass(frozen=True)
class Selection:
    layers: tuple[int, ...] | None = None  # None: every layer (of the text tower)
    kinds: tuple[str, ...] | None = None  # None: every kind
    steps: tuple[int, ...] | None = None  # None: every step
    tower_layers: tuple[tuple[str, tuple[int, ...]], ...] = ()  # encoder towers' layers; one not named: all

    def layers_of(self, tower: str) -> tuple[int, ...] | None:
        """The layers kept of a tower (None: every layer)."""
        return self.layers if tower == S.TEXT else dict(self.tower_layers).get(tower)

    def layers_text(self) -> str | None:
        """'0-3,vision:0-1' (None: every layer of every tower)."""
        parts = [] if self.layers is None else [ranges_text(self.layers)]
        parts += [f"{t}:{ranges_text(v)}" for t, v in self.tower_layers]
        return ",".join(parts) or None

    @classmethod
    def parse(cls, layers: str | None = None, kinds: str | None = None, steps: str | None = None) -> Selection | None:
        """The CLI's filter strings -> a Selection (None when nothing is filtered)."""
        if layers is None and kinds is None and steps is None:
            return None
        k = None
        if kinds is not None:
            names = tuple(dict.fromkeys(x for x in kinds.replace(" ", "").split(",") if x))
            bad = [x for x in names if x not in S.KIND_BY_NAME]
            if bad and "." in bad[0]:  # an encoder tower's kind: TOWER.KIND
                raise TraceToolError(unknown_tower_kind("--kinds", bad[0]))
            if bad or not names:
                raise TraceToolError(
                    f"--kinds: unknown kind {bad[0] if bad else kinds!r} (known: {', '.join(S.KIND_NAMES)})"
                )
            k = tuple(x for x in S.ALL_KIND_KEYS if x in names or x in ALWAYS_KEPT)
        text_layers, tower_layers = parse_layers(layers) if layers is not None else (None, ())
        return cls(text_layers, k, parse_ranges(steps, "steps") if steps is not None else None, tower_layers)

    def check(self, n_layers: int, max_steps: int, towers=None) -> None:
        """Refuse layers the model does not have and steps the run cannot reach. `towers`: {encoder
        tower: its layer count} of the towers the run records (one it does not record is not checked)."""
        counts = {S.TEXT: n_layers, **(towers or {})}
        for tower, n in counts.items():
            kept = self.layers_of(tower)
            if kept is not None and kept[-1] >= n:
                bad = ranges_text([x for x in kept if x >= n])
                what = "the model has" if tower == S.TEXT else f"the {tower} tower has"
                prefix = "" if tower == S.TEXT else f"{tower}:"
                raise TraceToolError(f"--layers {prefix}{bad}: {what} {n} layers (0-{n - 1})")
        if self.steps is not None and self.steps[0] >= max_steps:
            raise TraceToolError(
                f"--steps {ranges_text(self.steps)}: the run has {max_steps} steps (0-{max_steps - 1}); "
                "step 0 is the prefill, step s the s-th decode step"
            )

    def keeps(self, kind: str, layer: int | None = None) -> bool:
        """Is (kind key, layer) written at all (at the steps kept)? `layers` names the text tower's
        layers: an encoder tower's layers are all kept."""
        if kind in ALWAYS_KEPT:
            return True
        if self.kinds is not None and kind not in self.kinds:
            return False
        kept = self.layers_of(S.KIND_BY_NAME[kind].tower)
        return layer is None or kept is None or layer in kept

    def keeps_step(self, kind: str, step: int) -> bool:
        """Is (kind key) kept at this step? An encoder tower's rows belong to the prefill (step 0)."""
        return kind in ALWAYS_KEPT or self.steps is None or step in self.steps

    def within(self, towers) -> Selection:
        """This selection with only the kinds of the towers a trace records (the text tower's and
        `towers`'): a trace of the text tower alone keeps a version-1 selection."""
        if self.kinds is None:
            return self
        kept = tuple(k for k in self.kinds if not S.KIND_BY_NAME[k].encoder or S.KIND_BY_NAME[k].tower in towers)
        return Selection(self.layers, kept, self.steps, self.tower_layers)

    def to_json(self) -> dict:
        return {
            "layers": self.layers_text(),
            "kinds": None if self.kinds is None else list(self.kinds),
            "steps": None if self.steps is None else ranges_text(self.steps),
        }

    @classmethod
    def from_json(cls, text: str) -> Selection:
        """A trace's `selection` attribute; ValueError when malformed (the reader says which file)."""
        d = json.loads(text)
        if not isinstance(d, dict) or set(d) - {"layers", "kinds", "steps"}:
            raise ValueError("expected an object with layers, kinds, steps")
        kinds = d.get("kinds")
        if kinds is not None and (not isinstance(kinds, list) or any(k not in S.KIND_BY_NAME for k in kinds)):
            raise ValueError("kinds must be a list of kind names")
        try:
            layers, towers = parse_layers(d["layers"]) if d.get("layers") is not None else (None, ())
            steps = parse_ranges(d["steps"], "steps") if d.get("steps") is not None else None
        except (TraceToolError, TypeError, AttributeError) as e:
            raise ValueError(str(e)) from None
        return cls(layers, tuple(kinds) if kinds is not None else None, steps, towers)

    def describe(self) -> str:
        """'layers 0-3,17; kinds q,k,v,layer_out (+ logits, token); steps 0-4'."""
        parts = []
        if self.layers_text() is not None:
            parts.append(f"layers {self.layers_text()}")
        if self.kinds is not None:
            parts.append("kinds " + ",".join(k for k in self.kinds if k not in ALWAYS_KEPT) + " (+ logits, token)")
        if self.steps is not None:
            parts.append(f"steps {ranges_text(self.steps)}")
        return "; ".join(parts)
