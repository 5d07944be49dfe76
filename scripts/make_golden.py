"""Regenerate the golden traces in traces/golden/ (deterministic) and their content hashes.

python scripts/make_golden.py            # re-record all goldens with the installed transformers
python scripts/make_golden.py audio      # re-record only the goldens named
python scripts/make_golden.py --check    # only verify HASHES against the checked-in files
"""

from __future__ import annotations

import argparse
import sys

from gemma4_trace.recorder import golden


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help="the goldens to re-record (default: every one)")
    ap.add_argument("--check", action="store_true", help="verify HASHES only")
    args = ap.parse_args()
    if not args.check:
        print("\n".join(golden.regenerate(args.names or None)))
    recorded = golden.recorded_hashes()
    bad = {n: h for n, h in golden.content_hashes().items() if recorded.get(n) != h}
    for n, h in bad.items():
        print(f"{n}.h5: content hash {h} differs from HASHES ({recorded.get(n)})")
    if not bad:
        print(f"{len(recorded)} golden traces match HASHES")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
