"""Pass a child's output through unchanged, as it comes, and show each line to an observer.

Output is passed on chunk by chunk, not held back for its newline: a tqdm bar (``\r`` and no
newline for minutes) or a prompt shows at once, as under plain ``python``; ``heard`` is told of
every chunk (a bar that moves is output, for the hang watchdog), ``observe`` of every line."""

from __future__ import annotations

import asyncio
import os
import select
from collections.abc import Callable

MAX_LINE = 64 * 1024  # a longer run without a newline is passed on in pieces

LineObserver = Callable[[str, bytes], None]
Heard = Callable[[], None]


def write_all(fd: int, data: bytes) -> None:
    """Write everything, waiting when the descriptor is non-blocking and full."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select.select([], [fd], [])
        except BrokenPipeError:
            return  # nobody reads our output any more: keep supervising regardless


class LinePump(asyncio.Protocol):
    """Reads one pipe; writes what it reads to ``sink_fd``, hands each line to ``observe``."""

    def __init__(
        self, stream: str, sink_fd: int, observe: LineObserver, heard: Heard | None = None
    ) -> None:
        self.stream = stream
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sink_fd = sink_fd
        self._observe = observe
        self._heard = heard
        self._pending = b""

    def data_received(self, data: bytes) -> None:
        write_all(self._sink_fd, data)
        if self._heard is not None:
            self._heard()
        pending = self._pending + data
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            self._observe(self.stream, pending[start : end + 1])
            start = end + 1
        pending = pending[start:]
        while len(pending) >= MAX_LINE:
            self._observe(self.stream, pending[:MAX_LINE])
            pending = pending[MAX_LINE:]
        self._pending = pending

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._pending:
            self._observe(self.stream, self._pending)
            self._pending = b""
        if not self.done.done():
            self.done.set_result(None)


async def open_pump(
    read_fd: int, stream: str, sink_fd: int, observe: LineObserver, heard: Heard | None = None
) -> tuple[asyncio.ReadTransport, LinePump]:
    """Start pumping ``read_fd`` (which the transport then owns and closes)."""
    loop = asyncio.get_running_loop()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    transport, protocol = await loop.connect_read_pipe(
        lambda: LinePump(stream, sink_fd, observe, heard), pipe
    )
    return transport, protocol
