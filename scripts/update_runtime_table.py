"""Write the registry's runtime table (replayer/runtimes/registry.py markdown_table) into README.md,
in place of the table there: after a row is added or changed, the README follows from it
(tests/runtimes/test_registry.py fails until it does).

    python scripts/update_runtime_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from gemma4_trace.replayer.runtimes.registry import PLUGIN, markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"
HEAD = "| `--runtime` | what runs |"


def main() -> int:
    text = README.read_text(encoding="utf-8")
    start = text.index(HEAD)
    end = text.index("\n", text.index(f"| `{PLUGIN}` |", start))
    new = text[:start] + markdown_table() + text[end:]
    if new != text:
        README.write_text(new, encoding="utf-8")
        print(f"updated the runtime table in {README}")
    else:
        print("the README's runtime table is the registry's already")
    return 0


if __name__ == "__main__":
    sys.exit(main())
