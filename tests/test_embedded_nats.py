"""The embedded nats-server: healthy on free ports, and gone when its parent dies."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import psutil
import pytest

from aegis.adapters.nats_server import EmbeddedNats
from tests.waits import wait_until

STARTER = """
import sys
from aegis.adapters.nats_server import EmbeddedNats
server = EmbeddedNats()
server.start()
print(server.process.pid, server.port, flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
def test_server_dies_with_a_crashed_parent() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    pid, _port = (int(x) for x in parent.stdout.readline().split())
    server = psutil.Process(pid)
    assert "nats-server" in " ".join(server.cmdline())
    parent.send_signal(signal.SIGKILL)  # aegis run crashing: no cleanup code runs
    parent.wait()
    wait_until(lambda: not server.is_running() or server.status() == "zombie", what="server gone")


def _varz(server: EmbeddedNats) -> dict[str, object]:
    url = f"http://127.0.0.1:{server.monitor_port}/varz"
    with urllib.request.urlopen(url, timeout=5) as response:
        body: dict[str, object] = json.loads(response.read())
    return body


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
