"""Statistics over a prompt set (`trace sweep`), as llama.cpp's `llama-perplexity --kl-divergence`
reports them (numpy + h5py only; the text and HTML summaries: analysis/sweep_report.py).

Per prompt (prompt_record): at every compared token position (one per step: the logits that
chose the step's token), with p = softmax(REF logits), q = softmax(RUN logits) in float64 and t
REF's token there:
- kl: KL(REF || RUN) = sum p (log p - log q), in nats
- top1: 1 when RUN's argmax is REF's token t
- logp_ref, logp_run: log p[t], log q[t]
A position whose logits hold NaN or Inf is stored as null and left out of every statistic.

Over the whole set (aggregate), the positions of every prompt together, N of them:
- KL mean with its standard error (sample std / sqrt N), max, and the PERCENTILES
  (numpy's linear interpolation)
- dp = q[t] - p[t]: mean, PERCENTILES, RMS = sqrt(mean dp^2)
- top-1 agreement r with its binomial standard error sqrt(r (1 - r) / N)
- perplexity of REF's tokens under REF, exp(-mean logp_ref), and under RUN, exp(-mean logp_run),
  their ratio and its log, mean(logp_ref - logp_run)
- the first divergence of each diverging prompt counted by (layer, kind)
- the prompts, worst first: diverging before matching, then by KL mean
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gemma4_trace.diff.metrics import kl_rows, log_softmax
from gemma4_trace.diff.result import jsonable

PERCENTILES = (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1)


# ------------------------------------------------------------------ per prompt
def position_metrics(ref_logits: np.ndarray, run_logits: np.ndarray, tokens: np.ndarray) -> dict:
    """kl, top1, logp_ref, logp_run (float arrays, NaN where a row is not finite) per row."""
    a = np.asarray(ref_logits, dtype=np.float64)
    b = np.asarray(run_logits, dtype=np.float64)
    ok = np.isfinite(a).all(axis=1) & np.isfinite(b).all(axis=1)
    a, b = np.where(ok[:, None], a, 0.0), np.where(ok[:, None], b, 0.0)
    la, lb = log_softmax(a), log_softmax(b)
    kl = kl_rows(la, lb)
    rows = np.arange(len(a))
    t = np.asarray(tokens, dtype=np.int64)
    nan = np.where(ok, 0.0, np.nan)
    return {
        "kl": kl + nan,
        "top1": (b.argmax(axis=1) == t).astype(np.float64) + nan,
        "logp_ref": la[rows, t] + nan,
        "logp_run": lb[rows, t] + nan,
    }


def _read_logits(reader, n: int) -> np.ndarray:
    return np.asarray(reader.read("logits", rows=slice(0, n)), dtype=np.float64)


def trace_positions(ref_path, run_path) -> dict:
    """position_metrics of RUN against REF over the steps both hold, REF's tokens as t; JSON-ready lists."""
    from gemma4_trace.traces.reader import TraceReader

    with TraceReader(ref_path) as ref, TraceReader(run_path) as run:
        tokens = np.asarray(ref.tokens(), dtype=np.int64)
        n = min(len(tokens), ref.n_steps, run.n_steps)
        m = position_metrics(_read_logits(ref, n), _read_logits(run, n), tokens[:n])
    return {k: [None if not math.isfinite(x) else float(x) for x in v] for k, v in m.items()}


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def prompt_record(ref_path, run_path, base_path, result) -> dict:
    """One prompt's JSON: the verdict, the first divergence's site, and its positions' metrics."""
    d = result.first_divergence
    pos = trace_positions(ref_path, run_path)
    rec = {
        "match": bool(result.match),
        "first_divergence": None
        if d is None
        else {
            "step": d.step,
            "layer": d.layer,
            "kind": d.kind,
            "position": d.position,
            "metric": d.metric,
            "sentence": d.sentence,
        },
        "run_runtime": result.candidate.runtime,
        "tokens": len(pos["kl"]),
        "kl_mean": _mean(pos["kl"]),
        "kl_max": max((x for x in pos["kl"] if x is not None), default=None),
        "top1": _mean(pos["top1"]),
        "positions": pos,
    }
    if base_path is not None:
        rec["base_positions"] = trace_positions(ref_path, base_path)
    return jsonable(rec)


