"""``SyncWorkerCreds``: the master's gRPC server and the agent's client (one call per agent).

Every refusal looks the same from outside (one status, one message): an unknown job or pod, a
name outside the rule, an ended job and a wrong bootstrap token, so no one learns which jobs
exist by asking. The master's log says which it was, the peer's strings truncated and escaped,
at a bounded rate.

With ``tls_dir`` (a ``tls.TlsDir``) the server speaks TLS only; an agent given ``tls_ca`` trusts
that CA only. A handshake that fails for a TLS reason (no CA given to a TLS server, a certificate
the CA did not sign, a plain server) is ``TlsRefusedError``, one line saying which.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

from aegis.adapters import tls
from aegis.adapters.grpc._generated import aegis_pb2, aegis_pb2_grpc
from aegis.adapters.nats_auth import Authority, UserCreds, job_subject_prefix
from aegis.core.errors import RemoteError
from aegis.core.model import POD_NAME_MAX, name_problem
from aegis.wire.logsafe import RateLimitedLog, shown
from aegis.wire.tokens import pod_token

log = logging.getLogger(__name__)

REFUSED = "credentials refused: no such job or pod, an ended job, or a wrong bootstrap token"
MAX_REQUEST_BYTES = 64 * 1024
_NO_TOKEN = "\0no job\0"  # compared when there is no job, so a refusal takes as long


class CredsRefusedError(RemoteError):
    """The master refused to hand out credentials (wrong token, unknown job or pod)."""


class TlsRefusedError(CredsRefusedError):
    """No TLS session with the master: its certificate is not trusted, or one side speaks
    TLS and the other does not."""


@dataclass(frozen=True, slots=True)
class JobAccess:
    """What the master knows of a job for the handshake."""

    namespace: str
    job: str
    token: str  # the job's secret: each pod's is derived from it (``wire.tokens.pod_token``)
    pods: tuple[str, ...]
    ended: bool = False  # a job in a terminal phase gets no more credentials
    creation: str = ""  # the id of the job's creation, in its subjects (``job_subject_prefix``)


Lookup = Callable[[str, str], "JobAccess | Awaitable[JobAccess | None] | None"]


@dataclass(frozen=True, slots=True)
class WorkerCreds:
    nats_url: str
    creds: UserCreds
    subject_prefix: str
    worker_num: int
    rank: int


class _Servicer(aegis_pb2_grpc.CredentialsServicer):
    def __init__(
        self,
        authority: Authority | None,
        nats_url: str,
        lookup: Lookup,
        ttl_s: float | None,
    ) -> None:
        self.authority, self.nats_url, self.lookup, self.ttl_s = authority, nats_url, lookup, ttl_s
        self.refusals = RateLimitedLog(log, every_s=10.0)

    async def SyncWorkerCreds(
        self, request: aegis_pb2.SyncWorkerCredsRequest, context: aio.ServicerContext
    ) -> aegis_pb2.SyncWorkerCredsResponse:
        access = await self._access(request)
        if access is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, REFUSED)
        assert access is not None
        if self.authority is None:  # a server without auth: nothing to hand out
            creds = UserCreds(jwt="", seed=b"", inbox_prefix="_INBOX", expires_at=None)
        else:
            creds = self.authority.worker_creds(
                request.namespace, request.job, request.pod, self.ttl_s, access.creation
            )
        return aegis_pb2.SyncWorkerCredsResponse(
            nats_url=self.nats_url,
            user_jwt=creds.jwt,
            user_seed=creds.seed,
            inbox_prefix=creds.inbox_prefix,
            subject_prefix=job_subject_prefix(request.namespace, request.job, access.creation),
            expires_at=creds.expires_at or 0.0,
            worker_num=len(access.pods),
            rank=access.pods.index(request.pod),
        )

    async def _access(self, request: aegis_pb2.SyncWorkerCredsRequest) -> JobAccess | None:
        """The job, when the request may have its credentials; None (logged) when not."""
        namespace, job, pod = request.namespace, request.job, request.pod
        problem = (
            name_problem("namespace", namespace)
            or name_problem("job", job)
            or name_problem("pod", pod, POD_NAME_MAX)
        )
        access = None
        if problem is None:
            found = self.lookup(namespace, job)
            access = await found if inspect.isawaitable(found) else found
        # the pod's own secret, derived from the job's: the job's secret itself is refused
        expected = pod_token(access.token if access else _NO_TOKEN, namespace, job, pod)
        right = hmac.compare_digest(expected.encode(), request.bootstrap_token.encode())
        if problem is None and access is None:
            problem = "no such job"
        elif access is not None and not right:
            problem = "wrong bootstrap token"
        elif access is not None and pod not in access.pods:
            problem = "no such pod"
        elif access is not None and access.ended:
            problem = "the job has ended"
        if problem is None:
            return access
        self.refusals.warning("refused credentials to %s/%s pod %s: %s", shown(namespace),
                              shown(job), shown(pod), problem)  # fmt: skip
        return None


async def serve(
    authority: Authority | None,
    nats_url: str,
    lookup: Lookup,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ttl_s: float | None = 3600.0,
    tls_dir: tls.TlsDir | None = None,
) -> tuple[aio.Server, int]:
    """Start the credentials server; returns it and the port it listens on (TLS only with
    ``tls_dir``)."""
    # a request is four short strings: anything near a megabyte is an attack on the log
    server = aio.server(options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    aegis_pb2_grpc.add_CredentialsServicer_to_server(
        _Servicer(authority, nats_url, lookup, ttl_s), server
    )
    address = f"{host}:{port}"
    if tls_dir is None:
        bound = server.add_insecure_port(address)
    else:
        credentials = grpc.ssl_server_credentials([tls_dir.check().key_pair()])
        bound = server.add_secure_port(address, credentials)
    await server.start()
    return server, bound


def _channel(target: str, tls_ca: Path | None) -> aio.Channel:
    if tls_ca is None:
        return aio.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
    return aio.secure_channel(target, credentials)


async def fetch(
    target: str,
    *,
    namespace: str,
    job: str,
    pod: str,
    token: str,
    timeout_s: float,
    tls_ca: Path | None = None,
) -> WorkerCreds:
    """The agent's one call. Raises ``CredsRefusedError`` on refusal (``TlsRefusedError`` when
    TLS is the trouble), ``ConnectionError`` when the master cannot be reached in time."""
    async with _channel(target, tls_ca) as channel:
        stub = aegis_pb2_grpc.CredentialsStub(channel)
        request = aegis_pb2.SyncWorkerCredsRequest(
            job=job, namespace=namespace, pod=pod, bootstrap_token=token
        )
        try:
            reply = await stub.SyncWorkerCreds(request, timeout=timeout_s, wait_for_ready=True)
        except aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND):
                raise CredsRefusedError(
                    exc.code().name.lower(), detail=exc.details() or ""
                ) from None
            why = await asyncio.to_thread(tls.diagnose, target, tls_ca, min(timeout_s, 5.0))
            if why is not None:
                raise TlsRefusedError("no TLS session with the master", detail=why) from None
            raise ConnectionError(f"master at {target}: {exc.code().name}") from None
    creds = UserCreds(
        jwt=reply.user_jwt,
        seed=reply.user_seed,
        inbox_prefix=reply.inbox_prefix,
        expires_at=reply.expires_at or None,
    )
    return WorkerCreds(reply.nats_url, creds, reply.subject_prefix, reply.worker_num, reply.rank)
