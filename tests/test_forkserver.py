"""The one forkserver (:mod:`aegis.forking`) and its one client (:mod:`aegis.spawn.forkclient`),
on a server with nothing to preload (``tests/bin/tiny_forkserver.py``), started through the
agent's reaper: what the zygote (a nanny, one child each) and the checks' forkserver (child after
child) both rely on."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import psutil
import pytest

from aegis.agent import reaper
from aegis.spawn import forkclient
from tests import agent_waits as waits
from tests import forkserver_harness as harness
from tests.waits import async_wait_until

the_reaper, subreaper = harness.the_reaper, harness.subreaper  # fixtures

TINY = str(waits.BIN / "tiny_forkserver.py")


def servers(
    spawner: reaper.Reaper,
    *options: str,
    nanny: bool = False,
    on_failed: Callable[[Mapping[str, Any]], None] | None = None,
    **settings: Any,
) -> forkclient.ForkServers:
    command = [sys.executable, TINY, "--nanny", "1" if nanny else "0", *options]
    chosen = forkclient.ServerSettings(name="tiny server", nanny=nanny, **settings)
    env = harness.with_path()
    return forkclient.ForkServers(spawner, lambda: command, env, chosen, on_failed=on_failed)


@pytest.fixture
async def pipe() -> AsyncIterator[tuple[int, int]]:
    """A child's stdout: (read end, write end); what it printed is read after it ended."""
    read, write = os.pipe()
    yield read, write
    for fd in (read, write):
        with contextlib.suppress(OSError):  # closed already
            os.close(fd)


async def fork(
    pool: forkclient.ForkServers, pipe: tuple[int, int], request: Mapping[str, Any]
) -> forkclient.Forked | None:
    return await pool.fork(request, [pipe[1], pipe[1]])


def printed(pipe: tuple[int, int]) -> dict[str, Any]:
    """The child's CHILD line (read once it has ended: the write end is closed here first)."""
    os.close(pipe[1])
    text = b""
    while chunk := os.read(pipe[0], 65536):
        text += chunk
    [line] = [x for x in text.decode().splitlines() if x.startswith("CHILD ")]
    seen: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    return seen


@pytest.mark.parametrize("nanny", [False, True])
async def test_forked_child_leads_its_group_with_clean_signals_when_served(
    the_reaper: reaper.Reaper, pipe: tuple[int, int], nanny: bool
) -> None:
    pool = servers(the_reaper, nanny=nanny)
    try:
        server = (pool.prepare(), await pool.ready())[1]
        assert server is not None and server.info["preloaded"] == "nothing"
        assert server.info["threads"] == 1 and server.info["cuda"] is False
        assert psutil.Process(server.pid).name() == "tiny-server"
        child = await fork(pool, pipe, {"exit": 7})
        assert child is not None
        assert os.waitstatus_to_exitcode(await child.status) == 7
    finally:
        await pool.close()
    seen = printed(pipe)
    assert seen["pid"] == seen["pgid"] == child.pid and seen["ppid"] == server.pid
    assert seen["comm"] == "tiny-child" and seen["sigint"] and seen["blocked"] == []
    assert pool.made == 1


async def test_server_serves_child_after_child_when_not_a_nanny(
    the_reaper: reaper.Reaper, pipe: tuple[int, int]
) -> None:
    pool = servers(the_reaper)
    try:
        statuses = []
        for code in (0, 3):
            child = await fork(pool, pipe, {"exit": code})
            assert child is not None
            statuses.append(os.waitstatus_to_exitcode(await child.status))
        server = await pool.ready()
        assert server is not None and psutil.Process(server.pid).children() == []
    finally:
        await pool.close()
    assert statuses == [0, 3] and pool.made == 1
    assert waits.really_gone(server.pid)  # closing ends it


async def test_a_request_longer_than_one_read_still_forks_with_its_descriptors(
    the_reaper: reaper.Reaper, pipe: tuple[int, int]
) -> None:
    """A job's environment over 64 KiB (a Kubernetes namespace's service links): the stdout
    and stderr descriptors ride on the request's first piece; they were closed, the fork
    refused, and after three refusals every start was cold."""
    pool = servers(the_reaper)
    try:
        links = {f"SVC_{i:04d}_SERVICE_HOST": f"10.96.{i // 256}.{i % 256}" for i in range(3000)}
        child = await fork(pool, pipe, {"exit": 5, "env": links})
        assert child is not None  # forked, not refused
        assert os.waitstatus_to_exitcode(await child.status) == 5
    finally:
        await pool.close()
    assert printed(pipe)["pid"] == child.pid


