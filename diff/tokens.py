"""Token judgement: do the chosen tokens agree, and is a flip a near tie, a real error, or
inside BASE's envelope? Returns the facts and the token divergence, if any; core offers it
among the tensors' candidates."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .align import Plan
from .result import Divergence, Problem, Skipped, TokenFlip, TokenInfo
from .tolerances import Tolerances


@dataclass
class TokenVerdict:
    info: TokenInfo
    divergence: Divergence | None = None  # a token candidate for the first divergence
    notes: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def judge_tokens(ref, base, plan: Plan, rt: np.ndarray | None, ct: np.ndarray | None, tol: Tolerances) -> TokenVerdict:
    """REF's tokens `rt` against RUN's `ct` over the plan's steps (BASE's too under --baseline)."""
    v = TokenVerdict(TokenInfo([] if rt is None else [int(x) for x in rt], [] if ct is None else [int(x) for x in ct]))
    info = v.info
    if rt is None or ct is None:
        where = "REF" if rt is None and ct is not None else "RUN" if ct is None and rt is not None else None
        if where:
            other = "RUN" if where == "REF" else "REF"
            v.skipped.append(Skipped("token", None, f"only in {other}"))
            v.divergence = Divergence(
                0,
                None,
                "token",
                plan.step_positions[0][1] - 1,
                "missing",
                1.0,
                0.0,
                Problem(f"chosen tokens stored only in {other}"),
            )
        else:
            v.notes.append("neither trace stores chosen tokens")
        return v
    n = min(plan.token_steps, rt.size, ct.size)
    eq = rt[:n] == ct[:n]
    info.compared_steps, info.matches, info.accuracy = int(n), int(eq.sum()), float(eq.mean()) if n else 1.0
    m = plan.first_token_mismatch
    if m is None:
        return v
    info.first_mismatch_step = m
    info.mismatch_steps = [int(s) for s in np.flatnonzero(~eq)[:100]]
    info.flip = flip = flip_at(ref, rt, ct, m, tol.near_tie_margin)
    if tol.accept_near_ties and flip.label == "near tie" and not plan.free_running:
        v.notes.append(f"token flip at step {m} is a near tie and accepted by the tolerances file")
        return v
    if base is not None and base.has("token"):  # flips BASE makes too are inside its envelope
        bt = base.tokens()
        flips = np.flatnonzero(~eq)
        judged = [int(s) for s in flips if s < plan.numeric_steps]  # BASE had REF's inputs there
        outside = [s for s in judged if (s >= bt.size or bt[s] != ct[s]) and not base_could_flip(ref, base, rt, ct, s)]
        if not outside:
            bounded = f" up to step {plan.numeric_steps - 1}" if len(judged) < flips.size else ""
            v.notes.append(
                f"every token RUN chooses differently from REF{bounded} is inside the baseline: BASE "
                "chooses it too, or REF prefers its own by at most twice BASE's 99th-percentile logit error"
            )
            return v
        if outside[0] != m:
            m, flip = outside[0], flip_at(ref, rt, ct, outside[0], tol.near_tie_margin)
    v.divergence = Divergence(m, None, "token", plan.step_positions[m][1] - 1, "token", 1.0, 0.0, flip)
    return v


def base_could_flip(ref, base, rt, ct, m: int) -> bool:
    """Is RUN's token at step m within reach of BASE's own logit error? REF prefers its token
    by `gap`; logits off by d can reverse a gap up to 2d. d is BASE's 99th-percentile
    absolute logit error at that step (its single worst logit would excuse too much)."""
    if not (base.has("logits") and ref.has("logits")):
        return False
    if m >= min(base.dataset("logits").shape[0], ref.dataset("logits").shape[0]):
        return False
    a = ref.read("logits", None, slice(m, m + 1))[0].astype(np.float64)
    c = base.read("logits", None, slice(m, m + 1))[0].astype(np.float64)
    ours, theirs = int(rt[m]), int(ct[m])
    if a.shape != c.shape or not 0 <= min(ours, theirs) <= max(ours, theirs) < a.size:
        return False
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(c))):
        return False
    gap = a[ours] - a[theirs]  # as TokenFlip.reference_gap
    return gap <= 2 * float(np.percentile(np.abs(a - c), 99))  # BASE's large errors, not its one worst


def flip_at(ref, rt, ct, m: int, near_tie_margin: float) -> TokenFlip:
    """The tokens chosen at step m, labelled by REF's logits there."""
    flip = TokenFlip(int(rt[m]), int(ct[m]))
    if not (ref.has("logits") and m < ref.dataset("logits").shape[0]):
        flip.label = "unknown (no REF logits)"
        return flip
    lg = ref.read("logits", None, slice(m, m + 1))[0].astype(np.float64)
    if not (np.all(np.isfinite(lg)) and lg.size > max(rt[m], ct[m])):
        flip.label = "unknown (REF logits unusable)"
        return flip
    top2 = np.partition(lg, -2)[-2:] if lg.size >= 2 else np.array([lg.max(), lg.max()])
    flip.reference_margin = float(top2.max() - top2.min())
    flip.reference_gap = float(lg[rt[m]] - lg[ct[m]])
    flip.candidate_rank = int(np.count_nonzero(lg > lg[ct[m]])) + 1
    flip.label = "near tie" if flip.reference_gap < near_tie_margin else "real error"
    return flip