MAX_RECORD_INT = 1 << 53  # a count, position or integral value in a record: a float64 holds it exactly


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and abs(x) <= MAX_RECORD_INT


def _num(x, none: bool = True) -> bool:
    """None (when allowed), a float, or an int a float64 holds (a huge integer would overflow the
    arrays the statistics are computed in)."""
    return (x is None and none) or isinstance(x, float) or _int(x)


POSITION_METRICS = ("kl", "top1", "logp_ref", "logp_run")  # what position_metrics gives, each a list per row


def _positions_ok(pos) -> bool:
    """Every metric of POSITION_METRICS and nothing else, lists of one length of numbers (or None)."""
    if not isinstance(pos, dict) or sorted(pos) != sorted(POSITION_METRICS):
        return False
    if not all(isinstance(v, list) for v in pos.values()):
        return False
    lengths = {len(v) for v in pos.values()}
    return len(lengths) <= 1 and all(_num(x) for v in pos.values() for x in v)


def record_ok(rec: dict) -> bool:
    """Whether a prompt record read back from DIR/prompts has the shape prompt_record writes (a
    record edited or damaged by hand is not used; the prompt runs again)."""
    d = rec.get("first_divergence")
    site_ok = d is None or (
        isinstance(d, dict)
        and _int(d.get("step"))
        and all(d.get(k) is None or _int(d.get(k)) for k in ("layer", "position"))
        and all(isinstance(d.get(k), str) for k in ("kind", "metric", "sentence"))
    )
    return (
        site_ok
        and isinstance(rec.get("match"), bool)
        and isinstance(rec.get("run_runtime"), str)
        and _int(rec.get("tokens"))
        and all(k in rec and _num(rec[k]) for k in ("kl_mean", "kl_max", "top1"))  # the ranking reads each
        and _positions_ok(rec.get("positions"))
        and ("base_positions" not in rec or _positions_ok(rec["base_positions"]))
        and rec.get("report") == f"{rec.get('id')}.html"  # the summary links it: its own page, nothing else
    )


# ------------------------------------------------------------------ over the set
def _column(records: list[dict], key: str, name: str) -> np.ndarray:
    vals = [x for r in records for x in (r.get(key) or {}).get(name, [])]
    return np.array([np.nan if x is None else x for x in vals], dtype=np.float64)


def statistics(kl: np.ndarray, top1: np.ndarray, logp_ref: np.ndarray, logp_run: np.ndarray) -> dict:
    """The statistics of the module docstring over positions (NaN rows left out)."""
    ok = np.isfinite(kl) & np.isfinite(top1) & np.isfinite(logp_ref) & np.isfinite(logp_run)
    n = int(ok.sum())
    if n == 0:
        return {"positions": 0, "non_finite_positions": int(len(kl))}
    kl, top1, lr, lq = kl[ok], top1[ok], logp_ref[ok], logp_run[ok]
    dp = np.exp(lq) - np.exp(lr)
    r = float(top1.mean())
    ln_ratio = float(np.mean(lr - lq))
    return {
        "positions": n,
        "non_finite_positions": int(len(ok) - n),
        "kl": {
            "mean": float(kl.mean()),
            "stderr": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
            "max": float(kl.max()),
            "percentiles": {percentile_key(q): float(np.percentile(kl, q)) for q in PERCENTILES},
        },
        "delta_p": {
            "mean": float(dp.mean()),
            "rms": float(math.sqrt(np.mean(dp * dp))),
            "percentiles": {percentile_key(q): float(np.percentile(dp, q)) for q in PERCENTILES},
        },
        "top1": {"agreement": r, "stderr": math.sqrt(r * (1 - r) / n)},
        "perplexity": {
            "ref": float(math.exp(-lr.mean())),
            "run": float(math.exp(-lq.mean())),
            "ratio": float(math.exp(ln_ratio)),
            "ln_ratio": ln_ratio,
        },
    }


