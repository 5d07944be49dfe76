"""`trace sensitivity`: which quantized units cost the most.

Cheap first: one isolated replay (every layer fed REF's input, replayer/isolate.py) gives each
layer's own error and ranks the units; full replays ("only this unit quantized", "only this unit
kept in float") are run only for the top `replays` units of that ranking (analysis/runner.py
measures each). llama.cpp, which cannot isolate layers, ranks by each unit's weight error first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gemma4_trace.traces.errors import TraceToolError

from .runner import Runner


def _unit_layer(unit: str) -> int | None:
    return int(unit.split(".")[1]) if unit.startswith("layer.") else None


# ----------------------------------------------------------------------------- sensitivity
@dataclass
class UnitSensitivity:
    unit: str
    precision: str  # what the unit is quantized to
    isolated: float | None  # its layer's own layer_out error (the PLE projection: per_layer_inputs)
    only_quantized: dict | None = None  # METRICS with only this unit quantized
    only_float: dict | None = None  # METRICS with only this unit kept in float
    unit_layer_out: float | None = None  # only this unit quantized: its layer's layer_out error

    def to_json(self) -> dict:
        return {
            "unit": self.unit,
            "precision": self.precision,
            "isolated_layer_out": self.isolated,
            "only_quantized": self.only_quantized,
            "only_float": self.only_float,
            "only_quantized_unit_layer_out": self.unit_layer_out,
        }


@dataclass
class Sensitivity:
    runtime: str
    granularity: str
    all_quantized: dict
    units: list  # UnitSensitivity, ranked
    replays: dict = field(default_factory=dict)
    seconds: float = 0.0
    first_ranking: str = "isolated"  # "weight" where the runtime cannot isolate (llama.cpp)
    note: str = ""

    def to_json(self) -> dict:
        ranking = [u.to_json() for u in self.units]
        if self.first_ranking == "weight":
            for u in ranking:
                u["weight_rel_l2"] = u.pop("isolated_layer_out")
        return {
            "runtime": self.runtime,
            "unit": self.granularity,
            "all_quantized": self.all_quantized,
            **({"note": self.note} if self.note else {}),
            "ranking": ranking,
            "replays": dict(self.replays),
            "seconds": round(self.seconds, 2),
            "metrics": {
                "kl_mean": "mean over steps of KL(REF||RUN), nats",
                "kl_p99": "99th percentile of the same",
                "top1": "fraction of steps where RUN's argmax is REF's token",
                "layer_out": "worst per-row rel-L2 of layer_out over all layers",
            },
        }


def isolated_ranking(runner: Runner, granularity: str) -> list[tuple[str, float | None]]:
    """One isolated replay of the whole quantized configuration: units by their layer's own error
    (llama.cpp, which cannot isolate: by their weight error, no replay)."""
    if not runner.can_isolate:
        return runner.weight_ranking(granularity)
    iso = runner.replay(runner.config(), isolate=True)
    ranked = []
    for unit in runner.units(granularity):
        layer = _unit_layer(unit)
        quantized = any(runner.modules[m] != "float" for m in runner.members(unit))
        err = (iso.layer_errors[layer] if layer is not None else iso.ple_error) if quantized else None
        ranked.append((unit, err))
    ranked.sort(key=lambda ue: -1.0 if ue[1] is None else ue[1], reverse=True)
    return ranked


def sensitivity(runner: Runner, granularity: str = "layer", replays: int = 4) -> Sensitivity:
    if granularity not in ("layer", "module"):
        raise TraceToolError(f"--unit must be layer or module, got {granularity!r}")
    all_q = runner.replay(runner.config())
    ranked = isolated_ranking(runner, granularity)
    out = []
    for k, (unit, iso) in enumerate(ranked):
        u = UnitSensitivity(unit, runner.precision_of(unit), iso)
        if k < replays and iso is not None:
            members = runner.members(unit)
            r = runner.replay(runner.config(only=members))
            u.only_quantized = r.metrics
            layer = _unit_layer(unit)
            u.unit_layer_out = r.layer_errors[layer] if layer is not None else r.ple_error
            u.only_float = runner.replay(runner.config({m: "float" for m in members})).metrics
        out.append(u)
    measured = sorted((u for u in out if u.only_quantized), key=lambda u: u.only_quantized["kl_mean"], reverse=True)
    rest = [u for u in out if not u.only_quantized]
    return Sensitivity(
        runner.runtime,
        granularity,
        all_q.metrics,
        measured + rest,
        dict(runner.replays),
        runner.seconds,
        runner.first_ranking,
        runner.note,
    )


def _g(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def format_sensitivity(s: Sensitivity, ref_name: str) -> str:
    n = sum(s.replays.values())
    lines = [
        f"sensitivity of {s.runtime} by {s.granularity} on {ref_name}: {n} replays ({s.replays.get('isolated', 0)} "
        "isolated, "
        f"{s.replays.get('full', 0)} full) in {s.seconds:.1f} s",
        *([s.note] if s.note else []),
        f"all quantized: {metrics_text(s.all_quantized)}",
        f"rank  unit              precision     {'weight' if s.first_ranking == 'weight' else 'isolated':<9} "
        "| only this unit quantized: KL mean  KL p99    top-1  "
        "layer_out "
        "| only this unit float: KL mean  KL p99    top-1",
    ]
    for k, u in enumerate(s.units, 1):
        q, f = u.only_quantized or {}, u.only_float or {}
        lines.append(
            f"{k:<5} {u.unit:<17} {u.precision:<13} {_g(u.isolated):<9} | {'':<25}{_g(q.get('kl_mean')):<8} "
            f"{_g(q.get('kl_p99')):<9} {_top1(q.get('top1')):<6} {_g(u.unit_layer_out):<9} | {'':<21}"
            f"{_g(f.get('kl_mean')):<8} {_g(f.get('kl_p99')):<9} {_top1(f.get('top1'))}".rstrip()
        )
    first = (
        "the unit's weight rel-L2 (dequantized vs float)"
        if s.first_ranking == "weight"
        else "the isolated replay's layer_out rel-L2"
    )
    lines.append(
        f"ranked by KL mean with only the unit quantized (full replays), then by {first} (units without full "
        "replays: '-')"
    )
    return "\n".join(lines)


def _top1(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def metrics_text(m: dict) -> str:
    text = (
        f"KL mean {m['kl_mean']:.2e}, KL p99 {m['kl_p99']:.2e}, top-1 {m['top1']:.3f}, layer_out {m['layer_out']:.2e}"
    )
    if "baseline" in m:
        text += f", trace diff --baseline {'passes' if m['baseline'] else 'fails'}"
    return text
