"""The one-line progress bar of `hookserve batch` on stderr (images/s and ETA)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr (images/s and ETA) and the final summary."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.start = time.monotonic()
        self.last = 0.0
        self.width = 0

    def update(self, done: int, failed: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < 0.2):
            return
        self.last = now
        n = done + failed
        elapsed = max(1e-9, now - self.start)
        rate = n / elapsed
        frac = n / self.total if self.total else 1.0
        eta = (self.total - n) / rate if rate > 0 else float("inf")
        bar = "#" * int(frac * 24)
        eta_s = "--:--" if eta == float("inf") else _hms(eta)
        line = (f"[{bar:<24}] {n}/{self.total} {frac:4.0%}  {rate:6.1f} img/s  "
                f"ETA {eta_s}" + (f"  failed {failed}" if failed else ""))
        pad = max(0, self.width - len(line))
        self.width = len(line)
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self.width:
            sys.stderr.write("\n")


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60:02d}:{s % 60:02d}"
