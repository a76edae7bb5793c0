"""The embedded nats-server: healthy on free ports, and gone when its parent dies."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil
import pytest

from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats, NatsServerError, may_restart, owner_line
from tests.waits import async_wait_until, wait_until

STARTER = """
import sys
from aegis.adapters.nats_server import EmbeddedNats
server = EmbeddedNats()
server.start()
print(server.process.pid, server.port, flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
def test_server_dies_with_a_crashed_parent(tmp_path: Path) -> None:
    """(A crashed parent leaves the server's directory: in the test's own temporary one.)"""
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert parent.stdout is not None
    pid, _port = (int(x) for x in parent.stdout.readline().split())
    server = psutil.Process(pid)
    assert "nats-server" in " ".join(server.cmdline())
    parent.send_signal(signal.SIGKILL)  # aegis run crashing: no cleanup code runs
    parent.wait()
    wait_until(lambda: not server.is_running() or server.status() == "zombie", what="server gone")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
def test_the_directory_a_killed_parent_left_goes_when_the_next_server_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILLed ``aegis run`` cannot remove its server's directory (its keys' config, its
    JetStream store with the job's record); the next embedded server made on the host does,
    and only the directories whose owner is gone. Before, they stayed in /tmp for good."""
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert parent.stdout is not None
    server = psutil.Process(int(parent.stdout.readline().split()[0]))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_until(lambda: not server.is_running() or server.status() == "zombie", what="server gone")
    left = list(tmp_path.glob("aegis-nats-*"))
    assert len(left) == 1 and (left[0] / "nats.conf").is_file()
    alive = tmp_path / "aegis-nats-alive"  # a live owner's (this test's)
    alive.mkdir()
    (alive / "owner").write_text(owner_line(os.getpid()))
    unowned = tmp_path / "aegis-nats-unowned"  # no owner file: not judged
    unowned.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = EmbeddedNats()
    try:
        assert not left[0].exists() and alive.is_dir() and unowned.is_dir()
        assert (made.dir / "owner").read_text() == owner_line(os.getpid())
    finally:
        made.stop()
    assert not made.dir.exists()


def _varz(server: EmbeddedNats) -> dict[str, object]:
    url = f"http://127.0.0.1:{server.monitor_port}/varz"
    with urllib.request.urlopen(url, timeout=5) as response:
        body: dict[str, object] = json.loads(response.read())
    return body


def test_a_server_that_does_not_start_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its directory holds the operator's keys: a failed start removed nothing, for a caller
    that did not stop it (one that raised before its clean-up was set)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = EmbeddedNats(extra_config="no_such_option: {\n")  # a config it refuses
    with pytest.raises(NatsServerError, match="exited early"):
        server.start(timeout_s=30)
    assert list(tmp_path.iterdir()) == [] and server.process is None


def test_server_listens_on_loopback_by_default() -> None:
    with EmbeddedNats() as server:
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert _varz(server)["host"] == "127.0.0.1"


def test_listen_host_is_configurable_for_a_master_in_a_pod() -> None:
    with EmbeddedNats(host="0.0.0.0") as server:
        assert _varz(server)["host"] == "0.0.0.0"  # every address of the pod
        assert server.url == f"nats://127.0.0.1:{server.port}"  # and reachable on loopback
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            assert sock.recv(4).startswith(b"INFO")


def test_a_server_that_keeps_crashing_is_restarted_only_so_often() -> None:
    assert may_restart([], 100.0, limit=2, window_s=60.0)
    assert may_restart([10.0, 20.0], 100.0, limit=2, window_s=60.0)  # both long ago
    assert not may_restart([50.0, 90.0], 100.0, limit=2, window_s=60.0)
    assert may_restart([30.0, 90.0], 100.0, limit=2, window_s=60.0)


async def test_a_killed_server_starts_again_and_its_clients_find_their_buckets() -> None:
    """A crash of the embedded server (SIGKILL: an OOM kill) no longer ends the run: it starts
    again on the same port and store, the client reconnects to the URL it has, the status
    bucket holds what it held, and messages flow again."""
    server = EmbeddedNats()
    await asyncio.to_thread(server.start)
    keeping = asyncio.create_task(server.keep_running(watch_s=0.05))
    bus = await NatsBus.connect(server.url, name="client")
    try:
        store = await KvStore.open(bus, "status", retry_s=60.0)
        revision = await store.put("job", b"running", expected_revision=None)
        first = server.process
        assert first is not None
        first.kill()  # nobody waits for it here: keep_running sees it exit
        await async_wait_until(lambda: server.process is not first, 30, "the server started again")
        await async_wait_until(lambda: bus.client.is_connected, 30, "the client reconnected")
        assert await store.get("job") == (b"running", revision)  # the file store kept it
        assert await store.put("job", b"done", expected_revision=revision) > revision
        heard: list[bytes] = []

        async def on_message(subject: str, payload: bytes) -> None:
            heard.append(payload)

        await bus.subscribe("hello", on_message)
        await bus.flush()
        await bus.publish("hello", b"again")
        await async_wait_until(lambda: heard == [b"again"], 30, "a message after the restart")
        assert not keeping.done()
    finally:
        keeping.cancel()
        await bus.close()
        await asyncio.to_thread(server.stop)
    assert server.process is None


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (``T`` in its ``stat``)."""
    tasks = Path(f"/proc/{pid}/task")
    states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
    return all(state == "T" for state in states)


async def test_a_flush_that_times_out_on_a_hung_server_leaves_the_connection_working() -> None:
    """nats-py's own flush cancelled its PONG's future on a timeout; the late PONG ended the
    connection's read loop for good (nothing heard again, no reconnect). ``NatsBus.flush``
    leaves the future to the PONG."""
    server = EmbeddedNats()
    await asyncio.to_thread(server.start)
    bus = await NatsBus.connect(server.url, name="client")
    heard: list[bytes] = []

    async def on_message(subject: str, payload: bytes) -> None:
        heard.append(payload)

    try:
        await bus.subscribe("hello", on_message)
        await bus.flush()
        assert server.process is not None
        server.process.send_signal(signal.SIGSTOP)  # hung: the connection stays open
        pid = server.process.pid
        try:  # the stop takes effect once every thread is stopped (after a disk write, say)
            await async_wait_until(lambda: _all_stopped(pid), 30, "the server stopped")
            with pytest.raises(TimeoutError):
                await bus.flush(timeout_s=0.3)
            assert bus.connected
        finally:
            server.process.send_signal(signal.SIGCONT)
        await bus.flush()  # the late PONG, then this one
        await bus.publish("hello", b"still heard")
        await async_wait_until(lambda: heard == [b"still heard"], 30, "a message after the hang")
    finally:
        await bus.close()
        await asyncio.to_thread(server.stop)
