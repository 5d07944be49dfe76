"""Tolerances: built-in defaults by source dtype, and TOML rules matched by kind, layer, step.

A rule sets only the fields it names; later matching rules override earlier ones field
by field. See docs/tolerances.md for the file format.
"""

from __future__ import annotations

import fnmatch
import math
import re
import reprlib
import stat
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
# A tolerances file is untrusted input: bounded before it is read, and its matching cost bounded
# (every tensor is matched against every rule: tensors x rules, patterns compiled once).
MAX_FILE_BYTES = 4 << 20  # a calibrated file for a 60-layer model: ~0.3 MiB, ~2,000 rules, ~6,000 alternatives
MAX_RULES = 8_192
MAX_ALTERNATIVES = 16_384  # comma-separated pattern alternatives in the whole file
# dotted-key parts on one line: Python's TOML parser spends time and memory quadratic in a key's depth
# (30,000 parts: 3.5 GB); the format's own keys are 2 deep
MAX_KEY_DOTS = 64

_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 3, 60, 60, 6, 6


def _show(v) -> str:
    """A value from the file for an error line: bounded in length and nesting."""
    return _short.repr(v)


def precision_class(*dtypes: str) -> str:
    """The loosest precision class among source dtype names ('torch.bfloat16' works too)."""
    names = " ".join(str(d).lower() for d in dtypes)
    if "bfloat16" in names or "bf16" in names:
        return "bfloat16"
    if "float16" in names or "half" in names or "fp16" in names:
        return "float16"
    return "float32"


# ------------------------------------------------------------------ patterns
_RANGE = re.compile(r"^(\d{1,18})?-(\d{1,18})?$")  # longer numbers are no layer or step


class _Pattern:
    """Comma-separated alternatives: '*', 'N', 'A-B', 'A-', '-B', or an fnmatch glob.

    The globs are compiled once into one regular expression, so a match costs one regex
    search plus one comparison per range, whatever the number of alternatives."""

    def __init__(self, raw, what: str, where: str, numeric: bool, budget: list[int]):
        if isinstance(raw, bool) or not isinstance(raw, (str, int, list)):
            raise TraceToolError(f"{where}: {what} must be a string, an integer or a list, got {_show(raw)}")
        items = raw if isinstance(raw, list) else [raw]
        self.ranges: list[tuple[int, int | None]] = []
        globs: list[str] = []
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise TraceToolError(f"{where}: {what} entry {_show(item)} must be a string or an integer")
            alts = str(item).split(",")
            budget[0] -= len(alts)
            if budget[0] < 0:
                raise TraceToolError(
                    f"{where}: more than {MAX_ALTERNATIVES} pattern alternatives in the file; "
                    "merge them into ranges or globs"
                )
            for alt in alts:
                alt = alt.strip()
                if not alt:
                    raise TraceToolError(f"{where}: empty {what} pattern in {_show(raw)}")
                if numeric and alt in ("prefill", "decode") and what == "step":
                    self.ranges.append((0, 0) if alt == "prefill" else (1, None))
                    continue
                m = _RANGE.match(alt) if numeric else None
                if m and (m.group(1) or m.group(2)):
                    lo = int(m.group(1)) if m.group(1) else 0
                    hi = int(m.group(2)) if m.group(2) else None
                    if hi is not None and hi < lo:
                        raise TraceToolError(f"{where}: {what} range {_show(alt)} is empty ({lo} > {hi})")
                    self.ranges.append((lo, hi))
                elif numeric and not re.fullmatch(r"[0-9*?\[\]!]+", alt):
                    raise TraceToolError(
                        f"{where}: {what} pattern {_show(alt)} is not a number, a range like '10-15' or a glob"
                        + (" (or 'prefill'/'decode')" if what == "step" else "")
                    )
                else:
                    globs.append(alt)
        self.any = "*" in globs
        self._seen: dict = {}  # value -> match: a file's patterns meet few distinct kinds and layers
        self.glob = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in dict.fromkeys(globs))) if globs else None

    def match(self, value) -> bool:
        if self.any:
            return True
        if value is None:
            return False
        hit = self._seen.get(value)
        if hit is None:
            hit = self._seen[value] = self._match(value)
        return hit

    def _match(self, value) -> bool:
        if isinstance(value, int) and any(value >= lo and (hi is None or value <= hi) for lo, hi in self.ranges):
            return True
        return self.glob is not None and self.glob.match(str(value)) is not None

    def mask(self, n: int) -> np.ndarray:
        """(n,) bool: which of 0..n-1 match."""
        if self.any:
            return np.ones(n, dtype=bool)
        m = np.zeros(n, dtype=bool)
        for lo, hi in self.ranges:
            m[lo : n if hi is None else hi + 1] = True
        if self.glob is not None:
            m |= np.fromiter((self.glob.match(str(i)) is not None for i in range(n)), dtype=bool, count=n)
        return m


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
            m = np.ones(n_steps, dtype=bool) if self.step is None else self.step.mask(n_steps)
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
        return {f: float(v[step]) for f, v in self.limits.items()} | {
            "l2_floor": float(self.l2_floor[step]),
            "skip": bool(self.skip[step]),
        }


