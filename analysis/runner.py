"""In-process replays for `trace sensitivity` and `trace precision`: REF read once, the model
loaded once, each configuration (a module-level recipe {module unit: precision}) built and
replayed teacher-forced through the replay core (replayer/core.py), measured in memory by

- kl_mean / kl_p99: KL(REF || RUN) of the next-token distributions, mean and 99th
  percentile over the steps (nats);
- top1: the fraction of steps where RUN's argmax is REF's token;
- layer_out: the worst per-row rel-L2 of layer_out over all layers and rows, as `trace diff`
  computes it with its default tolerances (diff/metrics.py; the l2_floor of REF's precision).

`Runner` replays the quantized static runtimes (replayer/quant.py, which can isolate layers);
`LlamaCppRunner` llama.cpp:TYPE on mixed-precision GGUF files (which cannot).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from gemma4_trace.diff.metrics import kl_rows, log_softmax, rel_l2_rows
from gemma4_trace.diff.tolerances import DEFAULTS, precision_class
from gemma4_trace.replayer.core import CheckedRuntime, Reference, default_max_seq, read_reference, run_steps
from gemma4_trace.replayer.runtimes.registry import parse_runtime
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.reader import TraceReader

from .recipe import SCHEME_NAMES, Recipe

METRICS = ("kl_mean", "kl_p99", "top1", "layer_out")


@dataclass
class RefData:
    """What the replays compare against: REF's inputs, its log-probabilities and layer inputs."""

    reference: Reference
    steps: list  # (first, stop) positions per step
    logprobs: np.ndarray  # (steps, vocab) float64
    inputs: dict  # (kind, layer) -> all rows: embeddings, per_layer_inputs, layer_out
    floor: float  # rel-L2's denominator floor, as trace diff's defaults for REF's precision

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self.reference.tokens, dtype=np.int64)


def read_ref(path) -> RefData:
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
        steps = [tuple(int(v) for v in s) for s in r.step_positions]
        floor = DEFAULTS[precision_class(r.source_dtype("layer_out", 0))]["l2_floor"]
    return RefData(read_reference(path), steps, log_softmax(logits), inputs, floor)


class _Probe:
    """Keeps each step's layer_out (and per_layer_inputs) rows; isolating: hands back REF's layer inputs."""

    def __init__(self, ref: RefData, isolate: bool):
        self.ref, self.isolate, self.steps, self.step = ref, isolate, [], -1

    def next_step(self) -> None:
        self.step += 1
        self.rows = slice(*self.ref.steps[self.step])
        self.steps.append({})

    def tensor(self, kind, value, layer=None, positions=None, tower="text"):
        if tower != "text":  # an encoder tower's rows: no layer input of the text decoder
            return None
        if kind in ("layer_out", "per_layer_inputs"):
            self.steps[-1][(kind, layer)] = value.detach().float().cpu().numpy().copy()
        if self.isolate and kind in S.LAYER_INPUT_KINDS:
            import torch

            return torch.from_numpy(self.ref.inputs[(kind, layer)][self.rows]).to(value.dtype)
        return None

    def rows_of(self, kind: str, layer) -> np.ndarray:
        return np.concatenate([s[(kind, layer)] for s in self.steps])


class _Logits:
    """A replay's sink (run_steps): keeps each step's logits, writes nothing."""

    def __init__(self):
        self.rows: list[np.ndarray] = []

    def begin_step(self, positions) -> None:
        pass

    def add(self, kind: str, value, source_dtype=None) -> None:
        if kind == "logits":
            self.rows.append(np.asarray(value, dtype=np.float64))

    def end_step(self) -> None:
        pass


@dataclass
class ReplayResult:
    metrics: dict  # METRICS
    layer_errors: list  # worst layer_out rel-L2 per layer
    ple_error: float | None  # worst per_layer_inputs rel-L2


