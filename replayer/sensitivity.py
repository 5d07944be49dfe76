"""`trace sensitivity` and `trace precision`: which quantized units cost the most, and which to keep.

Both replay REF's inputs in-process (teacher-forced, REF's tokens; nothing written) through
the quantized static runtime with a recipe (replayer/quant.py), and measure each replay by

- kl_mean / kl_p99: KL(REF || RUN) of the next-token distributions, mean and 99th
  percentile over the steps (nats);
- top1: the fraction of steps where RUN's argmax is REF's token;
- layer_out: the worst per-row rel-L2 of layer_out over all layers and rows.

Cheap first: one isolated replay (every layer fed REF's input, replayer/isolate.py) gives
each layer's own error and ranks the units; full replays ("only this unit quantized", "only
this unit kept in float") are run only for the top `replays` units of that ranking.
`precision` adds units to the fallback precision greedily in that order, one full replay
each, until the target holds, then tries to drop each unit but the last (one replay each),
and verifies the written recipe with one more full replay.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader

from .recipe import SCHEME_NAMES, Recipe

METRICS = ("kl_mean", "kl_p99", "top1", "layer_out")
HIGHER_IS_BETTER = {"top1"}


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


# ----------------------------------------------------------------------------- in-process replays
class _Probe:
    """Keeps layer_out (and per_layer_inputs) rows; isolating: hands back REF's layer inputs."""

    def __init__(self, ref: _Ref, rows: slice, isolate: bool):
        self.ref, self.rows, self.isolate, self.out = ref, rows, isolate, {}

    def tensor(self, kind, value, layer=None, positions=None):
        if kind in ("layer_out", "per_layer_inputs"):
            self.out[(kind, layer)] = value.detach().float().cpu().numpy().copy()
        if self.isolate and kind in S.LAYER_INPUT_KINDS:
            return torch.from_numpy(self.ref.inputs[(kind, layer)][self.rows]).to(value.dtype)
        return None


@dataclass
class _Ref:
    prompt_ids: list
    extra: dict
    tokens: np.ndarray
    steps: list
    logprobs: np.ndarray  # (steps, vocab) float64
    inputs: dict  # (kind, layer) -> all rows: embeddings, per_layer_inputs, layer_out
    provenance: dict


def read_ref(path) -> _Ref:
    with TraceReader(path) as r:
        if r.mode != "reference":
            raise TraceToolError(f"{path} is a {r.mode} trace; sensitivity needs a reference recording")
        n_layers = len(r.layers)
        missing = [k for k in ("embeddings", "logits") if not r.has(k)] + [
            f"layer_out of layer {i}" for i in range(n_layers) if not r.has("layer_out", i)
        ]
        if missing:
            raise TraceToolError(
                f"{path} stores no {missing[0]}; sensitivity needs every layer_out, the embeddings and the logits"
            )
        inputs = {("embeddings", None): r.read("embeddings")}
        if r.has("per_layer_inputs"):
            inputs[("per_layer_inputs", None)] = r.read("per_layer_inputs")
        for i in range(n_layers):
            inputs[("layer_out", i)] = r.read("layer_out", i)
        logits = r.read("logits").astype(np.float64)
        for a in [logits, *inputs.values()]:
            if not np.all(np.isfinite(a)):
                raise TraceToolError(f"{path} holds NaN/Inf in its logits or layer inputs")
        return _Ref(
            [int(x) for x in r.prompt_ids],
            r.extra_inputs(),
            np.asarray(r.tokens(), dtype=np.int64),
            [tuple(int(v) for v in s) for s in r.step_positions],
            _log_softmax(logits),
            inputs,
            dict(r.provenance),
        )


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _rel_l2_rows(run: np.ndarray, ref: np.ndarray) -> float:
    a, b = run.reshape(len(run), -1).astype(np.float64), ref.reshape(len(ref), -1).astype(np.float64)
    den = np.linalg.norm(b, axis=1)
    return float(np.max(np.linalg.norm(a - b, axis=1) / np.where(den > 0, den, 1.0)))


@dataclass
class ReplayResult:
    metrics: dict  # METRICS
    layer_errors: list  # worst layer_out rel-L2 per layer
    ple_error: float | None  # worst per_layer_inputs rel-L2


