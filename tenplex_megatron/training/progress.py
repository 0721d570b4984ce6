"""Progress of long work in documents and tokens per second: a bar redrawn in place on an interactive terminal,
otherwise one line every ``every`` documents (the line Megatron-LM's ``preprocess_data.py`` prints, plus tokens/s)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def _si(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


class Progress:
    """Counts documents, tokens and input bytes; reports rates while it runs and once at the end."""

    def __init__(self, total_bytes: int | None = None, stream: TextIO | None = None, every: int = 1000,
                 label: str = "build_dataset", interactive: bool | None = None, redraw_s: float = 0.1,
                 clock: Callable[[], float] = time.perf_counter):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty()) if interactive is None else interactive
        self.total_bytes, self.every, self.label, self.redraw_s, self.clock = total_bytes, every, label, redraw_s, clock
        self.t0 = clock()
        self.docs = self.tokens = self.nbytes = 0
        self._next_line = every
        self._last_draw = float("-inf")

    def start(self) -> None:
        """Start the clock now (rates then leave out set-up, as preprocess_data.py's do)."""
        self.t0 = self.clock()

    def elapsed(self) -> float:
        return max(self.clock() - self.t0, 1e-9)

    def rates(self) -> tuple[float, float, float]:
        """(documents/s, tokens/s, MB/s) since the start."""
        t = self.elapsed()
        return self.docs / t, self.tokens / t, self.nbytes / t / 1e6

    def line(self) -> str:
        d, t, mb = self.rates()
        return f"Processed {self.docs} documents ({d:.1f} docs/s, {t:.1f} tokens/s, {mb:.2f} MB/s)."

    def bar(self, width: int = 24) -> str:
        d, t, mb = self.rates()
        if self.total_bytes:
            frac = min(self.nbytes / self.total_bytes, 1.0)
            filled = int(frac * width)
            eta = (self.total_bytes - self.nbytes) / (mb * 1e6) if mb > 0 else 0.0
            head = (f"|{'#' * filled}{'.' * (width - filled)}| {100 * frac:3.0f}% "
                    f"{self.nbytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB, ETA {eta:.0f} s | ")
        else:
            head = f"{self.nbytes / 1e6:.1f} MB | "
        return (f"{self.label} {head}{self.docs} docs {_si(d)} docs/s | {_si(self.tokens)} tokens {_si(t)} tokens/s")

    def update(self, docs: int = 1, tokens: int = 0, nbytes: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.nbytes += nbytes
        if self.interactive:
            now = self.clock()
            if now - self._last_draw >= self.redraw_s:
                self._last_draw = now
                self.stream.write("\r" + self.bar() + "\x1b[K")
                self.stream.flush()
        elif self.every and self.docs >= self._next_line:
            self._next_line = (self.docs // self.every + 1) * self.every
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Draw the final state (the bar, ended by a newline, on a terminal)."""
        if self.interactive:
            self.stream.write("\r" + self.bar() + "\x1b[K\n")
            self.stream.flush()
