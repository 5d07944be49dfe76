"""Numbers as every report prints them: a leaf module (nothing else of the diff imported)."""

from __future__ import annotations

import math


def sci(v) -> str:
    """4.1e-2 style (no exponent padding); 0 and non-finite spelled plainly."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    m, e = f"{v:.1e}".split("e")
    return f"{m.removesuffix('.0')}e{int(e)}"


def sci_pair(a: float, b: float) -> tuple[str, str]:
    """Both numbers in sci(), with more digits where one digit would print them equal:
    "1.04e-1 > 1e-1", never "1e-1 > 1e-1"."""
    sa, sb = sci(a), sci(b)
    digits = 1
    while sa == sb and float(a) != float(b) and digits < 17:
        digits += 1
        sa, sb = (f"{float(x):.{digits}e}" for x in (a, b))
        sa, sb = (_trim(x) for x in (sa, sb))
    return sa, sb


def _trim(s: str) -> str:
    m, e = s.split("e")
    m = m.rstrip("0").rstrip(".") if "." in m else m
    return f"{m}e{int(e)}"


def fmt(metric, v) -> str:
    """A metric's value as reports print it ("-" when there is none)."""
    return "-" if v is None else val(v) if metric.plain else sci(v)


def val(v) -> str:
    if isinstance(v, str):
        return v
    v = float(v)
    if not math.isfinite(v):
        return sci(v)
    return f"{v:.4g}"


def seconds_text(s: float, ms: float) -> str:
    """'0.68 s': a time into an audio clip (two decimals where a frame is a whole number of 10 ms, three
    otherwise)."""
    return f"{s:.{2 if ms % 10 == 0 else 3}f} s"