class Runner:
    """REF read once, the model loaded once; each call builds the runtime with a recipe and replays."""

    def __init__(self, ref_path, runtime: str, model_dir=None, base: Recipe | None = None, baseline=None):
        from gemma4_trace.hf.model import load_for_reference

        from .quant import SCHEMES, resolve_precision, weight_units
        from .replay import default_max_seq
        from .runtime import StaticGemma4Runtime

        if runtime not in SCHEMES:
            raise TraceToolError(
                f"--runtime must be a quantized static runtime ({', '.join(SCHEMES)}), got {runtime!r}"
            )
        if base is not None and base.runtime != runtime:
            raise TraceToolError(f"the recipe is for --runtime {base.runtime}, not {runtime}")
        self.ref_path, self.baseline = ref_path, baseline
        self.ref = read_ref(ref_path)
        self.runtime = runtime
        self.loaded = load_for_reference(self.ref.provenance, model_dir, device="cpu")
        self.max_seq = default_max_seq(len(self.ref.prompt_ids), len(self.ref.tokens))
        self._make = lambda: StaticGemma4Runtime(self.loaded, self.max_seq)
        probe_rt = self._make()
        if base is not None:
            from .quant import check_recipe

            check_recipe(probe_rt, base.units)
        # the quantized configuration, resolved per module unit: {module unit: precision}
        self.modules = {}
        self.layer_of = {}
        for layer_unit, module_unit, _, _ in weight_units(probe_rt):
            self.modules[module_unit] = resolve_precision(
                base.units if base else None, runtime, layer_unit, module_unit
            )
            self.layer_of[module_unit] = layer_unit
        self.n_layers = probe_rt.n_layers
        self.replays = {"full": 0, "isolated": 0}
        self._cache = {}  # quantized weights, shared by the replays (the HF weights stay alive in self.loaded)
        self.seconds = 0.0

    def units(self, granularity: str) -> list[str]:
        if granularity == "module":
            return list(self.modules)
        return list(dict.fromkeys(self.layer_of.values()))

    def members(self, unit: str) -> list[str]:
        return [m for m, lu in self.layer_of.items() if unit in (m, lu)]

    def config(self, overrides: dict | None = None, only: list[str] | None = None) -> dict:
        """A module-level recipe: the quantized configuration, with `only` (module units) kept
        at their precision and all others float, then `overrides` {module unit: precision}."""
        cfg = (
            dict(self.modules) if only is None else {m: (p if m in only else "float") for m, p in self.modules.items()}
        )
        cfg.update(overrides or {})
        return cfg

    def weight_bytes(self, cfg: dict) -> int:
        from .recipe import weight_bytes

        return weight_bytes(self._make(), self.runtime, cfg)

    can_isolate = True
    first_ranking = "isolated"  # what ranks the units before any full replay
    bytes_label = "quantizable weight bytes"
    note = ""
    precisions = ("float", *SCHEME_NAMES)

    def runtime_for(self, cfg: dict):
        from .quant import quantize_

        return quantize_(self._make(), self.runtime, cfg, cache=self._cache)

    def replay(self, cfg: dict, isolate: bool = False) -> ReplayResult:
        t0 = time.perf_counter()
        rt = self.runtime_for(cfg)
        try:
            return self._replay(rt, isolate, t0)
        finally:
            close = getattr(getattr(rt, "child", None), "close", None)
            if close is not None:  # llama.cpp: its child process ends with the replay
                close()

    def _replay(self, rt, isolate: bool, t0: float) -> ReplayResult:
        ref = self.ref
        ids = torch.tensor(ref.prompt_ids, dtype=torch.long)
        extra = {k: torch.as_tensor(v) for k, v in ref.extra.items()}
        logits, outs = [], []
        T = len(ref.prompt_ids)
        for step, (a, b) in enumerate(ref.steps):
            probe = _Probe(ref, slice(a, b), isolate)
            if step == 0:
                lg = rt.prefill(ids, extra, probe)
            else:
                lg = rt.decode(int(ref.tokens[step - 1]), T + step - 1, probe)
            logits.append(lg.detach().double().cpu().numpy())
            outs.append(probe.out)
        self.replays["isolated" if isolate else "full"] += 1
        self.seconds += time.perf_counter() - t0
        run_lp = _log_softmax(np.stack(logits))
        kl = np.sum(np.exp(ref.logprobs) * (ref.logprobs - run_lp), axis=-1)
        layer_errors = [
            _rel_l2_rows(np.concatenate([o[("layer_out", i)] for o in outs]), ref.inputs[("layer_out", i)])
            for i in range(self.n_layers)
        ]
        ple = None
        if ("per_layer_inputs", None) in ref.inputs:
            ple = _rel_l2_rows(
                np.concatenate([o[("per_layer_inputs", None)] for o in outs]), ref.inputs[("per_layer_inputs", None)]
            )
        top1 = float(np.mean(np.argmax(run_lp, axis=-1) == ref.tokens))
        metrics = {
            "kl_mean": float(np.mean(kl)),
            "kl_p99": float(np.percentile(kl, 99)),
            "top1": top1,
            "layer_out": float(max(layer_errors)),
        }
        return ReplayResult(metrics, layer_errors, ple)

    def measure(self, cfg: dict) -> dict:
        """A full replay's METRICS, plus "baseline" (`self.baseline(trace)`: True when `trace diff
        --baseline BASE` of the replay's trace passes; the CLI passes that judge, the diff library
        lives above this package) when the runner has one."""
        metrics = dict(self.replay(cfg).metrics)
        if self.baseline is not None:
            metrics["baseline"] = self.baseline_passes(cfg)
        return metrics

    def baseline_passes(self, cfg: dict) -> bool:
        """Write the replay of `cfg` as a trace (a temporary file, as `trace replay` writes it)
        and hand it to the baseline judge."""
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="trace-precision-") as d:
            run = Path(d) / "candidate.h5"
            self.write_trace(cfg, run)
            self.replays["full"] += 1
            return bool(self.baseline(run))

    def write_trace(self, cfg: dict, path) -> None:
        """The teacher-forced replay of `cfg` written as `trace replay --recipe` writes it."""
        from gemma4_trace.hf.model import provenance
        from gemma4_trace.traces.header import Provenance, TraceHeader
        from gemma4_trace.traces.layers import layer_infos_from_config
        from gemma4_trace.traces.writer import TraceWriter

        from .replay import _CheckedRuntime, _run_steps, read_reference

        t0 = time.perf_counter()
        ref = read_reference(self.ref_path)
        rt = self.runtime_for(cfg)
        runner = _CheckedRuntime(rt, plugin=False, vocab=self.loaded.text_config.vocab_size)
        with TraceWriter(path, source_dtype=self.loaded.dtype, selection=ref.selection) as w:
            w.write_header(
                TraceHeader(
                    Provenance.from_dict(provenance(self.loaded, runtime=rt.name, mode="teacher-forced")),
                    ref.prompt_ids,
                    layer_infos_from_config(self.loaded.text_config),
                    max_new_tokens=ref.max_new_tokens,
                    eos_token_ids=ref.eos,
                    prompt_text=ref.prompt_text,
                    chat_template_applied=ref.chat,
                    extra_inputs=ref.extra,
                )
            )
            try:
                _run_steps(runner, ref, "teacher-forced", w, None)
            finally:
                if getattr(rt, "child", None) is not None:
                    rt.child.close()
        self.seconds += time.perf_counter() - t0


