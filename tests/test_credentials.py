"""Scoped credentials: a worker of job A cannot touch job B; forged, expired and wrongly
bootstrapped credentials get nothing. Real nats-server in operator mode, real gRPC."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.errors import Error as NatsError

from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_auth import Authority, UserCreds, decode_claims
from aegis.adapters.nats_bus import NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.wire.tokens import pod_token
from tests.waits import async_wait_until


async def _connect(server: EmbeddedNats, creds: UserCreds, errors: list[str]) -> NatsBus:
    return await NatsBus.connect(
        server.url,
        creds,
        on_error=lambda exc: errors.append(str(exc)),
        max_reconnect_attempts=0,
        connect_timeout_s=2,
    )


async def test_worker_of_job_a_cannot_publish_or_subscribe_to_job_b(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    master = await NatsBus.connect(nats_server.url, authority.master_creds())
    seen_b: list[bytes] = []

    async def on_b(subject: str, payload: bytes) -> None:
        seen_b.append(payload)

    await master.subscribe("aegis.default.job-b.>", on_b)
    await master.flush()
    errors: list[str] = []
    worker = await _connect(
        nats_server, authority.worker_creds("default", "job-a", "a-0", 60), errors
    )
    seen_own: list[bytes] = []

    async def on_own(subject: str, payload: bytes) -> None:
        seen_own.append(payload)

    await worker.subscribe("aegis.default.job-a.master", on_own)
    await worker.subscribe("aegis.default.job-b.master", on_own)  # refused by the server
    await worker.publish("aegis.default.job-b.worker.a-0", b"intrusion")  # refused
    await worker.publish("aegis.default.job-a.worker.a-0", b"mine")
    await worker.flush()
    await master.publish("aegis.default.job-b.master", b"secret order of job b")
    await master.publish("aegis.default.job-a.master", b"order of job a")
    await master.flush()
    await async_wait_until(lambda: seen_own == [b"order of job a"], what="own order")
    await async_wait_until(
        lambda: sum("permissions violation" in e for e in errors) >= 2, what="two refusals"
    )
    assert any("subscription" in e and "job-b" in e for e in errors)
    assert any("publish" in e and "job-b" in e for e in errors)
    # The master sees job b's traffic; the worker's intrusion never reached it, and the worker
    # never received job b's order although it asked to subscribe.
    await async_wait_until(lambda: b"secret order of job b" in seen_b, what="job b's order")
    assert b"intrusion" not in seen_b
    assert b"secret order of job b" not in seen_own
    await worker.close()
    await master.close()


async def test_worker_cannot_use_jetstream(nats_server: EmbeddedNats, authority: Authority) -> None:
    errors: list[str] = []
    worker = await _connect(
        nats_server, authority.worker_creds("default", "job-a", "a-0", 60), errors
    )
    with pytest.raises(Exception):  # noqa: B017 (nats-py raises a timeout or a permission error)
        await worker.client.jetstream().key_value("aegis-jobs")
    await worker.close()


async def test_forged_credentials_cannot_connect(nats_server: EmbeddedNats) -> None:
    rogue = Authority()  # same shape, different keys: the server does not trust its account
    with pytest.raises((NatsError, OSError, TimeoutError)):
        await nats.connect(
            nats_server.url,
            user_jwt_cb=rogue.worker_creds("default", "job-a", "a-0", 60).jwt_bytes,
            signature_cb=rogue.worker_creds("default", "job-a", "a-0", 60).sign_nonce,
            max_reconnect_attempts=0,
            connect_timeout=2,
            allow_reconnect=False,
        )


async def test_expired_credentials_cannot_connect(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    expired = authority.worker_creds("default", "job-a", "a-0", ttl_s=-10)
    assert decode_claims(expired.jwt)["exp"] < time.time()
    with pytest.raises((NatsError, OSError, TimeoutError)):
        await nats.connect(
            nats_server.url,
            user_jwt_cb=expired.jwt_bytes,
            signature_cb=expired.sign_nonce,
            max_reconnect_attempts=0,
            connect_timeout=2,
            allow_reconnect=False,
        )


@pytest.fixture
async def creds_server(nats_server: EmbeddedNats, authority: Authority) -> AsyncIterator[int]:
    access = grpc_creds.JobAccess("default", "job-a", "s3cret", ("job-a-0", "job-a-1"),
                                  creation="0a1b2c3d")  # fmt: skip
    server, port = await grpc_creds.serve(
        authority, nats_server.url, lambda ns, job: access if job == "job-a" else None
    )
    yield port
    await server.stop(grace=None)


async def test_wrong_bootstrap_token_is_refused(creds_server: int) -> None:
    with pytest.raises(grpc_creds.CredsRefusedError) as refused:
        await grpc_creds.fetch(
            f"127.0.0.1:{creds_server}",
            namespace="default",
            job="job-a",
            pod="job-a-0",
            token="guess",
            timeout_s=5,
        )
    assert refused.value.reason == "permission_denied"


async def test_right_token_gets_creds_scoped_to_its_job(
    creds_server: int, nats_server: EmbeddedNats
) -> None:
    got = await grpc_creds.fetch(
        f"127.0.0.1:{creds_server}",
        namespace="default",
        job="job-a",
        pod="job-a-1",
        token=pod_token("s3cret", "default", "job-a", "job-a-1"),
        timeout_s=5,
    )
    claims = decode_claims(got.creds.jwt)
    # least privilege (issue 20): reports out, orders and replies in, nothing else
    assert claims["nats"]["pub"]["allow"] == ["aegis.default.job-a.0a1b2c3d.worker.job-a-1"]
    assert claims["nats"]["sub"]["allow"] == [
        "aegis.default.job-a.0a1b2c3d.master",
        "_INBOX_default_job-a_job-a-1.>",
    ]
    assert got.subject_prefix == "aegis.default.job-a.0a1b2c3d"  # the job's creation's
    assert got.rank == 1 and got.worker_num == 2 and got.nats_url == nats_server.url
    assert got.creds.inbox_prefix == "_INBOX_default_job-a_job-a-1"
    bus = await NatsBus.connect(got.nats_url, got.creds, max_reconnect_attempts=0)
    await bus.flush()
    await bus.close()


async def test_unknown_pod_or_job_is_refused(creds_server: int) -> None:
    for job, pod in (("job-a", "job-a-9"), ("job-z", "job-z-0")):
        with pytest.raises(grpc_creds.CredsRefusedError):
            await grpc_creds.fetch(
                f"127.0.0.1:{creds_server}",
                namespace="default",
                job=job,
                pod=pod,
                token=pod_token("s3cret", "default", job, pod),
                timeout_s=5,
            )


@pytest.mark.parametrize(
    "creation", ["x.>", "*", "0a1b2c3d.worker", "0A1B2C3D", "0a1b2c3", "0a1b2c3d\n"]
)
def test_a_creation_id_of_another_shape_gets_no_credentials(creation: str) -> None:
    """The id comes from the job's record (a peer's word): one that would widen a pod's
    subjects (a wildcard, another token) is refused, never put in a JWT."""
    with pytest.raises(ValueError, match="not a creation id"):
        Authority().worker_creds("default", "job-a", "job-a-0", 60, creation)