class Tolerances:
    def __init__(
        self,
        rules: list[Rule] | None = None,
        source: str = "built-in defaults",
        near_tie_margin: float = NEAR_TIE_MARGIN,
        accept_near_ties: bool = False,
    ):
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
        return {
            "source": self.source,
            "rules": len(self.rules),
            "near_tie_margin": self.near_tie_margin,
            "accept_near_ties": self.accept_near_ties,
            "defaults": {k: v["rel_l2"] for k, v in DEFAULTS.items()},
        }

    to_json = describe  # as DiffResult.to_json reports it


def _threshold(v, name: str, where: str) -> float:
    m = METRIC.get(name)  # None for l2_floor
    if v is False:  # disable the check
        return m.off if m else 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceToolError(f"{where}: {name} must be a number (or false to disable), got {_show(v)}")
    v = float(v)
    if not math.isfinite(v):  # inf would silently turn the check off, nan would never compare
        raise TraceToolError(f"{where}: {name} is {v}, not a finite number (write false to disable the check)")
    lo, hi = (m.lo, m.hi) if m else (0.0, math.inf)
    if math.isfinite(hi) and not lo <= v <= hi:
        raise TraceToolError(f"{where}: {name} is {m.what} in [{lo:g}, {hi:g}], got {v}")
    if v < lo:
        raise TraceToolError(f"{where}: {name} must be >= {lo:g}, got {v}")
    return v


def _rule(r: dict, i: int, where: str, budget: list[int]) -> Rule:
    """One [[rule]] table, checked; `budget`: pattern alternatives the file may still use."""
    bad = sorted(set(r) - set(RULE_FIELDS))
    if bad:
        raise TraceToolError(f"{where}: unknown key(s) {_show(bad)}; allowed: {', '.join(RULE_FIELDS)}")
    kind = _Pattern(r["kind"], "kind", where, False, budget) if "kind" in r else None
    if kind is not None and not kind.any and not any(kind.match(k) for k in S.ALL_KIND_KEYS):
        raise TraceToolError(
            f"{where}: kind {_show(r['kind'])} matches no kind; kinds are {', '.join(S.KIND_NAMES)} "
            f"(an encoder tower's: {', '.join(S.ENCODER_TOWERS)} + '.' + its kind, e.g. vision.layer_out)"
        )
    layer = _Pattern(r["layer"], "layer", where, True, budget) if "layer" in r else None
    step = _Pattern(r["step"], "step", where, True, budget) if "step" in r else None
    values = {f: _threshold(r[f], f, where) for f in THRESHOLD_FIELDS if f in r}
    if "skip" in r:
        if not isinstance(r["skip"], bool):
            raise TraceToolError(f"{where}: skip must be true or false, got {_show(r['skip'])}")
        values["skip"] = r["skip"]
    if "note" in r and not isinstance(r["note"], str):
        raise TraceToolError(f"{where}: note must be a string")
    if not values:
        raise TraceToolError(f"{where}: sets nothing; give {', '.join(THRESHOLD_FIELDS)} or skip")
    return Rule(i, kind, layer, step, values)


