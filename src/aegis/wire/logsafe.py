"""Peer-supplied text in the logs: truncated and escaped (``shown``), and warnings about
peer input at a bounded rate (``RateLimitedLog``), so no peer can forge a log line (a newline)
or fill the disk (a megabyte pod name, a flood of bad messages). Counts are kept elsewhere,
exactly; these only bound what is written. On a terminal, peer text is escaped too
(``terminal_safe``; ``one_line`` where it must stay one line)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

SHOWN_MAX = 64
LINE_MAX = 400


def shown(text: str, limit: int = SHOWN_MAX) -> str:
    """``text`` fit for one log line: quoted, at most ``limit`` characters of it, everything
    but printable ASCII escaped (``\\n``, ``\\x1b``, ``\\u202e``); a longer one says its length."""
    head = ascii(text[:limit])
    return head if len(text) <= limit else f"{head}... ({len(text)} characters)"


def terminal_safe(text: str) -> str:
    """``text`` fit for a terminal: every character that is not printable (control characters
    but newline and tab, DEL, the C1 range, bidi overrides and other format characters)
    escaped as ``\\x1b``, ``\\u202e``: a peer's string (a traceback line, a check's result)
    cannot move the cursor, clear the screen, set the title or reorder what is shown."""
    return _escaped(text, keep="\n\t")


def one_line(text: str, limit: int = LINE_MAX) -> str:
    """``text`` fit for one line of a terminal or a log, unquoted: as ``terminal_safe``, with
    newlines and tabs escaped too, so a peer's reason (a master's refusal) cannot forge the
    next line; at most ``limit`` characters of it (a longer one says its length)."""
    head = _escaped(text[:limit], keep="")
    return head if len(text) <= limit else f"{head}... ({len(text)} characters)"


def _escaped(text: str, keep: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else ascii(c)[1:-1] for c in text)


class RateLimitedLog:
    """At most one warning per ``every_s`` (the first at once); a line after suppressed ones
    says how many were left out."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self.suppressed = 0
        self._last: float | None = None

    def warning(self, fmt: str, *args: object) -> bool:
        """Log it unless one was logged less than ``every_s`` ago; True when logged."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self.suppressed += 1
            return False
        left_out, self.suppressed, self._last = self.suppressed, 0, now
        if left_out:
            fmt += " (and %d more like it since the last such line)"
            args = (*args, left_out)
        self.logger.warning(fmt, *args)
        return True
