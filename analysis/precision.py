"""`trace precision`: keep the most sensitive units at a fallback precision until a target holds.

Units are added to the fallback precision greedily in the order of the first ranking
(analysis/sensitivity.py isolated_ranking), one full replay each, until the target holds; then
each unit but the last is tried without (one replay each); the written recipe is verified with
one more full replay.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from gemma4_trace.replayer.runtimes.registry import parse_runtime
from gemma4_trace.traces.errors import TraceToolError

from .recipe import Recipe, write_quantize_options, write_recipe
from .runner import METRICS, Runner, make_runner
from .sensitivity import isolated_ranking, metrics_text

# ----------------------------------------------------------------------------- target expressions
_TOKEN = re.compile(
    r"\s*(?:(?P<num>[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?)"
    r"|(?P<op><=|>=|<|>)|(?P<word>[A-Za-z_][A-Za-z_0-9]*))"
)
_OPS = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b, ">": lambda a, b: a > b}
MAX_EXPR = 500


@dataclass(frozen=True)
class Target:
    clauses: tuple  # ((metric, op, number), ...), all must hold

    @staticmethod
    def parse(text: str) -> Target:
        """`METRIC OP NUMBER [and METRIC OP NUMBER ...]`, METRIC in METRICS, OP one of <= < >= >."""
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_EXPR:
            raise TraceToolError(
                f"--target: expected e.g. 'kl_mean<=0.01 and top1>=0.98' (at most {MAX_EXPR} characters)"
            )
        tokens, pos = [], 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise TraceToolError(f"--target: unexpected {text[pos : pos + 10]!r} at character {pos}")
            tokens.append((m.lastgroup, m.group(m.lastgroup)))
            pos = m.end()
            while pos < len(text) and text[pos].isspace():
                pos += 1
        clauses, i = [], 0
        while True:
            # the word baseline: `trace diff --baseline BASE` of the candidate passes
            if i < len(tokens) and tokens[i] == ("word", "baseline"):
                clauses.append(("baseline", None, None))
                i += 1
                if i == len(tokens):
                    return Target(tuple(clauses))
                if tokens[i] != ("word", "and"):
                    raise TraceToolError("--target: clauses are joined by 'and'")
                i += 1
                continue
            if i + 3 > len(tokens):
                raise TraceToolError("--target: a clause is METRIC OP NUMBER, e.g. kl_mean<=0.01")
            (tm, metric), (to, op), (tn, num) = tokens[i : i + 3]
            if tm != "word" or metric not in METRICS:
                raise TraceToolError(
                    f"--target: unknown metric {metric!r}; known: {', '.join(METRICS)} (and the word baseline)"
                )
            if to != "op" or tn != "num":
                raise TraceToolError(f"--target: expected '{metric} OP NUMBER' with OP one of <= < >= >")
            value = float(num)
            if not math.isfinite(value):
                raise TraceToolError(f"--target: {num!r} is not a finite number")
            clauses.append((metric, op, value))
            i += 3
            if i == len(tokens):
                return Target(tuple(clauses))
            if tokens[i] != ("word", "and"):
                raise TraceToolError("--target: clauses are joined by 'and'")
            i += 1

    @property
    def uses_baseline(self) -> bool:
        return any(m == "baseline" for m, _, _ in self.clauses)

    def holds(self, metrics: dict) -> bool:
        return all(metrics[m] is True if m == "baseline" else _OPS[op](metrics[m], v) for m, op, v in self.clauses)

    def __str__(self) -> str:
        return " and ".join(m if m == "baseline" else f"{m}{op}{v:g}" for m, op, v in self.clauses)


# ----------------------------------------------------------------------------- precision search
@dataclass
class PrecisionResult:
    recipe: Recipe
    kept: list
    before: dict
    after: dict
    verified: dict
    bytes_all: int
    bytes_recipe: int
    started_from_recipe: bool = False
    note: str = ""
    bytes_label: str = "quantizable weight bytes"
    all_fallback: bool = False  # every unit ends at the fallback: the runtime's own precision is used nowhere


def baseline_judge(reference, baseline):
    """For `--target baseline`: BASE checked against REF now (one line, exit 2, as `trace diff
    --baseline` checks it), then a judge: does `trace diff --baseline BASE` of a replay's trace pass?"""
    if baseline is None:
        return None
    from gemma4_trace.diff import compare
    from gemma4_trace.diff.baseline import check_baseline
    from gemma4_trace.traces.reader import TraceReader

    with TraceReader(reference) as ref, TraceReader(baseline) as base:
        check_baseline(ref, ref, base)  # REF stands in for the replays: same prompt, steps and mode
    # the verdict alone: compare, not diff_traces (whose sentence, hint and BASE-against-REF
    # judgement would be recomputed for every candidate of the search)
    return lambda run: compare(reference, run, None, baseline).match


def check_target_baseline(target: Target, baseline) -> None:
    """`baseline`: BASE's path, or the judge made of it (anything but None when given)."""
    if target.uses_baseline and baseline is None:
        raise TraceToolError("--target baseline needs --baseline BASE.h5 (the trace a replay is judged against)")
    if baseline is not None and not target.uses_baseline:
        raise TraceToolError("--baseline is used only by a target with the word baseline, e.g. --target baseline")