class LlamaCppRunner(Runner):
    """`--runtime llama.cpp:TYPE`: each configuration a GGUF file (replayer/gguf_mixed.py) run by
    llama.cpp. llama.cpp cannot isolate layers: the first ranking is each unit's weight error
    (its dequantized weights against float: no replay), every replay a full one."""

    can_isolate = False
    first_ranking = "weight"
    bytes_label = "GGUF tensor bytes (the whole file llama.cpp loads)"

    def __init__(self, ref_path, runtime: str, model_dir=None, base: Recipe | None = None, baseline=None):
        from gemma4_trace.hf.model import load_for_reference

        from .gguf_mixed import MixedFiles, resolve
        from .gguf_writer import GGUF_TYPES
        from .llamacpp_runtime import parse_spec
        from .replay import default_max_seq

        gguf_type = parse_spec(runtime)
        if gguf_type is None or gguf_type == "F32":
            raise TraceToolError(f"--runtime {runtime}: expected llama.cpp:TYPE with a quantized TYPE")
        if base is not None and base.runtime != runtime:
            raise TraceToolError(f"the recipe is for --runtime {base.runtime}, not {runtime}")
        self.ref_path, self.baseline = ref_path, baseline
        self.ref = read_ref(ref_path)
        self.runtime, self.gguf_type = runtime, gguf_type
        self.loaded = load_for_reference(self.ref.provenance, model_dir, device="cpu")
        if self.loaded.dtype != "float32":
            raise TraceToolError(
                f"--runtime llama.cpp converts float32 checkpoints; REF was recorded in {self.loaded.dtype}"
            )
        self.max_seq = default_max_seq(len(self.ref.prompt_ids), len(self.ref.tokens))
        self.mixed = MixedFiles(self.loaded, gguf_type)
        self.modules = resolve(self.mixed, base.units if base else {}, gguf_type)
        self.layer_of = {mu: lu for mu, (lu, _) in self.mixed.units.items()}
        self.n_layers = len(self.loaded.text_config.layer_types)
        self.precisions = ("float", *(t for t in GGUF_TYPES if t != "F32"))
        self.replays = {"full": 0, "isolated": 0}
        self.seconds = 0.0
        self.note = (
            f"llama.cpp cannot isolate layers: only full replays; units ranked first by their weight error "
            f"({gguf_type} dequantized vs float, no replay)"
        )

    def runtime_for(self, cfg: dict):
        from .llamacpp_runtime import LlamaCppRuntime

        return LlamaCppRuntime(self.loaded, self.max_seq, gguf_type=self.gguf_type, user_file=self.mixed.path(cfg))

    def replay(self, cfg: dict, isolate: bool = False) -> ReplayResult:
        if isolate:
            raise TraceToolError("llama.cpp cannot isolate layers")
        return super().replay(cfg)

    def weight_bytes(self, cfg: dict) -> int:
        return self.mixed.tensor_bytes(cfg)

    def weight_ranking(self, granularity: str) -> list:
        errors = self.mixed.weight_errors(self.config())
        ranked = []
        for unit in self.units(granularity):
            errs = [errors[m] for m in self.members(unit) if errors[m] is not None]
            ranked.append((unit, max(errs) if errs else None))
        ranked.sort(key=lambda ue: -1.0 if ue[1] is None else ue[1], reverse=True)
        return ranked


