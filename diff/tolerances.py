"""Tolerances: built-in defaults by source dtype, and TOML rules matched by kind, layer, step.

A rule sets only the fields it names; later matching rules override earlier ones field
by field. See docs/tolerances.md for the file format.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError

from .metrics import METRIC, THRESHOLD_METRICS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Built-in defaults by precision class of the two traces (the looser one wins).
# float32: reordered sums in a float32 Gemma 4 give rel-L2 1e-7..1e-5 on the residual
# stream; 1e-4 leaves 10-100x headroom, while a real bug (one wrong mask entry, a missing
# scale, a wrong RoPE row) moves rel-L2 by 1e-2 or more.
# bfloat16: 8-bit mantissa (unit roundoff 2^-9 ~ 2e-3); a bf16 run against a float32
# reference drifts to ~1e-2 relative through the stack, so 5e-2 leaves ~5x headroom and
# still catches structural bugs (which give O(0.1..1)).
# float16: 11-bit mantissa, 8x finer than bf16.
# Every other metric's check is off by default. l2_floor: see docs/tolerances.md.
_REL_L2_AND_FLOOR = {"float32": (1e-4, 1e-6), "float16": (1e-2, 1e-4), "bfloat16": (5e-2, 1e-4)}
DEFAULTS: dict[str, dict[str, float]] = {
    prec: {m.name: m.off for m in THRESHOLD_METRICS} | {"rel_l2": rel, "l2_floor": floor}
    for prec, (rel, floor) in _REL_L2_AND_FLOOR.items()
}
NEAR_TIE_MARGIN = 0.5  # logits: REF's gap between its token and RUN's token below this is a near tie

LIMIT_FIELDS = tuple(m.name for m in THRESHOLD_METRICS)  # one per metric with a tolerance
THRESHOLD_FIELDS = LIMIT_FIELDS + ("l2_floor",)  # l2_floor: rel-L2's denominator floor
MATCH_FIELDS = ("kind", "layer", "step")
RULE_FIELDS = MATCH_FIELDS + THRESHOLD_FIELDS + ("skip", "note")
TOKEN_FIELDS = ("near_tie_margin", "accept_near_ties")
TOP_FIELDS = ("rule", "tokens", "version")


def precision_class(*dtypes: str) -> str:
    """The loosest precision class among source dtype names ('torch.bfloat16' works too)."""
    names = " ".join(str(d).lower() for d in dtypes)
    if "bfloat16" in names or "bf16" in names:
        return "bfloat16"
    if "float16" in names or "half" in names or "fp16" in names:
        return "float16"
    return "float32"


# ------------------------------------------------------------------ patterns
_RANGE = re.compile(r"^(\d+)?-(\d+)?$")


class _Pattern:
    """Comma-separated alternatives: '*', 'N', 'A-B', 'A-', '-B', or an fnmatch glob."""

    def __init__(self, raw, what: str, where: str, numeric: bool):
        if isinstance(raw, bool) or not isinstance(raw, (str, int, list)):
            raise TraceToolError(f"{where}: {what} must be a string, an integer or a list, got {raw!r}")
        items = raw if isinstance(raw, list) else [raw]
        self.alts: list[tuple[str, object]] = []
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise TraceToolError(f"{where}: {what} entry {item!r} must be a string or an integer")
            for alt in str(item).split(","):
                alt = alt.strip()
                if not alt:
                    raise TraceToolError(f"{where}: empty {what} pattern in {raw!r}")
                if numeric and alt in ("prefill", "decode") and what == "step":
                    self.alts.append(("range", (0, 0) if alt == "prefill" else (1, None)))
                    continue
                m = _RANGE.match(alt) if numeric else None
                if m and (m.group(1) or m.group(2)):
                    lo = int(m.group(1)) if m.group(1) else 0
                    hi = int(m.group(2)) if m.group(2) else None
                    if hi is not None and hi < lo:
                        raise TraceToolError(f"{where}: {what} range {alt!r} is empty ({lo} > {hi})")
                    self.alts.append(("range", (lo, hi)))
                elif numeric and not re.fullmatch(r"[0-9*?\[\]!]+", alt):
                    raise TraceToolError(
                        f"{where}: {what} pattern {alt!r} is not a number, a range like '10-15' or a glob"
                        + (" (or 'prefill'/'decode')" if what == "step" else "")
                    )
                else:
                    self.alts.append(("glob", alt))
        self.any = any(kind == "glob" and alt == "*" for kind, alt in self.alts)

    def match(self, value) -> bool:
        if self.any:
            return True
        if value is None:
            return False
        for kind, alt in self.alts:
            if kind == "range":
                lo, hi = alt
                if isinstance(value, int) and value >= lo and (hi is None or value <= hi):
                    return True
            elif fnmatch.fnmatchcase(str(value), alt):
                return True
        return False


@dataclass
class Rule:
    index: int
    kind: _Pattern | None
    layer: _Pattern | None
    step: _Pattern | None
    values: dict  # threshold fields and skip it sets
    _step_cache: dict = field(default_factory=dict)

    def matches(self, kind: str, layer: int | None) -> bool:
        if self.kind is not None and not self.kind.match(kind):
            return False
        if self.layer is not None and not self.layer.match(layer):
            return False
        return True

    def step_mask(self, n_steps: int) -> np.ndarray:
        m = self._step_cache.get(n_steps)
        if m is None:
            if self.step is None or self.step.any:
                m = np.ones(n_steps, dtype=bool)
            else:
                m = np.fromiter((self.step.match(s) for s in range(n_steps)), dtype=bool, count=n_steps)
            self._step_cache[n_steps] = m
        return m


@dataclass
class StepTolerance:
    """Thresholds for one (kind, layer), one entry per step. Disabled checks are +-inf."""

    limits: dict[str, np.ndarray]  # metric name -> threshold per step
    l2_floor: np.ndarray
    skip: np.ndarray
    precision: str

    def at(self, step: int) -> dict:
        return ({f: float(v[step]) for f, v in self.limits.items()}
                | {"l2_floor": float(self.l2_floor[step]), "skip": bool(self.skip[step])})


class Tolerances:
    def __init__(self, rules: list[Rule] | None = None, source: str = "built-in defaults",
                 near_tie_margin: float = NEAR_TIE_MARGIN, accept_near_ties: bool = False):
        self.rules = rules or []
        self.source = source
        self.near_tie_margin = near_tie_margin
        self.accept_near_ties = accept_near_ties

    def resolve(self, kind: str, layer: int | None, precision: str, n_steps: int) -> StepTolerance:
        base = DEFAULTS[precision]
        arrays = {f: np.full(n_steps, base[f], dtype=np.float64) for f in THRESHOLD_FIELDS}
        skip = np.zeros(n_steps, dtype=bool)
        for rule in self.rules:
            if not rule.matches(kind, layer):
                continue
            mask = rule.step_mask(n_steps)
            for f, v in rule.values.items():
                if f == "skip":
                    skip[mask] = v
                elif f in arrays:
                    arrays[f][mask] = v
        floor = arrays.pop("l2_floor")
        return StepTolerance(arrays, floor, skip, precision)

    def describe(self) -> dict:
        return {"source": self.source, "rules": len(self.rules), "near_tie_margin": self.near_tie_margin,
                "accept_near_ties": self.accept_near_ties,
                "defaults": {k: v["rel_l2"] for k, v in DEFAULTS.items()}}

    to_json = describe  # as DiffResult.to_json reports it


def _threshold(v, name: str, where: str) -> float:
    m = METRIC.get(name)  # None for l2_floor
    if v is False:  # disable the check
        return m.off if m else 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise TraceToolError(f"{where}: {name} must be a number (or false to disable), got {v!r}")
    v = float(v)
    lo, hi = (m.lo, m.hi) if m else (0.0, math.inf)
    if math.isfinite(hi) and not lo <= v <= hi:
        raise TraceToolError(f"{where}: {name} is {m.what} in [{lo:g}, {hi:g}], got {v}")
    if v < lo:
        raise TraceToolError(f"{where}: {name} must be >= {lo:g}, got {v}")
    return v


def load_tolerances(path: str | Path | None) -> Tolerances:
    """Parse a TOML tolerances file; TraceToolError names the file and what is wrong."""
    if path is None:
        return Tolerances()
    p = Path(path)
    if not p.is_file():
        raise TraceToolError(f"tolerances file {p}: no such file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TraceToolError(f"tolerances file {p}: not valid TOML ({e})") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise TraceToolError(f"tolerances file {p}: not valid TOML (nested too deeply)") from None
    unknown = sorted(set(data) - set(TOP_FIELDS))
    if unknown:
        raise TraceToolError(f"tolerances file {p}: unknown top-level key(s) {unknown}; expected [[rule]] and [tokens]")
    if "version" in data and data["version"] != 1:
        raise TraceToolError(f"tolerances file {p}: version {data['version']!r} not supported (use 1)")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        raise TraceToolError(f"tolerances file {p}: 'rule' must be an array of tables ([[rule]])")
    rules = []
    for i, r in enumerate(raw_rules, 1):
        where = f"tolerances file {p}, rule {i}"
        bad = sorted(set(r) - set(RULE_FIELDS))
        if bad:
            raise TraceToolError(f"{where}: unknown key(s) {bad}; allowed: {', '.join(RULE_FIELDS)}")
        kind = _Pattern(r["kind"], "kind", where, numeric=False) if "kind" in r else None
        if kind is not None and not kind.any and not any(kind.match(k) for k in S.KIND_NAMES):
            raise TraceToolError(f"{where}: kind {r['kind']!r} matches no kind; kinds are {', '.join(S.KIND_NAMES)}")
        layer = _Pattern(r["layer"], "layer", where, numeric=True) if "layer" in r else None
        step = _Pattern(r["step"], "step", where, numeric=True) if "step" in r else None
        values = {f: _threshold(r[f], f, where) for f in THRESHOLD_FIELDS if f in r}
        if "skip" in r:
            if not isinstance(r["skip"], bool):
                raise TraceToolError(f"{where}: skip must be true or false, got {r['skip']!r}")
            values["skip"] = r["skip"]
        if "note" in r and not isinstance(r["note"], str):
            raise TraceToolError(f"{where}: note must be a string")
        if not values:
            raise TraceToolError(f"{where}: sets nothing; give {', '.join(THRESHOLD_FIELDS)} or skip")
        rules.append(Rule(i, kind, layer, step, values))
    tok = data.get("tokens", {})
    if not isinstance(tok, dict):
        raise TraceToolError(f"tolerances file {p}: [tokens] must be a table")
    bad = sorted(set(tok) - set(TOKEN_FIELDS))
    if bad:
        raise TraceToolError(f"tolerances file {p}, [tokens]: unknown key(s) {bad}; allowed: {', '.join(TOKEN_FIELDS)}")
    margin = tok.get("near_tie_margin", NEAR_TIE_MARGIN)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:  # nan too
        raise TraceToolError(f"tolerances file {p}, [tokens]: near_tie_margin must be a number >= 0, got {margin!r}")
    accept = tok.get("accept_near_ties", False)
    if not isinstance(accept, bool):
        raise TraceToolError(f"tolerances file {p}, [tokens]: accept_near_ties must be true or false")
    return Tolerances(rules, source=str(p), near_tie_margin=float(margin), accept_near_ties=accept)