def percentile_key(q: float) -> str:
    return f"p{q:g}"


def _stats_of(records: list[dict], key: str) -> dict:
    return statistics(*(_column(records, key, c) for c in POSITION_METRICS))


def _layer_order(layer) -> int:
    return -1 if layer is None else int(layer)


@dataclass
class DivergenceCount:
    """How many diverging prompts first diverge at (layer, kind)."""

    layer: int | None
    kind: str
    prompts: int

    def to_json(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "prompts": self.prompts}


@dataclass
class PromptRank:
    """One prompt in the summary's ranking (worst first)."""

    id: str
    match: bool
    kl_mean: float | None
    kl_max: float | None
    top1: float | None
    first_divergence: dict | None  # the prompt record's: step, layer, kind, position, metric, sentence
    report: str  # its trace diff report, relative to DIR

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "match": self.match,
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "top1": self.top1,
            "first_divergence": self.first_divergence,
            "report": self.report,
        }


@dataclass
class SweepSummary:
    """A sweep's result (summary.json is its to_json()). `run` and `base`: statistics() of RUN and
    BASE against REF over every compared token position."""

    settings: dict
    prompts: int
    diverging: int
    run: dict
    histogram: list[DivergenceCount] = field(default_factory=list)
    worst_first: list[PromptRank] = field(default_factory=list)
    base: dict | None = None
    failed: list[dict] = field(default_factory=list)  # {id, line, reason}: prompts that did not run to the end
    skipped: list[dict] = field(default_factory=list)  # {id, line, reason}: left out by --skip-unsupported

    def to_json(self) -> dict:
        out = {
            "settings": self.settings,
            "prompts": self.prompts,
            "diverging": self.diverging,
            "run": self.run,
            "first_divergence_histogram": [h.to_json() for h in self.histogram],
            "worst_first": [w.to_json() for w in self.worst_first],
            "failed": self.failed,
            "skipped": self.skipped,
        }
        if self.base is not None:
            out["base"] = self.base
        return out


def aggregate(
    records: list[dict], settings: dict, failed: list[dict] | None = None, skipped: list[dict] | None = None
) -> SweepSummary:
    """The sweep's summary from its prompts' records (their JSON), in the prompt file's order; the
    statistics are over the prompts that ran, `failed` and `skipped` ({id, line, reason}) listed."""
    hist: dict[tuple, int] = {}
    for r in records:
        d = r.get("first_divergence")
        if not r["match"] and d is not None:
            key = (d["layer"], d["kind"])
            hist[key] = hist.get(key, 0) + 1
    ranked = sorted(records, key=lambda r: (r["match"], -(r["kl_mean"] or 0.0), r["id"]))
    return SweepSummary(
        settings=settings,
        prompts=len(records),
        diverging=sum(not r["match"] for r in records),
        run=_stats_of(records, "positions"),
        histogram=[
            DivergenceCount(layer, kind, n)
            for (layer, kind), n in sorted(hist.items(), key=lambda kv: (-kv[1], _layer_order(kv[0][0]), kv[0][1]))
        ],
        worst_first=[
            PromptRank(
                r["id"],
                r["match"],
                r["kl_mean"],
                r["kl_max"],
                r["top1"],
                r.get("first_divergence"),
                f"prompts/{r['report']}",
            )
            for r in ranked
        ],
        base=_stats_of(records, "base_positions") if settings.get("baseline_runtime") else None,
        failed=list(failed or []),
        skipped=list(skipped or []),
    )