def make_runner(ref_path, runtime: str, model_dir=None, base: Recipe | None = None, baseline=None) -> Runner:
    """The runner of a quantized static runtime, or of llama.cpp:TYPE."""
    cls = LlamaCppRunner if runtime.startswith("llama.cpp") else Runner
    return cls(ref_path, runtime, model_dir, base, baseline=baseline)


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


def _precision_of(runner: Runner, unit: str) -> str:
    ps = sorted({runner.modules[m] for m in runner.members(unit)})
    return ps[0] if len(ps) == 1 else "+".join(ps)


def sensitivity(runner: Runner, granularity: str = "layer", replays: int = 4) -> Sensitivity:
    if granularity not in ("layer", "module"):
        raise TraceToolError(f"--unit must be layer or module, got {granularity!r}")
    all_q = runner.replay(runner.config())
    ranked = isolated_ranking(runner, granularity)
    out = []
    for k, (unit, iso) in enumerate(ranked):
        u = UnitSensitivity(unit, _precision_of(runner, unit), iso)
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
        f"all quantized: {_metrics_text(s.all_quantized)}",
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


def _metrics_text(m: dict) -> str:
    text = (
        f"KL mean {m['kl_mean']:.2e}, KL p99 {m['kl_p99']:.2e}, top-1 {m['top1']:.3f}, layer_out {m['layer_out']:.2e}"
    )
    if "baseline" in m:
        text += f", trace diff --baseline {'passes' if m['baseline'] else 'fails'}"
    return text


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
                f"(then: {_metrics_text(after)}); nothing was written"
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
            f"the recipe's verification replay misses the target ({_metrics_text(verified)}); nothing was written"
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
    )


def _resolve(runner: Runner, recipe: Recipe) -> dict:
    default = runner.gguf_type if isinstance(runner, LlamaCppRunner) else recipe.runtime
    return {m: recipe.units.get(m, recipe.units.get(runner.layer_of[m], default)) for m in runner.modules}


def format_precision(p: PrecisionResult, output, target: Target, fallback: str, replays: dict, seconds: float) -> str:
    kept = ", ".join(p.kept) if p.kept else "none"
    return "\n".join(
        [
            f"target {target}: reached with {len(p.kept)} unit(s) at {fallback}: {kept}",
            *([p.note] if p.note else []),
            f"before (every unit as started: {p.recipe.runtime}{', --recipe' if p.started_from_recipe else ''}): "
            f"{_metrics_text(p.before)}",
            f"after (verified by a full replay of the recipe): {_metrics_text(p.verified)}",
            f"{p.bytes_label}: {p.bytes_recipe} vs {p.bytes_all} before (x{p.bytes_recipe / p.bytes_all:.2f})",
            f"{sum(replays.values())} replays ({replays.get('isolated', 0)} isolated, {replays.get('full', 0)} full) "
            f"in {seconds:.1f} s",
            f"wrote {output}: trace replay REF --runtime {p.recipe.runtime} --recipe {output}",
        ]
    )
