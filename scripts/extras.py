"""Print every optional extra of pyproject.toml, comma-separated: what `make test` installs (so a
new runtime's extra needs no Makefile change)."""

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
sys.stdout.write(",".join(tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]))
