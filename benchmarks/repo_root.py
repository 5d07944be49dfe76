"""The repository root, importable by every benchmark and by every process a benchmark starts.

`python benchmarks/NAME.py` (the form docs/benchmarks.md shows) puts benchmarks/ on sys.path, not
the repository root, so `benchmarks.*` and `tests.*` would not import there, nor in the children the
script starts (`python benchmarks/NAME.py --child ...`, `python -c ...`, `trace ...`). Importing
this module puts the root first on sys.path and first in PYTHONPATH, which every child inherits
whatever its working directory. Every script starts with:

    try:  # `python benchmarks/NAME.py`: benchmarks/ is on sys.path, the repository root is not (yet)
        import repo_root
    except ModuleNotFoundError:  # imported as benchmarks.NAME, or run as `python -m benchmarks.NAME`
        from benchmarks import repo_root
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install(root: Path = ROOT) -> Path:
    """Put `root` first on sys.path and in PYTHONPATH (once: nothing is added twice); return it."""
    where = str(root)
    if where not in sys.path:
        sys.path.insert(0, where)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if where not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([where, *paths])
    return root


install()