def precision_search(
    runner: Runner, target: Target, fallback: str = "float", granularity: str = "layer", base: Recipe | None = None
) -> PrecisionResult:
    if fallback not in runner.precisions:
        raise TraceToolError(
            f"--fallback for {runner.runtime} must be one of {', '.join(runner.precisions)}, got {fallback!r}"
        )
    check_target_baseline(target, runner.baseline)
    if fallback == getattr(runner, "gguf_type", None):
        raise TraceToolError(f"--fallback {fallback} is the runtime's own type")
    before = runner.measure(runner.config())
    kept, cfg, after = [], runner.config(), before
    if not target.holds(before):
        order = [u for u, err in isolated_ranking(runner, granularity) if err is not None]
        for unit in order:
            members = [m for m in runner.members(unit) if runner.modules[m] != fallback]
            if not members:
                continue
            kept.append(unit)
            cfg = runner.config({**{m: fallback for u in kept for m in runner.members(u)}})
            after = runner.measure(cfg)
            if target.holds(after):
                break
        else:
            raise TraceToolError(
                f"the target ({target}) is not reached even with every unit at {fallback} "
                f"(then: {metrics_text(after)}); nothing was written"
            )
        # prune: a unit added early may be unneeded once later ones are back; try each but the last
        for unit in list(kept[:-1]):
            trial = [u for u in kept if u != unit]
            metrics = runner.measure(runner.config({m: fallback for u in trial for m in runner.members(u)}))
            if target.holds(metrics):
                kept, after = trial, metrics
    units = dict(base.units) if base else {}
    for u in kept:
        units = {k: v for k, v in units.items() if not (k == u or k.startswith(u + "."))}
        units[u] = fallback
    recipe = Recipe(runner.runtime, units).check()
    # verification: the recipe as written, resolved like `trace replay --recipe` does
    verified = runner.measure(_resolve(runner, recipe))
    if not target.holds(verified):
        raise TraceToolError(
            f"the recipe's verification replay misses the target ({metrics_text(verified)}); nothing was written"
        )
    return PrecisionResult(
        recipe,
        kept,
        before,
        after,
        verified,
        runner.weight_bytes(runner.config()),
        runner.weight_bytes(_resolve(runner, recipe)),
        base is not None,
        runner.note,
        runner.bytes_label,
        all(v == fallback for v in _resolve(runner, recipe).values()),
    )


def _resolve(runner: Runner, recipe: Recipe) -> dict:
    default = runner.default_precision()
    return {m: recipe.units.get(m, recipe.units.get(runner.layer_of[m], default)) for m in runner.modules}


def format_precision(p: PrecisionResult, output, target: Target, fallback: str, replays: dict, seconds: float) -> str:
    kept = ", ".join(p.kept) if p.kept else "none"
    return "\n".join(
        [
            f"target {target}: reached with {len(p.kept)} unit(s) at {fallback}: {kept}",
            *([_all_fallback_warning(p, fallback)] if p.all_fallback else []),
            *([p.note] if p.note else []),
            f"before (every unit as started: {p.recipe.runtime}{', --recipe' if p.started_from_recipe else ''}): "
            f"{metrics_text(p.before)}",
            f"after (verified by a full replay of the recipe): {metrics_text(p.verified)}",
            f"{p.bytes_label}: {p.bytes_recipe} vs {p.bytes_all} before (x{p.bytes_recipe / p.bytes_all:.2f})",
            f"{sum(replays.values())} replays ({replays.get('isolated', 0)} isolated, {replays.get('full', 0)} full) "
            f"in {seconds:.1f} s",
            f"wrote {output}: trace replay REF --runtime {p.recipe.runtime} --recipe {output}",
        ]
    )


def _all_fallback_warning(p: PrecisionResult, fallback: str) -> str:
    what = "quantizes nothing" if fallback == "float" else f"is {fallback} throughout"
    return (
        f"warning: every unit is at {fallback}: the recipe {what} and {p.recipe.runtime} is used nowhere "
        f"(x{p.bytes_recipe / p.bytes_all:.2f} bytes); a looser target, or --unit module, keeps some of it"
    )


def output_paths(runtime: str, output) -> list[Path]:
    """What `trace precision` writes: the recipe, and for llama.cpp the recipe as llama-quantize
    options beside it (checked before any work)."""
    out = Path(output)
    return [out, out.with_suffix(".llama-quantize.txt")] if parse_runtime(runtime).gguf else [out]


@dataclass(frozen=True)
class Plan:
    """A `trace precision` run, its options checked before anything loads."""

    reference: str
    runtime: str
    target: Target
    baseline: str | None
    fallback: str
    output: str
    force: bool

    @staticmethod
    def check(reference, runtime: str, target: str, baseline, fallback: str, output, force: bool) -> Plan:
        goal = Target.parse(target)
        check_target_baseline(goal, baseline)
        if fallback == runtime:
            raise TraceToolError(f"--fallback {fallback} is the runtime itself")
        return Plan(str(reference), runtime, goal, baseline, fallback, str(output), force)

    def command(self) -> str:
        """The command line, for the recipe's comment (file names made safe for one line)."""
        from gemma4_trace.traces.errors import one_line

        base = f" --baseline {one_line(Path(self.baseline).name, 200)}" if self.baseline else ""
        return f"trace precision --runtime {self.runtime} --target '{self.target}' --fallback {self.fallback}{base}"


def run(plan: Plan, granularity: str, start: Recipe | None, model_dir=None) -> str:
    """Search, write the recipe (and llama.cpp's options), and return what to print."""
    runner = make_runner(
        plan.reference, plan.runtime, model_dir, start, baseline=baseline_judge(plan.reference, plan.baseline)
    )
    try:
        result = precision_search(runner, plan.target, plan.fallback, granularity, start)
        write_recipe(result.recipe, plan.output, plan.force, comments=[plan.command()])
        text = format_precision(result, plan.output, plan.target, plan.fallback, runner.replays, runner.seconds)
        if parse_runtime(plan.runtime).gguf:
            options = write_quantize_options(runner, result.recipe, plan.output, plan.force)
            text += f"\nwrote {options}: the recipe as llama-quantize --tensor-type options"
    finally:
        runner.close()
    return text
