"""Pass a child's output through unchanged, as it comes, and show each line to an observer.

Output is passed on chunk by chunk, not held back for its newline: a tqdm bar (``\r`` and no
newline for minutes) or a prompt shows at once, as under plain ``python``; ``heard`` is told of
every chunk (a bar that moves is output, for the hang watchdog), ``observe`` of every line.

What is passed on is written by a thread of the pump's own (``Sink``): a reader that stalls (a
log driver that fell behind, a stopped ``| less``) blocks that thread, never the agent's loop
(its signals, its heartbeats, the other pipe). While more than ``HIGH`` bytes wait, the pump
stops reading the command's pipe, so the command blocks on its writes, as it would writing to
the stalled reader itself (under tini)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import select
import threading
from collections.abc import Callable

MAX_LINE = 64 * 1024  # a longer run without a newline is observed in pieces
HIGH = 1 << 20  # bytes waiting for the sink's thread before the pump stops reading
LOW = 256 << 10  # ... and resumes

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


class Sink:
    """Writes to ``fd`` from a thread of its own, in order. ``put`` returns False once more than
    ``HIGH`` bytes wait; ``resume`` is called (from that thread) when they fell to ``LOW``;
    ``drained`` (from that thread too) once it is closed and all was written."""

    def __init__(self, fd: int, resume: Heard, drained: Heard) -> None:
        self._fd, self._resume, self._drained = fd, resume, drained
        self._chunks: collections.deque[bytes] = collections.deque()
        self._waiting = 0
        self._paused = self._closed = False
        self._cond = threading.Condition()
        threading.Thread(target=self._write, name=f"sink-{fd}", daemon=True).start()

    def put(self, data: bytes) -> bool:
        with self._cond:
            self._chunks.append(data)
            self._waiting += len(data)
            self._paused = self._waiting > HIGH
            self._cond.notify()
            return not self._paused

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._chunks and not self._closed:
                    self._cond.wait()
                if not self._chunks:
                    break
                data = self._chunks.popleft()
            write_all(self._fd, data)
            with self._cond:
                self._waiting -= len(data)
                resume = self._paused and self._waiting <= LOW
                self._paused &= not resume
            if resume:
                self._resume()
        self._drained()


class LinePump(asyncio.Protocol):
    """Reads one pipe; writes what it reads to ``sink_fd``, hands each line to ``observe``."""

    def __init__(
        self, stream: str, sink_fd: int, observe: LineObserver, heard: Heard | None = None
    ) -> None:
        self.stream = stream
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()  # closed, all passed on
        self._sink = Sink(sink_fd, self._from_sink(self._resume), self._from_sink(self._end))
        self._observe = observe
        self._heard = heard
        self._pending = b""
        self._transport: asyncio.ReadTransport | None = None

    def _from_sink(self, call: Heard) -> Heard:
        """``call`` run in the loop, asked from the sink's thread (not at all once it closed)."""

        def threadsafe() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the agent ends
                self._loop.call_soon_threadsafe(call)

        return threadsafe

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.ReadTransport)
        self._transport = transport

    def _resume(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        if not self._sink.put(data) and self._transport is not None:
            self._transport.pause_reading()  # the command blocks, not the agent
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
        self._sink.close()  # ``done`` once what waits was written


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
