"""A plain progress bar on stderr, drawn only for long runs.

The CLI hands a ProgressBar to the library as its `progress(done, total)` callback; the
library never imports this module.
"""

from __future__ import annotations

import sys

MIN_STEPS = 32  # shorter runs finish before a bar would help


class ProgressBar:
    def __init__(self, label: str, width: int = 30):
        self.label, self.width = label, width
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if total >= MIN_STEPS and done > 0 and (done % 8 == 0 or done == total):
            filled = int(self.width * done / total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}")
            sys.stderr.flush()
            self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            self.drawn = False
