"""The agent's output pump on real pipes: what the command writes is passed on as it comes (a
progress bar's ``\\r`` update with no newline too, as under plain ``python``), every chunk is
heard (the hang watchdog's "output"), and the observer sees whole lines."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import threading
from collections.abc import AsyncIterator

import pytest

from aegis.agent import pump
from tests.waits import async_wait_until

F_SETPIPE_SZ = 1031  # Linux's fcntl command (Python 3.11's fcntl module does not name it)


class Pipes:
    def __init__(self) -> None:
        self.child_r, self.child_w = os.pipe()  # the command's stderr
        self.sink_r, self.sink_w = os.pipe()  # the agent's stderr
        os.set_blocking(self.sink_r, False)
        for fd in (self.child_w, self.sink_w):  # room for the long line in both
            fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
        self.passed = b""
        self.lines: list[bytes] = []
        self.heard = 0

    def observe(self, stream: str, line: bytes) -> None:
        self.lines.append(line)

    def hear(self) -> None:
        self.heard += 1

    def read_sink(self) -> bytes:
        with contextlib.suppress(BlockingIOError):  # nothing more yet
            self.passed += os.read(self.sink_r, 1 << 20)
        return self.passed


@pytest.fixture
async def pipes() -> AsyncIterator[Pipes]:
    p = Pipes()
    transport, _ = await pump.open_pump(p.child_r, "stderr", p.sink_w, p.observe, p.hear)
    try:
        yield p
    finally:
        transport.close()
        for fd in (p.child_w, p.sink_r, p.sink_w):
            os.close(fd)


async def test_a_progress_bar_without_a_newline_is_passed_on_and_heard_at_once(
    pipes: Pipes,
) -> None:
    os.write(pipes.child_w, b"\rtraining  25%")
    await async_wait_until(lambda: pipes.read_sink() == b"\rtraining  25%", 30, "the bar shown")
    assert pipes.heard == 1 and pipes.lines == []  # heard; no whole line yet
    os.write(pipes.child_w, b"\rtraining  50%")
    await async_wait_until(lambda: pipes.read_sink().endswith(b"50%"), 30, "the bar moved")
    assert pipes.heard == 2 and pipes.lines == []
    os.write(pipes.child_w, b"\ndone\n")
    await async_wait_until(lambda: len(pipes.lines) == 2, 30, "the lines observed")
    assert pipes.lines == [b"\rtraining  25%\rtraining  50%\n", b"done\n"]
    assert pipes.read_sink() == b"\rtraining  25%\rtraining  50%\ndone\n"


async def test_a_line_longer_than_the_limit_is_observed_in_pieces_and_passed_whole(
    pipes: Pipes,
) -> None:
    data = b"x" * (pump.MAX_LINE + 10)
    os.write(pipes.child_w, data)
    await async_wait_until(lambda: len(pipes.read_sink()) == len(data), 30, "all passed on")
    await async_wait_until(lambda: len(pipes.lines) == 1, 30, "the first piece observed")
    os.write(pipes.child_w, b"\n")
    await async_wait_until(lambda: len(pipes.lines) == 2, 30, "the rest observed")
    assert [len(line) for line in pipes.lines] == [pump.MAX_LINE, 11]
    assert pipes.read_sink() == data + b"\n"


async def test_a_stalled_reader_blocks_the_command_not_the_loop_and_loses_nothing(
    pipes: Pipes,
) -> None:
    """Nobody reads the agent's stderr (a log driver fallen behind): the loop goes on observing
    while the sink's thread waits, the pump stops reading once ``HIGH`` bytes wait (the command
    blocks on its writes, as under tini), and once the reader is back every byte arrives in
    order. Before, the loop itself blocked in the write (no signals, no heartbeats)."""
    line = b"y" * 1023 + b"\n"
    data = line * 8192  # 8 MiB: more than the pipes and the waiting bytes hold
    drain_started, drain_now = threading.Event(), threading.Event()
    got = bytearray()

    def command() -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(pipes.child_w, view[: 1 << 16]) :]

    def reader() -> None:
        drain_now.wait(60)  # the old pump never let the test say so: it drains after 60 s
        drain_started.set()
        os.set_blocking(pipes.sink_r, True)
        while len(got) < len(data):
            got.extend(os.read(pipes.sink_r, 1 << 20))

    threads = [threading.Thread(target=command), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    try:
        await async_wait_until(lambda: len(pipes.lines) >= 1536, 120, "1.5 MiB observed")
        assert not drain_started.is_set()  # observed while nobody read the sink
        assert threads[0].is_alive()  # the command is held: 8 MiB cannot fit anywhere
    finally:
        drain_now.set()
        for thread in threads:
            await asyncio.to_thread(thread.join, 120)
    await async_wait_until(lambda: len(pipes.lines) == 8192, 60, "every line observed")
    assert bytes(got) == data
