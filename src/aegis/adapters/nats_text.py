"""The NATS client's text: the servers a URL names, and an error said once a period.

Pure: no I/O.
"""

from __future__ import annotations

import urllib.parse

NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def server_list(url: str) -> list[str]:
    """``nats://a:1,nats://b:2`` -> both URLs (one server: a list of one). ``ValueError``,
    saying why, for no URL at all (an unset ``$NATS_URL``: nats-py then retried for ever
    without yielding, deaf to Ctrl-C) or one it cannot connect to (another scheme, no host, a
    port out of range)."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise ValueError(f"no NATS server in {url!r} (nats://HOST:PORT, comma-separated)")
    for one in urls:
        try:
            parsed = urllib.parse.urlsplit(one if "://" in one else f"nats://{one}")
            parsed.port  # noqa: B018 (raises for one out of range)
        except ValueError:
            parsed = None
        if parsed is None or parsed.scheme not in NATS_SCHEMES or not parsed.hostname:
            raise ValueError(f"not a NATS server URL: {one!r} (nats://HOST:PORT)")
    return urls


def shown(url: str) -> str:
    """``url`` (one server or several, comma-separated) fit for a message: a user and password
    in it are replaced by ``***``."""
    parts = []
    for one in url.split(","):
        one = one.strip()  # noqa: PLW2901 (the part, as ``server_list`` reads it)
        parsed = urllib.parse.urlsplit(one if "://" in one else f"nats://{one}")
        if "@" in parsed.netloc:
            parsed = parsed._replace(netloc=f"***@{parsed.netloc.rsplit('@', 1)[1]}")
        parts.append(urllib.parse.urlunsplit(parsed))
    return ",".join(parts)


class RepeatGate:
    """Says the first of equal lines, and then one a ``every_s`` with how many it held back: a
    client retrying an unreachable server every 0.25 s logged each failure (240 lines a
    minute). Pure: the caller gives the time."""

    KEPT = 64  # different lines remembered at most (a connection's errors are few)

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._seen: dict[str, tuple[float, int]] = {}  # line -> (when said, held back since)

    def say(self, line: str, now: float) -> str | None:
        """The line to log now (None: hold it back)."""
        seen = self._seen.get(line)
        if seen is not None and now - seen[0] < self.every_s:
            self._seen[line] = (seen[0], seen[1] + 1)
            return None
        if seen is None and len(self._seen) >= self.KEPT:
            self._seen.clear()
        self._seen[line] = (now, 0)
        if seen is None or seen[1] == 0:
            return line
        return f"{line} (and {seen[1]} more times in the last {now - seen[0]:.0f} s)"
