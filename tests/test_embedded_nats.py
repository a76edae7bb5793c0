"""The embedded nats-server: healthy on free ports, and gone when its parent dies."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from tests.agent_waits import wait_until

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
