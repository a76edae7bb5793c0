"""The agent's connection to the master: one gRPC call for credentials, then NATS.

:meth:`Transport.connect` asks the master's replicas for credentials, connects to NATS with them,
subscribes to the job's master subject (each payload goes to ``on_payload``) and calls
``on_connected`` (the link's ACK goes out there). When the credentials expire the server closes
the connection for good: the transport bootstraps again in a named, guarded task, trying until it
works or the link has ended. While the connection is closed :meth:`publish` sends nothing (the
link resends what matters). No message is built here (:mod:`aegis.agent.encode` does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping

from aegis.adapters import lifecycle, nats_auth
from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_bus import BusClosedError, NatsBus
from aegis.agent import link_settings, tasks
from aegis.core.errors import AegisError
from aegis.wire import codec
from aegis.wire import messages as m

log = logging.getLogger(__name__)

POD_IP_ENV = "AEGIS_POD_IP"
RETRY_S = 1.0  # between two bootstraps that found no master
REFUSED_RETRY_S = 5.0  # after a refusal (an ended job, most likely)

Receive = Callable[[bytes], Awaitable[None]]
Connected = Callable[[], Awaitable[None]]


class LinkUnavailableError(AegisError):
    """Neither the master nor NATS answered in time: run independently."""


class Transport:
    def __init__(
        self,
        settings: link_settings.LinkSettings,
        on_payload: Receive,
        on_connected: Connected,
        ended: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.bus: NatsBus | None = None
        self.creds: grpc_creds.WorkerCreds | None = None
        self.verify: Callable[[bytes, str], bool] | None = None  # an order's signature
        self._on_payload = on_payload
        self._on_connected = on_connected
        self._ended = ended
        self._rebootstrapping = False
        self._background = tasks.Background()

    @property
    def connected(self) -> bool:
        """Whether it has connected once (it may be closed now, until bootstrapped again)."""
        return self.bus is not None and self.creds is not None

    async def connect(self) -> None:
        s = self.settings
        try:
            self.creds = await fetch_creds(s)
            self.bus = await NatsBus.connect(
                self.creds.nats_url,
                self.creds.creds,
                name=f"aegis-agent-{s.pod}",
                on_error=self._on_nats_error,
                on_closed=self._on_closed,
                connect_timeout_s=s.connect_timeout_s,
                tls_ca=s.tls_ca,
            )
        except (ConnectionError, OSError, TimeoutError) as exc:
            raise LinkUnavailableError(str(exc)) from exc
        self.verify = nats_auth.order_verifier(self.creds.creds.jwt)
        await self.bus.subscribe(f"{self.creds.subject_prefix}.master", self._on_message)
        await self._on_connected()
        await self.bus.flush()

    async def publish(self, msg: m.Message) -> None:
        """Out on this pod's worker subject; nothing goes while the connection is closed, nor
        once the run that started this agent and led its job is gone (``LinkSettings.parent``:
        a new run of the job's name may lead it now, and take this agent's words as its pod's
        while the agent stops)."""
        if self.bus is None or self.creds is None:
            return
        if lifecycle.parent_gone(self.settings.parent):
            log.debug("not sent, the run that led the job is gone: %s %s", msg.type, msg.id)
            return
        try:
            subject = nats_auth.worker_subject(self.creds.subject_prefix, self.settings.pod)
            await self.bus.publish(subject, codec.encode(msg))
        except BusClosedError:
            log.debug("not sent while disconnected: %s %s", msg.type, msg.id)

    async def close(self) -> None:
        await self._background.close()
        if self.bus is not None:
            with contextlib.suppress(Exception):  # closed already (expired, never reconnected)
                await self.bus.flush()
            await self.bus.close()

    async def _on_message(self, subject: str, payload: bytes) -> None:
        await self._on_payload(payload)

    def _on_nats_error(self, exc: Exception) -> None:
        if "expired" in str(exc).lower():
            self._on_closed()

    def _on_closed(self) -> None:
        """The connection closed for good without our asking (the server closes it when the
        credentials expire): bootstrap again, in the background."""
        if self._rebootstrapping or self._ended():
            return
        self._rebootstrapping = True
        self._background.start(self._rebootstrap(), "rebootstrap")

    async def _rebootstrap(self) -> None:
        """Fetch new credentials and reconnect, trying again until it works."""
        log.warning("the NATS connection closed (credentials expired?): bootstrapping again")
        old = self.bus
        try:
            while not self._ended():
                try:
                    await self.connect()
                    break
                except LinkUnavailableError as exc:
                    log.warning("bootstrapping again failed (%s); trying again in 1 s", exc)
                    await asyncio.sleep(RETRY_S)
                except grpc_creds.CredsRefusedError as exc:  # an ended job, most likely
                    log.warning("bootstrapping again refused (%s); trying again in 5 s", exc)
                    await asyncio.sleep(REFUSED_RETRY_S)
        finally:
            self._rebootstrapping = False
        if old is not None and old is not self.bus:
            await old.close()


async def fetch_creds(s: link_settings.LinkSettings) -> grpc_creds.WorkerCreds:
    """Any master replica hands out credentials: try each address in turn. A refusal looks
    the same whatever its cause (a replica may not know the job yet): the next one is
    asked; a refusal is final when no replica gives credentials. With ``tls_ca`` the call
    speaks TLS, trusting that CA only; a TLS mismatch is a refusal (``TlsRefusedError``)."""
    targets = [t.strip() for t in s.grpc_target.split(",") if t.strip()]
    per_target = s.connect_timeout_s / max(1, len(targets))
    error: Exception = ConnectionError(f"no master address in {s.grpc_target!r}")
    refused: grpc_creds.CredsRefusedError | None = None
    for target in targets:
        try:
            return await grpc_creds.fetch(
                target,
                namespace=s.namespace,
                job=s.job,
                pod=s.pod,
                token=s.token,
                timeout_s=per_target,
                tls_ca=s.tls_ca,
            )
        except (ConnectionError, OSError, TimeoutError) as exc:
            error = exc
        except grpc_creds.CredsRefusedError as exc:
            refused = exc
    raise refused or error


def pod_address(env: Mapping[str, str], master: str) -> str:
    """Where this pod's peers reach it (what its ACK says): ``AEGIS_POD_IP`` where the platform
    knows it (the local platform, a pod's ``status.podIP``), else this host's address on the
    route toward the master (a UDP socket's local address: no packet is sent); "" if neither."""
    given = env.get(POD_IP_ENV, "").strip()
    if given:
        return given
    host, _, port = master.split(",", maxsplit=1)[0].strip().rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host.strip("[]"), int(port)))
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return ""
