"""diff_traces: one streaming pass over both traces in data-flow order, then the report data.

Memory is bounded by a row block of the largest dataset (BLOCK_BYTES per trace plus a
few temporaries of that size) and per-row metric vectors; never the whole trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gemma4_trace.traces import schema as S
from gemma4_trace.traces.reader import TraceReader

from .align import Plan, check_compatible, dataflow_sequence, make_plan
from .metrics import METRIC_ORDER, RowStats, compare_mask_block, element_detail, mask_row_detail
from .tolerances import Tolerances, load_tolerances, precision_class

BLOCK_BYTES = 16 << 20  # rows read at once per trace
GROWTH_KINDS = ("embeddings", "layer_out", "final_hidden")  # full per-row rel-L2 kept for these
INTRODUCED_RATIO = 10.0  # error at least this many times the layer input's: introduced here


@dataclass
class DiffResult:
    match: bool
    first_divergence: dict | None
    tokens: dict
    growth: dict
    tensors: list[dict]
    skipped: list[dict]
    notes: list[str]
    steps: dict
    reference: dict
    candidate: dict
    tolerances: dict
    layers: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return _jsonable({
            "match": self.match, "first_divergence": self.first_divergence, "tokens": self.tokens,
            "steps": self.steps, "growth": self.growth, "tensors": self.tensors, "skipped": self.skipped,
            "notes": self.notes, "reference": self.reference, "candidate": self.candidate,
            "tolerances": self.tolerances, "layers": self.layers,
        })


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    return x


def _info(r: TraceReader, path) -> dict:
    p = r.provenance
    return {"path": str(path), "mode": p["mode"], "dtype": p["dtype"], "runtime": p["runtime"],
            "device": p["device"], "steps": r.n_steps, "positions": r.n_positions,
            "model_name": p["model_name"], "model_config_sha256": p["model_config_sha256"]}


class _Differ:
    def __init__(self, ref: TraceReader, run: TraceReader, tol: Tolerances):
        self.ref, self.run, self.tol = ref, run, tol
        self.layers = ref.layers
        self.seq = dataflow_sequence(len(self.layers))
        self.order = {key: i for i, key in enumerate(self.seq)}
        self.notes: list[str] = []
        self.skipped: list[dict] = []
        self.tensors: list[dict] = []
        self.best: dict | None = None
        self.rel_rows: dict[tuple[str, int | None], np.ndarray] = {}
        self.growth_sums: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
        self.thresholds: dict[tuple[str, int | None], object] = {}

    # ------------------------------------------------------------ candidates
    def _offer(self, cand: dict) -> None:
        key = (cand["step"], self.order[(cand["kind"], cand["layer"])], cand["position"])
        cand["_key"] = key
        if self.best is None or key < self.best["_key"]:
            self.best = cand

    def _row_limit(self, kind: str, layer, index: str) -> int | None:
        """Rows of this dataset that can still beat the best candidate so far."""
        if self.best is None:
            return None
        s_best, o_best, _ = self.best["_key"]
        s_lim = s_best + (1 if self.order[(kind, layer)] < o_best else 0)
        if index == "step":
            return s_lim
        return 0 if s_lim == 0 else self.plan.step_positions[s_lim - 1][1]

    def _base(self, kind, layer, step, position) -> dict:
        return {"step": int(step), "phase": "prefill" if step == 0 else "decode",
                "layer": layer, "kind": kind, "position": int(position)}

    def _position_of(self, index: str, row: int) -> tuple[int, int]:
        """(step, absolute position) of a dataset row."""
        if index == "step":
            return row, self.plan.step_positions[row][1] - 1
        return int(self.row_steps[row]), row

    # ------------------------------------------------------------ main pass
    def run_all(self) -> None:
        ref, run = self.ref, self.run
        self.ref_tokens = ref.tokens() if ref.has("token") else None
        self.run_tokens = run.tokens() if run.has("token") else None
        self.plan: Plan = make_plan(ref, run, self.ref_tokens, self.run_tokens)
        self.row_steps = self.plan.row_steps()
        if ref.n_steps != run.n_steps:
            fewer, more = ("RUN", "REF") if run.n_steps < ref.n_steps else ("REF", "RUN")
            self.notes.append(
                f"{fewer} has {min(ref.n_steps, run.n_steps)} steps, {more} has {max(ref.n_steps, run.n_steps)}: "
                f"compared the first {self.plan.token_steps}"
            )
        if self.plan.free_running and self.plan.first_token_mismatch is not None:
            m = self.plan.first_token_mismatch
            if self.plan.numeric_steps < self.plan.token_steps:
                self.notes.append(
                    f"free-running trace: tokens differ from step {m}, so tensors of steps {m + 1}.."
                    f"{self.plan.token_steps - 1} were not compared (their inputs differ)"
                )
        self._tokens_candidate()
        present_ref = set(ref.kinds_present())
        present_run = set(run.kinds_present())
        for kind, layer in self.seq:
            if kind == "token":
                continue
            a, b = (kind, layer) in present_ref, (kind, layer) in present_run
            if not a and not b:
                continue
            if a != b:
                where = "REF" if a else "RUN"
                self.skipped.append({"kind": kind, "layer": layer, "reason": f"only in {where}"})
                if kind == "logits":
                    self._offer(self._base(kind, None, 0, self.plan.step_positions[0][1] - 1)
                                | {"metric": "missing", "value": 1.0, "threshold": 0.0,
                                   "message": f"logits stored only in {where}"})
                continue
            self._compare(kind, layer)

    def _tolerance(self, kind, layer):
        ra = self.ref.source_dtype(kind, layer)
        rb = self.run.source_dtype(kind, layer)
        prec = precision_class(ra, rb, self.ref.provenance["dtype"], self.run.provenance["dtype"])
        t = self.tol.resolve(kind, layer, prec, self.plan.numeric_steps)
        self.thresholds[(kind, layer)] = t
        return t

    def _compare(self, kind: str, layer) -> None:
        spec = S.KIND_BY_NAME[kind]
        da, db = self.ref.dataset(kind, layer), self.run.dataset(kind, layer)
        n_rows = self.plan.n_rows if spec.index == "position" else self.plan.numeric_steps
        summary = {"kind": kind, "layer": layer, "rows": n_rows, "rows_compared": 0, "status": "ok"}
        self.tensors.append(summary)
        is_mask = kind == "mask"
        if (is_mask and (da.ndim != 2 or db.ndim != 2)) or (not is_mask and da.shape[1:] != db.shape[1:]):
            summary["status"] = "shape"
            step0_pos = 0 if spec.index == "position" else self.plan.step_positions[0][1] - 1
            msg = f"row shape {tuple(da.shape[1:])} in REF vs {tuple(db.shape[1:])} in RUN"
            self._offer(self._base(kind, layer, 0, step0_pos) | {"metric": "shape", "value": 1.0, "threshold": 0.0,
                                                                "message": msg, "ref_shape": list(da.shape),
                                                                "run_shape": list(db.shape)})
            return
        short = min(da.shape[0], db.shape[0])
        if short < n_rows:
            who = "REF" if da.shape[0] < db.shape[0] else "RUN"
            step, pos = self._position_of(spec.index, short)
            summary["status"] = "rows"
            self._offer(self._base(kind, layer, step, pos) | {
                "metric": "rows", "value": float(short), "threshold": float(n_rows),
                "message": f"{who} has {short} rows, the compared steps need {n_rows}"})
            n_rows = short
        tol = self._tolerance(kind, layer)
        summary["threshold"] = float(tol.rel_l2[0]) if not is_mask else 0.0
        summary["precision"] = tol.precision
        keep = kind in GROWTH_KINDS
        limit = None if keep else self._row_limit(kind, layer, spec.index)
        end = n_rows if limit is None else min(n_rows, limit)
        row_bytes = max(1, int(np.prod(da.shape[1:], dtype=np.int64)) * da.dtype.itemsize)
        chunk = (da.chunks or (1,))[0]
        block = max(chunk, (BLOCK_BYTES // row_bytes) // chunk * chunk)
        row_steps = self.row_steps if spec.index == "position" else np.arange(self.plan.numeric_steps)
        if keep:
            rel_all = np.zeros(n_rows, dtype=np.float32)
            nd_all = np.zeros(n_rows) if kind == "layer_out" else None
            na_all = np.zeros(n_rows) if kind == "layer_out" else None
        worst_rel, worst_abs, min_cos = 0.0, 0.0, 1.0
        found = False
        for r0 in range(0, end, block):
            r1 = min(end, r0 + block)
            a = self.ref.read(kind, layer, slice(r0, r1))
            b = self.run.read(kind, layer, slice(r0, r1))
            st = row_steps[r0:r1]
            if is_mask:
                count = compare_mask_block(a, b)
                fails = (count > 0) & ~tol.skip[st]
                if not found and fails.any():
                    i = int(np.argmax(fails))
                    step, pos = self._position_of(spec.index, r0 + i)
                    det = mask_row_detail(a[i], b[i])
                    self._offer(self._base(kind, layer, step, pos) | {
                        "metric": "mask_keys", "value": float(count[i]), "threshold": 0.0} | det)
                    found = True
                summary["mismatched_rows"] = summary.get("mismatched_rows", 0) + int(fails.sum())
            else:
                rs = RowStats(a, b, tol.l2_floor[st])
                fails, which = rs.failing(tol.rel_l2[st], tol.max_abs[st], tol.cosine[st], tol.skip[st])
                worst_rel = max(worst_rel, float(rs.rel_l2.max()))
                worst_abs = max(worst_abs, float(rs.max_abs.max()))
                min_cos = min(min_cos, float(rs.cosine.min()))
                summary["failed_rows"] = summary.get("failed_rows", 0) + int(fails.sum())
                if keep:
                    rel_all[r0:r1] = rs.rel_l2
                    if nd_all is not None:
                        nd_all[r0:r1], na_all[r0:r1] = rs.nd, rs.na
                if not found and fails.any():
                    i = int(np.argmax(fails))
                    self._offer_float(kind, layer, spec.index, r0 + i, a[i], b[i], rs, i, METRIC_ORDER[which[i]], tol)
                    found = True
            summary["rows_compared"] = r1
            if found and not keep:
                break
        if not is_mask:
            summary.update(max_rel_l2=worst_rel, max_abs=worst_abs, min_cosine=min_cos)
        if found:
            summary["status"] = "diverged"
        if keep:
            self.rel_rows[(kind, layer)] = rel_all
            if nd_all is not None:
                m = int(np.prod(da.shape[1:]))
                self.growth_sums[layer] = (nd_all, na_all, m)

    def _offer_float(self, kind, layer, index, row, a_row, b_row, rs: RowStats, i, metric, tol) -> None:
        step, pos = self._position_of(index, row)
        t = tol.at(step)
        if metric == "nonfinite":
            value = float(np.count_nonzero(~np.isfinite(a_row)) + np.count_nonzero(~np.isfinite(b_row)))
            threshold = 0.0
        else:
            value = float({"rel_l2": rs.rel_l2, "max_abs": rs.max_abs, "cosine": rs.cosine}[metric][i])
            threshold = t[metric]
        det = element_detail(a_row, b_row, metric, t)
        cand = self._base(kind, layer, step, pos) | {"metric": metric, "value": value, "threshold": threshold}
        names = _element_names(kind, det["first"])
        cand.update(names)
        cand.update({
            "index": list(det["first"]), "ref_value": det["first_ref"], "run_value": det["first_run"],
            "worst": {"index": list(det["worst"]), "ref": det["worst_ref"], "run": det["worst_run"],
                      **{f"{k}": v for k, v in _element_names(kind, det["worst"]).items()}},
            "metrics": {"rel_l2": float(rs.rel_l2[i]), "max_abs": float(rs.max_abs[i]), "cosine": float(rs.cosine[i])},
            "precision": tol.precision,
        })
        self._offer(cand)

    # ------------------------------------------------------------ tokens
    def _tokens_candidate(self) -> None:
        ref, plan = self.ref, self.plan
        rt, ct = self.ref_tokens, self.run_tokens
        info: dict = {"reference": [] if rt is None else [int(x) for x in rt],
                      "candidate": [] if ct is None else [int(x) for x in ct],
                      "compared_steps": 0, "matches": 0, "accuracy": 0.0, "first_mismatch_step": None}
        self.tokens = info
        if rt is None or ct is None:
            where = "REF" if rt is None and ct is not None else "RUN" if ct is None and rt is not None else None
            if where:
                other = "RUN" if where == "REF" else "REF"
                self.skipped.append({"kind": "token", "layer": None, "reason": f"only in {other}"})
                self._offer(self._base("token", None, 0, plan.step_positions[0][1] - 1) | {
                    "metric": "missing", "value": 1.0, "threshold": 0.0, "message": f"chosen tokens stored only in {other}"})
            else:
                self.notes.append("neither trace stores chosen tokens")
            return
        n = min(plan.token_steps, rt.size, ct.size)
        eq = rt[:n] == ct[:n]
        info.update(compared_steps=int(n), matches=int(eq.sum()), accuracy=float(eq.mean()) if n else 1.0)
        m = plan.first_token_mismatch
        if m is None:
            return
        info["first_mismatch_step"] = m
        info["mismatch_steps"] = [int(s) for s in np.flatnonzero(~eq)[:100]]
        tie = {"reference_token": int(rt[m]), "candidate_token": int(ct[m])}
        if ref.has("logits") and m < ref.dataset("logits").shape[0]:
            lg = ref.read("logits", None, slice(m, m + 1))[0].astype(np.float64)
            if np.all(np.isfinite(lg)) and lg.size > max(rt[m], ct[m]):
                top2 = np.partition(lg, -2)[-2:] if lg.size >= 2 else np.array([lg.max(), lg.max()])
                margin = float(top2.max() - top2.min())
                gap = float(lg[rt[m]] - lg[ct[m]])
                rank = int(np.count_nonzero(lg > lg[ct[m]])) + 1
                near = gap < self.tol.near_tie_margin
                tie.update(reference_margin=margin, reference_gap=gap, candidate_rank=rank,
                           label="near tie" if near else "real error")
            else:
                tie["label"] = "unknown (REF logits unusable)"
        else:
            tie["label"] = "unknown (no REF logits)"
        info.update(tie)
        if self.tol.accept_near_ties and tie.get("label") == "near tie" and not plan.free_running:
            self.notes.append(f"token flip at step {m} is a near tie and accepted by the tolerances file")
            return
        self._offer(self._base("token", None, m, plan.step_positions[m][1] - 1) | {
            "metric": "token", "value": 1.0, "threshold": 0.0} | tie)

    # ------------------------------------------------------------ growth, origin
    def growth(self) -> dict:
        plan = self.plan
        starts = np.array([a for a, _ in plan.step_positions[: plan.numeric_steps]])
        table, thresholds = [], []
        layers = sorted(self.growth_sums)
        for l in layers:
            nd, na, m = self.growth_sums[l]
            n = min(nd.size, plan.n_rows)
            st = starts[starts < n] if n else starts[:0]
            if n == 0 or st.size == 0:
                table.append([None] * plan.numeric_steps)
                thresholds.append([None] * plan.numeric_steps)
                continue
            snd = np.add.reduceat(nd[:n], st)
            sna = np.add.reduceat(na[:n], st)
            cnt = np.diff(np.append(st, n))
            tol = self.thresholds[("layer_out", l)]
            floor = tol.l2_floor[: st.size] * np.sqrt(m * cnt)
            with np.errstate(invalid="ignore", divide="ignore"):
                rel = np.sqrt(snd) / np.maximum(np.sqrt(sna), np.maximum(floor, 1e-300))
            rel[snd == 0] = 0.0
            row = [float(x) for x in rel] + [None] * (plan.numeric_steps - st.size)
            table.append(row)
            thresholds.append([float(x) for x in tol.rel_l2[: plan.numeric_steps]])
        per_layer = [max((v for v in row if v is not None), default=None) for row in table]
        jump = None
        prev = None
        for l, v in zip(layers, per_layer):
            if v is not None and prev is not None and prev > 0:
                ratio = v / prev
                if jump is None or ratio > jump["ratio"]:
                    jump = {"layer": l, "ratio": ratio, "before": prev, "after": v}
            prev = v if v is not None else prev
        return {"metric": "rel_l2", "kind": "layer_out", "layers": layers, "steps": list(range(plan.numeric_steps)),
                "table": table, "thresholds": thresholds, "max_over_steps": per_layer, "largest_jump": jump}

    def origin(self, d: dict) -> dict | None:
        kind, layer, pos, step = d["kind"], d["layer"], d["position"], d["step"]
        if kind in ("mask", "embeddings", "per_layer_inputs") or kind.startswith("rope_"):
            why = {"mask": "the mask is computed from positions, not from data"}.get(
                kind, "it is computed from token ids / positions, not from an earlier tensor")
            return {"verdict": "introduced", "reason": why}
        if kind == "token":
            return None
        if layer is not None:
            inp = ("layer_out", layer - 1) if layer > 0 else ("embeddings", None)
        elif kind == "final_hidden":
            inp = ("layer_out", len(self.layers) - 1)
        elif kind == "logits":
            inp = ("final_hidden", None)
        else:
            return None
        if d["metric"] in ("shape", "rows", "missing"):
            return None
        rows = self.rel_rows.get(inp)
        if rows is None or pos >= rows.size:
            return {"verdict": "unknown", "reason": f"{inp[0]} of layer {inp[1]} not compared" if inp[1] is not None
                    else f"{inp[0]} not compared"}
        in_rel = float(rows[pos])
        in_tol = self.thresholds[inp].rel_l2[step]
        out = {"input_kind": inp[0], "input_layer": inp[1], "input_rel_l2": in_rel, "input_threshold": float(in_tol)}
        if layer is not None and ("layer_out", layer) in self.rel_rows:
            out["output_rel_l2"] = float(self.rel_rows[("layer_out", layer)][pos])
        here = d.get("metrics", {}).get("rel_l2", d["value"])
        out["rel_l2_here"] = here
        if not math.isfinite(here) or (in_rel <= in_tol and here >= INTRODUCED_RATIO * max(in_rel, 1e-30)):
            out["verdict"] = "introduced"
        else:
            out["verdict"] = "inherited"
            out["reason"] = ("the input already carries a comparable error: accumulated drift or an upstream cause"
                             if in_rel <= in_tol else "the input already exceeds its tolerance")
        return out


def _element_names(kind: str, idx: tuple) -> dict:
    if kind in ("q", "k", "v") and len(idx) == 2:
        return {"head": idx[0], "channel": idx[1]}
    if kind == "per_layer_inputs" and len(idx) == 2:
        return {"ple_layer": idx[0], "channel": idx[1]}
    if kind == "logits" and len(idx) == 1:
        return {"vocab_id": idx[0], "channel": idx[0]}
    if len(idx) == 1:
        return {"channel": idx[0]}
    return {}


def _layer_desc(li) -> dict:
    return {"layer_type": li.layer_type, "kv_role": li.kv_role, "kv_source": li.kv_source,
            "head_dim": li.head_dim, "num_heads": li.num_heads, "num_kv_heads": li.num_kv_heads}


def diff_traces(ref_path, run_path, tolerances_path=None) -> DiffResult:
    """Compare a candidate trace against a reference; raise TraceToolError on bad input."""
    tol = load_tolerances(tolerances_path)
    with TraceReader(ref_path) as ref, TraceReader(run_path) as run:
        check_compatible(ref, run)
        d = _Differ(ref, run, tol)
        d.run_all()
        growth = d.growth()
        first = d.best
        if first is not None:
            first.pop("_key", None)
            if first["layer"] is not None:
                first.update(_layer_desc(ref.layers[first["layer"]]))
            org = d.origin(first)
            if org is not None:
                first["origin"] = org
        missing = [s for s in d.skipped]
        if missing:
            d.notes.append("tensors in only one trace (not compared): "
                           + ", ".join(f"{s['kind']}" + (f" L{s['layer']}" if s["layer"] is not None else "")
                                       + f" ({s['reason']})" for s in missing[:12])
                           + (f" and {len(missing) - 12} more" if len(missing) > 12 else ""))
        plan = d.plan
        result = DiffResult(
            match=first is None,
            first_divergence=first,
            tokens=d.tokens,
            growth=growth,
            tensors=d.tensors,
            skipped=d.skipped,
            notes=d.notes,
            steps={"reference": ref.n_steps, "candidate": run.n_steps, "compared": plan.token_steps,
                   "numbers_compared": plan.numeric_steps, "prompt_len": ref.prompt_len,
                   "positions_compared": plan.n_rows, "free_running": plan.free_running},
            reference=_info(ref, ref_path),
            candidate=_info(run, run_path),
            tolerances=tol.describe(),
            layers=[_layer_desc(li) for li in ref.layers],
        )
        if first is not None:
            from .report import divergence_sentence

            first["sentence"] = divergence_sentence(result)
        return result
