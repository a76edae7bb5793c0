"""Pass a child's output through unchanged, line by line, and show each line to an observer."""

from __future__ import annotations

import asyncio
import os
import select
from collections.abc import Callable

MAX_LINE = 64 * 1024  # a longer run without a newline is passed on in pieces

LineObserver = Callable[[str, bytes], None]


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
    """Reads one pipe; writes each line to ``sink_fd`` and hands it to ``observe``."""

    def __init__(self, stream: str, sink_fd: int, observe: LineObserver) -> None:
        self.stream = stream
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sink_fd = sink_fd
        self._observe = observe
        self._pending = b""

    def data_received(self, data: bytes) -> None:
        pending = self._pending + data
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            self._emit(pending[start : end + 1])
            start = end + 1
        pending = pending[start:]
        while len(pending) >= MAX_LINE:
            self._emit(pending[:MAX_LINE])
            pending = pending[MAX_LINE:]
        self._pending = pending

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._pending:
            self._emit(self._pending)
            self._pending = b""
        if not self.done.done():
            self.done.set_result(None)

    def _emit(self, line: bytes) -> None:
        write_all(self._sink_fd, line)
        self._observe(self.stream, line)


async def open_pump(
    read_fd: int, stream: str, sink_fd: int, observe: LineObserver
) -> tuple[asyncio.ReadTransport, LinePump]:
    """Start pumping ``read_fd`` (which the transport then owns and closes)."""
    loop = asyncio.get_running_loop()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    transport, protocol = await loop.connect_read_pipe(
        lambda: LinePump(stream, sink_fd, observe), pipe
    )
    return transport, protocol
