"""What a long cachectl command shows while it works (a build, an ensure, a pull).

``Progress``: a tqdm bar over bytes on a terminal, one line per phase otherwise, so logs of
init containers stay readable. Called by ``commands`` and ``pull_command``.
"""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    """A tqdm bar over bytes on a terminal; a line per phase otherwise (logs stay readable)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.tty = sys.stderr.isatty()

    def phase(self, text: str) -> None:
        if self.enabled:
            self._close()
            print(f"cachectl: {text}", file=sys.stderr, flush=True)

    def bytes(self, done: int, total: int) -> None:
        if not (self.enabled and self.tty and total):
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, leave=False)
        self.bar.update(done - self.bar.n)

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def done(self) -> None:
        self._close()