async def test_nanny_waits_for_its_one_child_and_next_server_is_made_when_asked(
    the_reaper: reaper.Reaper, pipe: tuple[int, int]
) -> None:
    pool = servers(the_reaper, nanny=True)
    try:
        child = await fork(pool, pipe, {"pause": True})
        assert child is not None
        nanny = psutil.Process(child.pid).ppid()
        assert psutil.Process(nanny).name() == "aegis-nanny"
        assert pool.made == 1 and await pool.ready() is None  # none made until asked
        os.kill(child.pid, signal.SIGTERM)
        raw = await child.status
        assert os.WIFSIGNALED(raw) and os.WTERMSIG(raw) == signal.SIGTERM
        await async_wait_until(lambda: waits.really_gone(nanny), what="the nanny reaped")
        pool.prepare()
        assert await pool.ready() is not None and pool.made == 2
    finally:
        await pool.close()


@pytest.mark.parametrize("nanny", [False, True])
async def test_child_dies_with_its_server_when_server_is_killed(
    the_reaper: reaper.Reaper, pipe: tuple[int, int], subreaper: None, nanny: bool
) -> None:
    pool = servers(the_reaper, nanny=nanny)
    try:
        child = await fork(pool, pipe, {"pause": True})
        assert child is not None
        os.kill(psutil.Process(child.pid).ppid(), signal.SIGKILL)
        assert await child.status == signal.SIGKILL  # a SIGKILL death: never an unknown end
        await async_wait_until(lambda: waits.gone(child.pid), what="the child gone")
    finally:
        await pool.close()


async def test_idle_server_is_replaced_when_it_dies(the_reaper: reaper.Reaper) -> None:
    pool = servers(the_reaper)
    try:
        pool.prepare()
        first = await pool.ready()
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        await async_wait_until(lambda: pool.made == 2, what="a second server")
        second = await pool.ready()
        assert second is not None and second.pid != first.pid and pool.failures == 0
    finally:
        await pool.close()
    assert waits.really_gone(first.pid) and waits.really_gone(second.pid)


async def test_failing_servers_are_given_up_after_max_failures_when_each_fails(
    the_reaper: reaper.Reaper, pipe: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    heard: list[Mapping[str, Any]] = []
    pool = servers(the_reaper, "--fail", "no torch", max_failures=2, on_failed=heard.append)
    caplog.set_level(logging.WARNING)
    try:
        assert await fork(pool, pipe, {"exit": 0}) is None
        assert pool.disabled and pool.made == 2 and await pool.ready() is None
    finally:
        await pool.close()
    assert [h["reason"] for h in heard] == ["no torch", "no torch"]
    assert "cold starts from now on" in caplog.text


async def test_server_that_starts_a_thread_never_serves(the_reaper: reaper.Reaper) -> None:
    pool = servers(the_reaper, "--thread", "1", max_failures=1)
    try:
        pool.prepare()
        assert await pool.ready() is None and pool.disabled
    finally:
        await pool.close()


async def test_no_server_is_tried_again_when_interpreter_cannot_start(
    the_reaper: reaper.Reaper, pipe: tuple[int, int]
) -> None:
    settings = forkclient.ServerSettings(name="tiny server")
    pool = forkclient.ForkServers(the_reaper, lambda: ["/nonexistent/python"], os.environ, settings)
    try:
        assert await fork(pool, pipe, {"exit": 0}) is None
        assert pool.disabled and pool.made == 0
    finally:
        await pool.close()


async def test_fork_gives_up_when_previous_child_has_not_ended(
    the_reaper: reaper.Reaper, pipe: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    pool = servers(the_reaper, fork_timeout_s=0.2)
    try:
        first = await fork(pool, pipe, {"pause": True})
        assert first is not None and not pool.ready_now
        assert await fork(pool, pipe, {"exit": 0}) is None  # one child at a time
        assert "the previous child has not ended" in caplog.text
        os.kill(first.pid, signal.SIGKILL)
        await first.status
        await async_wait_until(lambda: pool.ready_now, what="the server free again")
        second = await fork(pool, pipe, {"exit": 0})
        assert second is not None and os.waitstatus_to_exitcode(await second.status) == 0
    finally:
        await pool.close()
    assert pool.made == 1
