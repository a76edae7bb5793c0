"""TLS where the pods are not on loopback: the credentials server (gRPC) and NATS, certificates
from files named as a Kubernetes TLS Secret holds them, a self-signed CA made with openssl.

A real ``aegis master --tls-dir`` on a TLS nats-server in operator mode; a real ``aegis agent
--tls-ca`` that trusts the CA gets credentials and runs the job to its end; an agent without the
CA, or trusting another CA, is refused in one line and never runs the command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aegis.adapters import tls
from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.model import JobSpec
from aegis.core.phases import Phase
from aegis.master.ports import NullPlatform
from aegis.master.service import STATUS_BUCKET
from aegis.platforms.served_job import ServedJob
from aegis.spawn.ports import free_port
from aegis.wire.tokens import pod_token
from tests.tls_helpers import issue, make_ca
from tests.waits import async_wait_until

pytestmark = pytest.mark.timeout(240)

AEGIS = [sys.executable, "-m", "aegis"]
TOKEN = "tls-bootstrap-token"


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA that signed both servers' certificates (its ca.crt)
    master: tls.TlsDir
    nats: tls.TlsDir
    stranger_ca: Path  # a CA that signed neither


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = make_ca(tmp_path / "pki")
    other = make_ca(tmp_path / "pki", "stranger-ca")
    return Pki(
        ca=ca / "ca.crt",
        master=tls.TlsDir(issue(ca, tmp_path / "pki" / "master")),
        nats=tls.TlsDir(issue(ca, tmp_path / "pki" / "nats")),
        stranger_ca=other / "ca.crt",
    )


@pytest.fixture
def tls_nats(authority: Authority, pki: Pki) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(authority, tls_dir=pki.nats)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _lookup(ns: str, job: str) -> grpc_creds.JobAccess:
    return grpc_creds.JobAccess(ns, job, TOKEN, ("tj-0",))


async def _fetch(port: int, ca: Path | None, timeout_s: float = 10) -> grpc_creds.WorkerCreds:
    return await grpc_creds.fetch(f"127.0.0.1:{port}", namespace="default", job="tj", pod="tj-0",
                                  token=pod_token(TOKEN, "default", "tj", "tj-0"),
                                  timeout_s=timeout_s, tls_ca=ca)  # fmt: skip


async def test_the_credentials_server_speaks_tls_to_whoever_trusts_its_ca_only(
    authority: Authority, pki: Pki, tmp_path: Path
) -> None:
    server, port = await grpc_creds.serve(authority, "nats://x:1", _lookup, tls_dir=pki.master)
    plain, plain_port = await grpc_creds.serve(authority, "nats://x:1", _lookup)
    try:
        got = await _fetch(port, pki.ca)
        assert got.rank == 0 and got.creds.jwt
        with pytest.raises(grpc_creds.TlsRefusedError) as no_ca:
            await _fetch(port, None, timeout_s=3)
        assert "speaks TLS" in no_ca.value.detail and "--tls-ca" in no_ca.value.detail
        with pytest.raises(grpc_creds.TlsRefusedError) as stranger:
            await _fetch(port, pki.stranger_ca, timeout_s=3)
        assert "not trusted by" in stranger.value.detail, stranger.value.detail
        with pytest.raises(grpc_creds.TlsRefusedError) as downgraded:
            await _fetch(plain_port, pki.ca, timeout_s=3)
        assert "does not speak TLS" in downgraded.value.detail
    finally:
        await server.stop(grace=None)
        await plain.stop(grace=None)


async def test_a_nats_client_must_trust_the_servers_ca(
    tls_nats: EmbeddedNats, authority: Authority, pki: Pki
) -> None:
    bus = await NatsBus.connect(tls_nats.url, authority.master_creds(), tls_ca=pki.ca)
    try:
        store = await KvStore.open(bus, STATUS_BUCKET)
        await store.put("probe", b"1", expected_revision=None)
    finally:
        await bus.close()
    for ca in (None, pki.stranger_ca):
        with pytest.raises(OSError):  # ssl.SSLCertVerificationError (or refused: no servers)
            await NatsBus.connect(tls_nats.url, authority.master_creds(), tls_ca=ca,
                                  max_reconnect_attempts=0, connect_timeout_s=3)  # fmt: skip


@contextlib.asynccontextmanager
async def tls_master(
    server: EmbeddedNats, authority: Authority, pki: Pki, tmp: Path
) -> AsyncIterator[int]:
    """A real ``aegis master --tls-dir`` process; yields its credentials port once it speaks TLS."""
    auth_file, port = tmp / "auth.json", free_port()
    authority.save(auth_file)
    argv = [*AEGIS, "master", "--nats", server.url, "--auth-file", str(auth_file),
            "--tls-dir", str(pki.master.path), "--grpc-port", str(port), "--replica-id", "m0",
            "--lease-s", "2", "--log-dir", str(tmp / "m")]  # fmt: skip
    with (tmp / "master.log").open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:

        def speaks_tls() -> bool:
            assert proc.poll() is None, (tmp / "master.log").read_text()
            with contextlib.suppress(OSError):
                tls._handshake("127.0.0.1", port, tls.client_context(pki.ca), 2.0)
                return True
            return False

        await async_wait_until(speaks_tls, 60, "the master's TLS credentials server")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _agent(port: int, token_file: Path, marker: Path, *extra: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *AEGIS, "agent", "--master", f"127.0.0.1:{port}", "--job", "tj", "--pod", "tj-0",
        "--token-file", str(token_file), "--connect-timeout-s", "5", *extra, "--",
        "bash", "-c", f"touch {marker}", stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(120):
        _, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_an_agent_that_trusts_the_ca_runs_a_job_one_that_does_not_is_refused(
    tls_nats: EmbeddedNats, authority: Authority, pki: Pki, tmp_path: Path
) -> None:
    bus = await NatsBus.connect(tls_nats.url, authority.master_creds(), tls_ca=pki.ca)
    try:
        store = await KvStore.open(bus, STATUS_BUCKET)
        served = await ServedJob.submit(bus, store, JobSpec("tj", "default", 1, 0), ["n0"],
                                        NullPlatform())  # fmt: skip
        token_file = tmp_path / "token"
        token_file.write_text(served.pod_token("tj-0"))
        async with tls_master(tls_nats, authority, pki, tmp_path) as port:
            for name, extra in (("none", ()), ("stranger", ("--tls-ca", str(pki.stranger_ca)))):
                marker = tmp_path / f"ran-{name}"
                code, err = await _agent(port, token_file, marker, *extra)
                lines = [line for line in err.splitlines() if "TLS" in line]
                assert code == 2 and len(lines) == 1, err
                assert lines[0].startswith("aegis agent: error: no TLS session with the master")
                assert not marker.exists()  # refused: the command never ran
            marker = tmp_path / "ran-trusted"
            code, err = await _agent(port, token_file, marker, "--tls-ca", str(pki.ca))
            assert code == 0, err
            assert marker.exists()
            async with asyncio.timeout(60):
                status = await served.wait()
            assert status.phase is Phase.SUCCEED, status
        # an operator reads the job from the store over the same TLS (``aegis status``)
        store_args = ("status", "tj", "--nats", tls_nats.url, "--auth-file",
                      str(tmp_path / "auth.json"), "--timeout-s", "5", "--json")  # fmt: skip
        for extra, code in (((), 1), (("--tls-ca", str(pki.ca)), 0)):
            proc = await asyncio.create_subprocess_exec(
                *AEGIS, *store_args, *extra,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            async with asyncio.timeout(60):
                out, err = await proc.communicate()
            assert proc.returncode == code, err.decode()
            if code:
                lines = err.decode().strip().splitlines()
                assert len(lines) == 1 and "cannot read the store" in lines[0], lines
            else:
                assert json.loads(out)["phase"] == Phase.SUCCEED.value
    finally:
        await bus.close()
