"""A plain progress bar on stderr, drawn only for long runs."""

from __future__ import annotations

import sys

MIN_STEPS = 32  # shorter runs finish before a bar would help


class ProgressBar:
    def __init__(self, label: str, total: int, enabled: bool = True, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.enabled = enabled and total >= MIN_STEPS
        self.drawn = False

    def update(self, done: int) -> None:
        if self.enabled and done > 0 and (done % 8 == 0 or done == self.total):
            filled = int(self.width * done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total}")
            sys.stderr.flush()
            self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            self.drawn = False
