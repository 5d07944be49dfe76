"""Does the diff's outlier note (one layer's own error standing out under the tolerance) stay silent
on clean replays? Replays each golden through each runtime (quantized ones with their baseline) and
prints, per pair, the verdict and whether the note appeared.

    python scripts/outlier_survey.py [--goldens short,window,image] [--runtimes static,onnx,...] [--cache DIR]

Runtimes that are not installed, or refuse a golden (an image for a text-only runtime), are listed as
such. Exports go to the artifact cache (--cache, default: the usual one), so a second run replays only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# runtime -> (tolerance profile or None, baseline runtime or None)
RUNTIMES = {
    "static": (None, None),
    "onnx": (None, None),
    "openvino": ("openvino-f32", None),
    "executorch": ("executorch-f32", None),
    "litert": ("litert-f32", None),
    "mlx": ("mlx-f32", None),
    "llama.cpp": ("llamacpp-f32", None),
    "tico": (None, None),
    "mobius": (None, None),
    "static-w8": (None, "static-w8"),
    "openvino-int4": (None, "openvino-int4-dq"),
    "mlx-q4": (None, "mlx-q4-dq"),
    "litert-int8": (None, "litert-int8-dq"),
    "executorch-int8": (None, "executorch-int8-reference"),
}


def trace(*args: str, cache: str | None) -> subprocess.CompletedProcess:
    extra = ["--cache-dir", cache] if cache and args[0] == "replay" else []
    return subprocess.run(
        [sys.executable, "-m", "gemma4_trace", *args, *extra], cwd=ROOT, capture_output=True, text=True
    )


def survey(golden: str, runtime: str, work: Path, cache: str | None) -> str:
    ref = ROOT / "traces" / "golden" / f"{golden}.h5"
    tol, base = RUNTIMES[runtime]
    run = work / f"{runtime}-{golden}.h5"
    r = trace("replay", str(ref), "--runtime", runtime, "-o", str(run), "--force", cache=cache)
    if r.returncode != 0:
        return f"not replayed ({(r.stderr.strip().splitlines() or ['?'])[-1][:90]})"
    args = ["diff", str(ref), str(run), *(["--tolerances", tol] if tol else [])]
    if base:
        b = work / f"{base}-{golden}.h5"
        r = trace("replay", str(ref), "--runtime", base, "-o", str(b), "--force", cache=cache)
        if r.returncode != 0:
            return "baseline not replayed"
        args += ["--baseline", str(b)]
    out = trace(*args, cache=cache).stdout
    verdict = out.splitlines()[0][:60] if out else "?"
    note = [ln for ln in out.splitlines() if "stands out" in ln]
    return f"{verdict} | {'NOTE: ' + note[0][6:80] if note else 'no note'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--goldens", default="short,window,image")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--cache")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for golden in args.goldens.split(","):
            for runtime in args.runtimes.split(","):
                print(f"{golden:8} {runtime:16} {survey(golden, runtime, Path(tmp), args.cache)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