class Runner:
    """REF read once, the model loaded once; each call builds the runtime with a recipe and replays."""

    can_isolate = True
    first_ranking = "isolated"  # what ranks the units before any full replay
    bytes_label = "quantizable weight bytes"
    note = ""
    precisions = ("float", *SCHEME_NAMES)

    def __init__(self, ref_path, runtime: str, model_dir=None, base: Recipe | None = None, baseline=None):
        from gemma4_trace.hf.model import load_for_reference
        from gemma4_trace.replayer.quant import check_recipe, resolve_precision, weight_units
        from gemma4_trace.replayer.runtime import StaticGemma4Runtime

        if runtime not in SCHEME_NAMES:
            raise TraceToolError(
                f"--runtime must be a quantized static runtime ({', '.join(SCHEME_NAMES)}), got {runtime!r}"
            )
        self._start(ref_path, runtime, base, baseline)
        self.loaded = load_for_reference(self.ref.reference.provenance, model_dir, device="cpu")
        self._make = lambda: StaticGemma4Runtime(self.loaded, self.max_seq)
        probe_rt = self._make()
        if base is not None:
            check_recipe(probe_rt, base.units)
        # the quantized configuration, resolved per module unit: {module unit: precision}
        self.modules, self.layer_of = {}, {}
        for layer_unit, module_unit, _, _ in weight_units(probe_rt):
            self.modules[module_unit] = resolve_precision(
                base.units if base else None, runtime, layer_unit, module_unit
            )
            self.layer_of[module_unit] = layer_unit
        self.n_layers = probe_rt.n_layers
        self._cache = {}  # quantized weights, shared by the replays (the HF weights stay alive in self.loaded)

    def _start(self, ref_path, runtime: str, base: Recipe | None, baseline) -> None:
        if base is not None and base.runtime != runtime:
            raise TraceToolError(f"the recipe is for --runtime {base.runtime}, not {runtime}")
        self.ref_path, self.baseline, self.runtime = ref_path, baseline, runtime
        self.ref = read_ref(ref_path)
        self.max_seq = default_max_seq(len(self.ref.reference.prompt_ids), len(self.ref.reference.tokens))
        self.replays = {"full": 0, "isolated": 0}
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

    def precision_of(self, unit: str) -> str:
        """What a unit is quantized to ("a+b" when its modules differ)."""
        ps = sorted({self.modules[m] for m in self.members(unit)})
        return ps[0] if len(ps) == 1 else "+".join(ps)

    def default_precision(self) -> str:
        """The precision a recipe's unnamed units get."""
        return self.runtime

    def weight_bytes(self, cfg: dict) -> int:
        from .recipe import weight_bytes

        return weight_bytes(self._make(), self.runtime, cfg)

    def runtime_for(self, cfg: dict):
        from gemma4_trace.replayer.quant import quantize_

        return quantize_(self._make(), self.runtime, cfg, cache=self._cache)

    def replay(self, cfg: dict, isolate: bool = False) -> ReplayResult:
        t0 = time.perf_counter()
        probe, sink = _Probe(self.ref, isolate), _Logits()
        with self.runtime_for(cfg) as rt:
            run_steps(
                CheckedRuntime(rt, self.loaded.text_config.vocab_size),
                self.ref.reference,
                "teacher-forced",
                sink,
                probe,
            )
        self.replays["isolated" if isolate else "full"] += 1
        self.seconds += time.perf_counter() - t0
        return self._measure(np.stack(sink.rows), probe)

    def _measure(self, logits: np.ndarray, probe: _Probe) -> ReplayResult:
        ref = self.ref
        run_lp = log_softmax(logits)
        kl = kl_rows(ref.logprobs, run_lp)
        layer_errors = [
            float(np.max(rel_l2_rows(ref.inputs[("layer_out", i)], probe.rows_of("layer_out", i), ref.floor)))
            for i in range(self.n_layers)
        ]
        ple = None
        if ("per_layer_inputs", None) in ref.inputs:
            want = ref.inputs[("per_layer_inputs", None)]
            ple = float(np.max(rel_l2_rows(want, probe.rows_of("per_layer_inputs", None), ref.floor)))
        metrics = {
            "kl_mean": float(np.mean(kl)),
            "kl_p99": float(np.percentile(kl, 99)),
            "top1": float(np.mean(np.argmax(run_lp, axis=-1) == ref.tokens)),
            "layer_out": float(max(layer_errors)),
        }
        return ReplayResult(metrics, layer_errors, ple)

    def measure(self, cfg: dict) -> dict:
        """A full replay's METRICS, plus "baseline" (`self.baseline(trace)`: True when `trace diff
        --baseline BASE` of the replay's trace passes) when the runner has one."""
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
        from gemma4_trace.replayer.core import replay_loaded

        t0 = time.perf_counter()
        ref = self.ref.reference
        replay_loaded(
            self.loaded,
            ref,
            self.runtime_for(cfg),
            path,
            reference_path=self.ref_path,
            selection=ref.selection,
            max_seq=self.max_seq,
        )
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Release what the runner holds beyond memory."""


class LlamaCppRunner(Runner):
    """`--runtime llama.cpp:TYPE`: each configuration a GGUF file (mixed precision,
    runtimes/llamacpp/gguf_mixed.py) run by llama.cpp. llama.cpp cannot isolate layers: the first
    ranking is each unit's weight error (its dequantized weights against float: no replay), every
    replay a full one."""

    can_isolate = False
    first_ranking = "weight"
    bytes_label = "GGUF tensor bytes (the whole file llama.cpp loads)"

    def __init__(self, ref_path, runtime: str, model_dir=None, base: Recipe | None = None, baseline=None):
        from gemma4_trace.hf.model import load_for_reference
        from gemma4_trace.replayer.runtimes.llamacpp.gguf_mixed import MixedFiles, resolve

        choice = parse_runtime(runtime)
        if not choice.gguf or choice.type == choice.spec.types[0]:
            raise TraceToolError(f"--runtime {runtime}: expected llama.cpp:TYPE with a quantized TYPE")
        self.gguf_type = choice.type
        self._start(ref_path, runtime, base, baseline)
        if self.ref.reference.dtype != "float32":
            raise TraceToolError(
                f"--runtime llama.cpp converts float32 checkpoints; REF was recorded in {self.ref.reference.dtype}"
            )
        self.loaded = load_for_reference(self.ref.reference.provenance, model_dir, device="cpu")
        self.mixed = MixedFiles(self.loaded, self.gguf_type)
        self.modules = resolve(self.mixed, base.units if base else {}, self.gguf_type)
        self.layer_of = {mu: lu for mu, (lu, _) in self.mixed.units.items()}
        self.n_layers = len(self.loaded.text_config.layer_types)
        self.precisions = ("float", *choice.spec.types[1:])
        self._held: dict | None = None  # module unit -> the ggml types its tensors have (precision_of)
        self.note = (
            f"llama.cpp cannot isolate layers: only full replays; units ranked first by their weight error "
            f"({self.gguf_type} dequantized vs float, no replay)"
        )

    def default_precision(self) -> str:
        return self.gguf_type

    def runtime_for(self, cfg: dict):
        from gemma4_trace.replayer.runtimes.llamacpp.runtime import LlamaCppRuntime

        return LlamaCppRuntime(self.loaded, self.max_seq, gguf_type=self.gguf_type, user_file=self.mixed.path(cfg))

    def replay(self, cfg: dict, isolate: bool = False) -> ReplayResult:
        if isolate:
            raise TraceToolError("llama.cpp cannot isolate layers")
        return super().replay(cfg)

    def weight_bytes(self, cfg: dict) -> int:
        return self.mixed.tensor_bytes(cfg)

    def precision_of(self, unit: str) -> str:
        """The ggml types the unit's tensors have in the file llama.cpp runs for the configuration
        as started (llama.cpp keeps some tensors at F32 or F16 whatever the type asked for, and
        falls back where rows do not fill a type's blocks): "Q8_0", or "F16+Q8_0" when they differ."""
        from gemma4_trace.replayer.runtimes.llamacpp.gguf_reader import read_header

        if self._held is None:
            tensors = read_header(self.mixed.path(self.config())).tensors
            self._held = {
                m: {tensors[n].type_name for n in names if n in tensors} for m, (_, names) in self.mixed.units.items()
            }
        ps = sorted({t for m in self.members(unit) for t in self._held.get(m, ())})
        return "+".join(ps) if ps else super().precision_of(unit)

    def weight_ranking(self, granularity: str) -> list:
        errors = self.mixed.weight_errors(self.config())
        ranked = []
        for unit in self.units(granularity):
            errs = [errors[m] for m in self.members(unit) if errors[m] is not None]
            ranked.append((unit, max(errs) if errs else None))
        ranked.sort(key=lambda ue: -1.0 if ue[1] is None else ue[1], reverse=True)
        return ranked

    def close(self) -> None:
        self.mixed.close()


def make_runner(ref_path, runtime: str, model_dir=None, base: Recipe | None = None, baseline=None) -> Runner:
    """The runner of a quantized static runtime, or of llama.cpp:TYPE."""
    choice = parse_runtime(runtime)
    cls = LlamaCppRunner if choice.gguf else Runner
    return cls(ref_path, runtime, model_dir, base, baseline=baseline)
