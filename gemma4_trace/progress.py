"""Progress on stderr: what a long command is doing, with elapsed time.

The CLI hands a Progress to the library as its `progress(done, total)` callback; the library
calls `progress.phase(text)` (when the object has it) as it enters a phase: loading the model,
preparing a runtime (an export or lowering), generating. It never imports this module.

On a terminal one line is redrawn in place (a ticking clock during a phase, a bar over the
steps); otherwise (a redirected log, or `--no-progress`) plain lines, no carriage returns: each
phase with its time when it ends, in the order things happen, so a failed run's log says what
it got through before its one error line (the phase it failed in is not reported as finished).
A log is never silent for long: a phase that runs past HEARTBEAT seconds is written with its
elapsed time every HEARTBEAT seconds (`heartbeat` does the same for a command without phases: a
sweep, a search). The step count is the steps really run: a run that stops at end of sequence
ends at its own count, not at --max-new-tokens.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

TICK = 0.5  # seconds between redraws of a phase's clock on a terminal


def heartbeat_seconds() -> float:
    """Seconds between the lines a long phase writes to a log (GEMMA4_TRACE_HEARTBEAT_S, default 30)."""
    try:
        v = float(os.environ.get("GEMMA4_TRACE_HEARTBEAT_S", "30"))
    except ValueError:
        return 30.0
    return v if 0.01 <= v <= 3600 else 30.0


def _is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


@contextlib.contextmanager
def heartbeat(label: str, what: str, status=None, stream=None):
    """While the block runs, off a terminal: `label: what ... [status(), ]N s` every
    heartbeat_seconds(); on a terminal nothing (the command draws its own progress there)."""
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        yield
        return
    stop, t0, every = threading.Event(), time.monotonic(), heartbeat_seconds()

    def beat():
        while not stop.wait(every):
            extra = status() if status is not None else ""
            stream.write(f"{label}: {what} ... {extra + ', ' if extra else ''}{time.monotonic() - t0:.0f} s\n")
            stream.flush()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Progress:
    def __init__(self, label: str, enabled: bool | None = None, stream=None, width: int = 30):
        """`enabled`: draw in place (True), plain lines (False), or decide by whether the
        stream is a terminal (None)."""
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = _is_terminal(self.stream)
        self.live, self.label, self.width = enabled, label, width
        self.what: str | None = None  # the current phase
        self.t0 = time.monotonic()
        self.done = self.total = 0
        self.steps_t0: float | None = None
        self.drawn = False  # a live line is on screen (needs a newline before anything else)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ticker: threading.Thread | None = None

    # ------------------------------------------------------------ phases
    def phase(self, what: str) -> None:
        """Enter a phase: the previous one (if any) is reported with its time."""
        self._end_phase()
        with self.lock:
            self.what, self.t0 = what, time.monotonic()
            if self.live:
                self._draw(f"{self.label}: {what} ...")
            self.stop.clear()
            self.ticker = threading.Thread(target=self._tick if self.live else self._beat, daemon=True)
            self.ticker.start()

    def _tick(self) -> None:
        while not self.stop.wait(TICK):
            with self.lock:
                if self.what is not None and not self.done:
                    self._draw(f"{self.label}: {self.what} ... {time.monotonic() - self.t0:.0f} s")

    def _beat(self) -> None:
        """Plain lines: a phase past the heartbeat is written with its elapsed time, every heartbeat."""
        while not self.stop.wait(heartbeat_seconds()):
            with self.lock:
                if self.what is None:
                    continue
                steps = f"{self.done}/{self.total} steps, " if self.total else ""
                self.stream.write(f"{self.label}: {self.what} ... {steps}{time.monotonic() - self.t0:.0f} s\n")
                self.stream.flush()

    def _end_phase(self) -> None:
        self.stop.set()
        if self.ticker is not None:
            self.ticker.join()
            self.ticker = None
        with self.lock:
            if self.what is not None:
                self._line(f"{self.label}: {self.what}: {self._steps_words()}{time.monotonic() - self.t0:.1f} s")
            self.what = None

    # ------------------------------------------------------------ steps
    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.done, self.total = done, total
            if self.live:
                filled = int(self.width * done / max(total, 1))
                self._draw(
                    f"{self.label}{': ' + self.what if self.what else ''} "
                    f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} "
                    f"{time.monotonic() - self.t0:.0f} s"
                )

    def _steps_words(self) -> str:
        if not self.done:
            return ""
        if self.done < self.total:  # stopped early: end of sequence
            return f"{self.done} steps (ended at end of sequence, before {self.total}), "
        return f"{self.done} steps, "

    # ------------------------------------------------------------ output
    def _draw(self, text: str) -> None:  # live only: redraw the one line
        self.stream.write(f"\r{text}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def _line(self, text: str) -> None:
        if not self.live:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        self._draw(text)
        self.stream.write("\n")
        self.stream.flush()
        self.drawn = False

    def close(self, completed: bool = True) -> None:
        """End the last phase (reported when `completed`; a failure only ends the line)."""
        if not completed:
            self.stop.set()
            with self.lock:
                self.what = None
        self._end_phase()
        if self.drawn:
            self.stream.write("\n")
            self.drawn = False
        self.stream.flush()