def _read_bounded(p: Path) -> str:
    """The file's text, refused before reading when it is not a regular file or is too large."""
    try:
        st = p.stat()
    except OSError:
        raise TraceToolError(
            f"tolerances file {p}: no such file, nor a shipped profile ({', '.join(profile_names())})"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceToolError(f"tolerances file {p}: not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        raise TraceToolError(f"tolerances file {p}: {st.st_size} bytes, more than the {MAX_FILE_BYTES} allowed")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # the file may grow after the stat
    except OSError as e:
        raise TraceToolError(f"tolerances file {p}: cannot read ({e.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise TraceToolError(f"tolerances file {p}: more than the {MAX_FILE_BYTES} bytes allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceToolError(f"tolerances file {p}: not valid TOML ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        key = line.lstrip()
        key = key if key.startswith("[") else key.split("=", 1)[0]  # a table header, or a line's key part
        if key.count(".") > MAX_KEY_DOTS:
            raise TraceToolError(f"tolerances file {p}, line {n}: a key nested more than {MAX_KEY_DOTS} deep")
    return text


PROFILES = Path(__file__).resolve().parent / "profiles"  # tolerance profiles shipped with the tool


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.toml"))


def resolve_tolerances(path: str | Path | None) -> Path | None:
    """A tolerances file, or the name of a shipped profile (`llamacpp-f32`) where no such file exists."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists() and str(path) in profile_names():
        return PROFILES / f"{path}.toml"
    return p


def load_tolerances(path: str | Path | None) -> Tolerances:
    """Parse a TOML tolerances file (or a shipped profile by name); TraceToolError names the file and
    what is wrong."""
    if path is None:
        return Tolerances()
    p = resolve_tolerances(path)
    try:
        data = tomllib.loads(_read_bounded(p))
    except (tomllib.TOMLDecodeError, ValueError) as e:  # ValueError: an integer of over 4300 digits
        raise TraceToolError(f"tolerances file {p}: not valid TOML ({_show(str(e))})") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise TraceToolError(f"tolerances file {p}: not valid TOML (nested too deeply)") from None
    unknown = sorted(set(data) - set(TOP_FIELDS))
    if unknown:
        raise TraceToolError(
            f"tolerances file {p}: unknown top-level key(s) {_show(unknown)}; expected [[rule]] and [tokens]"
        )
    if "version" in data and data["version"] != 1:
        raise TraceToolError(f"tolerances file {p}: version {_show(data['version'])} not supported (use 1)")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        raise TraceToolError(f"tolerances file {p}: 'rule' must be an array of tables ([[rule]])")
    if len(raw_rules) > MAX_RULES:
        raise TraceToolError(f"tolerances file {p}: {len(raw_rules)} rules, more than the {MAX_RULES} allowed")
    budget = [MAX_ALTERNATIVES]  # pattern alternatives left for the whole file
    rules = [_rule(r, i, f"tolerances file {p}, rule {i}", budget) for i, r in enumerate(raw_rules, 1)]
    tok = data.get("tokens", {})
    if not isinstance(tok, dict):
        raise TraceToolError(f"tolerances file {p}: [tokens] must be a table")
    bad = sorted(set(tok) - set(TOKEN_FIELDS))
    if bad:
        raise TraceToolError(
            f"tolerances file {p}, [tokens]: unknown key(s) {_show(bad)}; allowed: {', '.join(TOKEN_FIELDS)}"
        )
    margin = tok.get("near_tie_margin", NEAR_TIE_MARGIN)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:  # nan too
        raise TraceToolError(
            f"tolerances file {p}, [tokens]: near_tie_margin must be a number >= 0, got {_show(margin)}"
        )
    if not math.isfinite(margin):  # would accept every token flip as a near tie
        raise TraceToolError(f"tolerances file {p}, [tokens]: near_tie_margin is {margin}, not a finite number")
    accept = tok.get("accept_near_ties", False)
    if not isinstance(accept, bool):
        raise TraceToolError(f"tolerances file {p}, [tokens]: accept_near_ties must be true or false")
    shipped = p.parent == PROFILES and p.stem in profile_names()
    source = f"profile {p.stem}" if shipped else str(p)  # a shipped profile by its name, not its path in the install
    return Tolerances(rules, source=source, near_tie_margin=float(margin), accept_near_ties=accept)
