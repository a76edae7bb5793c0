"""Issue 20's probes, replayed as an attacker with one pod's credentials would try them, each
asserting refusal. Real nats-server in operator mode, a real master (``MasterService``, or a
``Replica`` as ``aegis master`` runs it), real gRPC; the agent as a process where it runs
something."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_auth import (
    Authority,
    UserCreds,
    decode_claims,
    order_verifier,
    write_pod_token,
)
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.agent import link, link_settings
from aegis.core import events as ev
from aegis.core.model import InvalidNameError, JobSpec, NodeName, initial_status, name_problem
from aegis.core.phases import Order, Phase
from aegis.master import control, control_file
from aegis.master.job_runner import JobRunner, JobSettings
from aegis.master.lease import LeaseSettings
from aegis.master.ports import NullPlatform
from aegis.master.records import submit_job
from aegis.master.replica import Replica, ReplicaSettings
from aegis.master.service import STATUS_BUCKET, MasterService, MasterSettings
from aegis.spawn.ports import free_port
from aegis.wire import codec, status_json
from aegis.wire import messages as m
from aegis.wire.tokens import pod_token
from tests.waits import async_wait_until

pytestmark = pytest.mark.timeout(180)

AEGIS = [sys.executable, "-m", "aegis"]
TOKEN = "the-jobs-bootstrap-token"
QUIET = JobSettings(heartbeat_timeout_s=60.0, order_resend_s=60.0)


# -- harness -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def master_service(
    server: EmbeddedNats, authority: Authority
) -> AsyncIterator[MasterService]:
    service = await MasterService.connect(authority, server.url, MasterSettings(job=QUIET))
    try:
        yield service
    finally:
        await service.close()


async def new_job(
    service: MasterService, job: str, pods: int = 2, ns: str = "default"
) -> JobRunner:
    spec = JobSpec(job, ns, pods, 1)
    nodes = [f"node-{i}" for i in range(pods)]
    runner, _ = await service.create_job(spec, nodes, NullPlatform(), log_dir=None, token=TOKEN)
    return runner


def secret(job: str, pod: str, ns: str = "default") -> str:
    """Pod ``pod``'s own bootstrap secret (the platform hands it to that pod only)."""
    return pod_token(TOKEN, ns, job, pod)


async def fetch(
    port: int, job: str, pod: str, token: str | None = None, ns: str = "default"
) -> grpc_creds.WorkerCreds:
    """Credentials as pod ``pod`` with its own secret (or ``token``)."""
    token = secret(job, pod, ns) if token is None else token
    return await grpc_creds.fetch(
        f"127.0.0.1:{port}", namespace=ns, job=job, pod=pod, token=token, timeout_s=10
    )


async def connect(server: EmbeddedNats, creds: UserCreds, errors: list[str]) -> NatsBus:
    return await NatsBus.connect(
        server.url,
        creds,
        on_error=lambda exc: errors.append(str(exc)),
        max_reconnect_attempts=0,
        connect_timeout_s=5,
    )


class Spy:
    """The master's view of a subject: what arrived, and a sentinel that shows it is current."""

    def __init__(self, bus: NatsBus) -> None:
        self.bus = bus
        self.seen: list[bytes] = []

    async def on(self, subject: str, payload: bytes) -> None:
        self.seen.append(payload)

    async def caught_up(self, subject: str) -> None:
        sentinel = f"sentinel-{time.monotonic_ns()}".encode()
        await self.bus.publish(subject, sentinel)
        await self.bus.flush()
        await async_wait_until(lambda: sentinel in self.seen, what=f"the sentinel on {subject}")


def refused(errors: list[str], verb: str, subject: str) -> bool:
    said = [e.lower() for e in errors]
    return any(
        "permissions violation" in e and verb.lower() in e and subject.lower() in e for e in said
    )


def forged_order(job: str, order: Order, env: dict[str, str], epoch: int, seq: int = 50) -> bytes:
    msg = m.Message(
        job=job, namespace="default", pod="master", type=m.MessageType.ORDER,
        phase=Phase.RUN_COMMAND, seq=seq, ts=time.time(), data=m.OrderData(order, env=env),
        epoch=epoch,
    )  # fmt: skip
    return codec.encode(msg)


def ack(job: str, pod: str) -> bytes:
    msg = m.Message(
        job=job, namespace="default", pod=pod, type=m.MessageType.ACK, phase=Phase.PENDING,
        seq=0, ts=time.time(), data=m.AckData("node-1", "", "forged"), id=f"{pod}/forged/0",
    )  # fmt: skip
    return codec.encode(msg)


# -- (b) a worker cannot act as its job's master; epoch poisoning ------------------------------


async def test_a_worker_cannot_publish_an_order_nor_poison_the_epoch(
    nats_server: EmbeddedNats, authority: Authority, tmp_path: Path
) -> None:
    async with master_service(nats_server, authority) as service:
        runner = await new_job(service, "sec")
        p = runner.prefix  # (``aegis.default.sec.<creation>``)
        agent = link.MasterLink(
            link_settings.LinkSettings(
                f"127.0.0.1:{service.grpc_port}", "default", "sec", "sec-0", secret("sec", "sec-0")
            )
        )
        await agent.connect()  # pod 0's real link: ACKs, takes orders
        spy = Spy(service.bus)
        await service.bus.subscribe(f"{p}.master", spy.on)
        errors: list[str] = []
        pod1 = await fetch(service.grpc_port, "sec", "sec-1")
        bus1 = await connect(nats_server, pod1.creds, errors)
        try:
            evil = {"BASH_ENV": str(tmp_path / "evil.sh")}
            forged = forged_order("sec", Order.RUN, evil, epoch=999_999)
            await bus1.publish(f"{p}.master", forged)  # the probe
            await bus1.subscribe(f"{p}.worker.sec-0", spy.on)  # pod 0's reports
            await bus1.flush()
            await async_wait_until(
                lambda: refused(errors, "Publish", f'"{p}.master"'),
                what="the server's refusal of the forged order",
            )
            await async_wait_until(
                lambda: refused(errors, "Subscription", f'"{p}.worker.sec-0"'),
                what="the server's refusal to let pod 1 read the reports",
            )
            await spy.caught_up(f"{p}.master")
            assert forged not in spy.seen
            # the real master's orders still reach pod 0 once pod 1 ACKs (as it may)
            await bus1.publish(f"{p}.worker.sec-1", ack("sec", "sec-1"))
            await bus1.flush()
            await async_wait_until(lambda: not agent.orders.empty(), what="the bootcheck order")
            order = agent.orders.get_nowait()
            assert isinstance(order.data, m.OrderData) and order.data.order is Order.BOOTCHECK
            assert order.epoch == runner.epoch and agent.max_epoch == runner.epoch
            # Had it got through (a server without that permission): unsigned, dropped, the
            # epoch unmoved; an order signed by anyone but the master likewise.
            await agent.receive(forged)
            stranger = codec.encode_signed(codec.decode(forged), Authority().sign_order)
            await agent.receive(stranger)
            assert agent.dropped["unsigned"] == 2 and agent.max_epoch == runner.epoch
            assert agent.orders.empty()
        finally:
            await bus1.close()
            await agent.close()


def test_an_order_signature_covers_every_field() -> None:
    authority = Authority()
    creds = authority.worker_creds("default", "j", "j-0", 60)
    verify = order_verifier(creds.jwt)
    assert verify is not None and order_verifier("") is None
    msg = codec.decode(forged_order("j", Order.RUN, {"MASTER_PORT": "1"}, epoch=3))
    signed = codec.decode(codec.encode_signed(msg, authority.sign_order))
    assert verify(codec.signed_part(signed), signed.sig)
    import msgspec

    for changed in (
        msgspec.structs.replace(signed, epoch=999_999),
        msgspec.structs.replace(signed, seq=51),
        msgspec.structs.replace(signed, data=m.OrderData(Order.RUN, env={"MASTER_PORT": "2"})),
    ):
        assert not verify(codec.signed_part(changed), changed.sig)
    assert not verify(codec.signed_part(signed), "not base64 !")
    # the account key's signature of an order is no JWT signature: the JWT's input differs
    assert not verify(creds.jwt.rsplit(".", 1)[0].encode(), creds.jwt.rsplit(".", 1)[1])


# -- (a) orders carry no arbitrary environment -------------------------------------------------


async def _wait_report(
    reports: list[m.Message], kind: m.MessageType, timeout_s: float = 60
) -> m.Message:
    return await async_wait_until(
        lambda: next((r for r in reports if r.type is kind), None), timeout_s, str(kind)
    )


def _bash_env_probe(tmp_path: Path, clean: dict[str, str]) -> tuple[Path, Path]:
    """The probe's file, and the marker it leaves: where nothing filters, bash runs it."""
    marker, evil = tmp_path / "evil-ran", tmp_path / "evil.sh"
    evil.write_text(f"touch {marker}\n")
    subprocess.run(["bash", "-c", "true"], env={**clean, "BASH_ENV": str(evil)}, check=True)
    assert marker.exists()
    marker.unlink()
    return evil, marker


def _signed(msg: m.Message, authority: Authority) -> bytes:
    return codec.encode_signed(msg, authority.sign_order)


async def test_an_order_cannot_set_bash_env_or_any_key_the_agent_does_not_know(
    nats_server: EmbeddedNats, authority: Authority, tmp_path: Path
) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("BASH_ENV", "ENV", "LD_PRELOAD")}
    evil, marker = _bash_env_probe(tmp_path, clean)
    out = tmp_path / "out"
    access = grpc_creds.JobAccess("default", "envj", TOKEN, ("envj-0",))
    server, port = await grpc_creds.serve(authority, nats_server.url, lambda ns, job: access)
    master = await NatsBus.connect(nats_server.url, authority.master_creds())
    reports: list[m.Message] = []

    async def on_report(subject: str, payload: bytes) -> None:
        reports.append(codec.decode(payload))

    await master.subscribe("aegis.default.envj.worker.*", on_report)
    await master.flush()
    token_file = tmp_path / "token"
    token_file.write_text(pod_token(TOKEN, "default", "envj", "envj-0"))
    script = (
        f'echo "$MASTER_PORT $AEGIS_RESUME_STEP ${{LD_PRELOAD:-none}} ${{BASH_ENV:-none}}" > {out}'
    )
    proc = await asyncio.create_subprocess_exec(
        *AEGIS, "agent", "--master", f"127.0.0.1:{port}", "--job", "envj", "--pod", "envj-0",
        "--token-file", str(token_file), "--", "bash", "-c", script,
        env=clean, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await _wait_report(reports, m.MessageType.ACK)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "AEGIS_RESUME_STEP": "7",
               "BASH_ENV": str(evil), "LD_PRELOAD": str(tmp_path / "evil.so")}  # fmt: skip
        run = codec.decode(forged_order("envj", Order.RUN, env, epoch=0, seq=1))
        await master.publish("aegis.default.envj.master", _signed(run, authority))
        finish = await _wait_report(reports, m.MessageType.FINISH)
        assert isinstance(finish.data, m.ExitData) and finish.data.exit_code == 0
        stop = codec.decode(forged_order("envj", Order.EXIT, {}, epoch=0, seq=2))
        await master.publish("aegis.default.envj.master", _signed(stop, authority))
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await master.close()
        await server.stop(grace=None)
    assert proc.returncode == 0, err
    assert not marker.exists()  # BASH_ENV never reached the training's bash
    assert out.read_text().split() == ["29511", "7", "none", "none"]  # known keys applied
    dropped = [line for line in err.decode().splitlines() if "dropped environment key" in line]
    assert len(dropped) == 1 and "'BASH_ENV'" in dropped[0] and "'LD_PRELOAD'" in dropped[0]


def test_the_agent_keeps_only_the_keys_the_master_sends() -> None:
    """Every key the master writes into an order is one the agent applies (the list is one)."""
    assert {
        m.CKPT_REQUEST_ENV,
        m.CKPT_STEP_ENV,
        m.CKPT_HOLD_ENV,
        m.RESUME_STEP_ENV,
    } <= m.ORDER_ENV_KEYS
    assert {"MASTER_ADDR", "MASTER_PORT", "CHECK_MASTER_PORT"} <= m.ORDER_ENV_KEYS
    assert not any(k.startswith(("LD_", "PYTHON", "BASH")) for k in m.ORDER_ENV_KEYS)


async def test_unknown_keys_are_counted_and_logged_at_a_bounded_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = link.MasterLink(link_settings.LinkSettings("127.0.0.1:1", "default", "j", "j-0", "t"))
    caplog.set_level(logging.WARNING, logger=link.__name__)
    for i in range(200):
        env = {"MASTER_PORT": "5", f"EVIL_{i}": "x", "BASH_ENV": "/x"}
        await agent.receive(forged_order("j", Order.RUN, env, epoch=0, seq=i))
    assert sum(agent.dropped_env.values()) == 400 and agent.dropped_env["BASH_ENV"] == 200
    assert len(agent.dropped_env) <= 65  # bounded however many names are tried
    taken = [agent.orders.get_nowait() for _ in range(agent.orders.qsize())]
    assert len(taken) == 200
    assert all(
        isinstance(o.data, m.OrderData) and o.data.env == {"MASTER_PORT": "5"} for o in taken
    )
    assert len([r for r in caplog.records if "dropped environment" in r.getMessage()]) <= 2


# -- (c) one name rule; no job's subjects are a prefix of another's ----------------------------


@pytest.mark.parametrize("name", ["job", "jobp-2", "a", "0", "x" * 63, "team-2"])
def test_dns_labels_are_names(name: str) -> None:
    assert name_problem("job", name) is None


@pytest.mark.parametrize(
    "name", ["jobP", "jobp.v2", "job*", "job>", "a_b", "-a", "a-", "", "x" * 64, "a b", "é"]
)
def test_anything_else_is_refused(name: str) -> None:
    assert name_problem("job", name) is not None
    with pytest.raises(InvalidNameError):
        Authority().worker_creds("default", name, f"{name}-0", 60)


async def test_the_master_creates_no_job_outside_the_rule(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    async with master_service(nats_server, authority) as service:
        for ns, job in (("default", "jobP"), ("default", "jobp.v2"), ("team.a", "jobp")):
            with pytest.raises(InvalidNameError):
                await service.create_job(
                    JobSpec(job, ns, 1, 1), ["n0"], NullPlatform(), log_dir=None, token=TOKEN
                )
        assert service.jobs == {}
        with pytest.raises(grpc_creds.CredsRefusedError):  # nor hands out credentials for one
            await fetch(service.grpc_port, "jobp.v2", "jobp.v2-0")


def test_aegis_run_refuses_a_bad_job_name_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [*AEGIS, "run", "--job", "jobP.v2", "--nodes", "1", "--log-dir", str(tmp_path), "--",
         "true"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--job" in lines[0] and "'jobP.v2'" in lines[0], lines
    assert "DNS label" in lines[0]


async def test_a_job_named_like_another_with_a_suffix_shares_nothing_with_it(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """The probe: job ``jobP``'s worker read and wrote ``aegis.default.jobP.v2.*`` (a forged
    ACK moved that job to BootChecking). ``jobp.v2`` is no name now; ``jobp-2`` is one, and
    shares no subject with ``jobp``."""
    async with master_service(nats_server, authority) as service:
        await new_job(service, "jobp", pods=1)
        other = await new_job(service, "jobp-2", pods=1)
        p = other.prefix
        spy = Spy(service.bus)
        await service.bus.subscribe(f"{p}.worker.*", spy.on)
        errors: list[str] = []
        creds = await fetch(service.grpc_port, "jobp", "jobp-0")
        worker = await connect(nats_server, creds.creds, errors)
        try:
            forged = ack("jobp-2", "jobp-2-0")
            await worker.publish(f"{p}.worker.jobp-2-0", forged)
            await worker.subscribe(f"{p}.>", spy.on)
            await worker.flush()
            await async_wait_until(
                lambda: refused(errors, "Publish", f'"{p}.worker.jobp-2-0"'),
                what="the forged ACK refused",
            )
            await async_wait_until(
                lambda: refused(errors, "Subscription", f'"{p}.>"'),
                what="the subscription refused",
            )
            await spy.caught_up(f"{p}.worker.jobp-2-0")
            assert forged not in spy.seen
            assert other.status.phase is Phase.PENDING and other.status.outstanding == 1
        finally:
            await worker.close()


# -- the standalone master (``aegis master``): adoption and handshakes -------------------------


@contextlib.asynccontextmanager
async def standalone(server: EmbeddedNats, authority: Authority) -> AsyncIterator[Replica]:
    replica = Replica(authority, server.url, ReplicaSettings(
        replica_id="m1", lease=LeaseSettings(lease_s=2.0), job=QUIET, poll_s=0.05))  # fmt: skip
    task = asyncio.create_task(replica.run(), name="replica")
    try:
        async with asyncio.timeout(60):
            await replica.leading.wait()
        yield replica
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def _record(job: str) -> bytes:
    spec = JobSpec(job, "default", 1, 1)
    record = status_json.to_dict(spec, initial_status(spec, [NodeName("n0")]))
    record.update(orders=[], epoch=0, token=TOKEN, nodes=["n0"])
    return json.dumps(record).encode()


async def test_the_standalone_master_adopts_no_job_outside_the_rule_and_ended_jobs_get_nothing(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    bus = await NatsBus.connect(nats_server.url, authority.master_creds())
    try:
        async with standalone(nats_server, authority) as replica:
            store = await KvStore.open(bus, STATUS_BUCKET)
            await store.put("default.jobP", _record("jobP"), expected_revision=None)
            await submit_job(store, JobSpec("fine", "default", 1, 1), ["n0"], TOKEN)
            await async_wait_until(lambda: "default.fine" in replica.runners, 60, "adopted")
            await async_wait_until(lambda: replica.malformed.count >= 1, 60, "counted")
            assert "default.jobP" not in replica.runners
            got = await fetch(replica.grpc_port, "fine", "fine-0")
            assert decode_claims(got.creds.jwt)["nats"]["pub"]["allow"] == [
                "aegis.default.fine.worker.fine-0"  # submitted to replicas: no creation id
            ]
            runner = replica.runners["default.fine"]
            runner.platform_event(ev.QuitRequested("the operator ended it"))
            await async_wait_until(runner.done.is_set, 60, "the job to end")
            with pytest.raises(grpc_creds.CredsRefusedError):
                await fetch(replica.grpc_port, "fine", "fine-0")
    finally:
        await bus.close()


# -- (c) per-pod identity: no pod speaks for another -------------------------------------------


async def test_one_pods_secret_gets_no_other_pods_credentials_nor_the_jobs_secret_any(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """The probe: the token was per job, so pod 1 got credentials as pod 0. Now each pod has
    its own secret; pod 1's asks as pod 0 in vain, and the job's own secret is no pod's."""
    async with master_service(nats_server, authority) as service:
        await new_job(service, "who", pods=3)
        own = await fetch(service.grpc_port, "who", "who-1")  # pod 1, its own secret: fine
        assert own.rank == 1
        for pod in ("who-0", "who-2"):
            with pytest.raises(grpc_creds.CredsRefusedError):
                await fetch(service.grpc_port, "who", pod, secret("who", "who-1"))
        with pytest.raises(grpc_creds.CredsRefusedError):
            await fetch(service.grpc_port, "who", "who-0", TOKEN)
    # no secret reveals another: all different, none is the job's, and none is a prefix
    tokens = {secret("who", f"who-{i}") for i in range(3)} | {TOKEN}
    assert len(tokens) == 4
    assert secret("who", "who-0") != pod_token(TOKEN, "team2", "who", "who-0")


async def test_a_pods_credentials_report_as_that_pod_only(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """Pod 1's credentials publish on pod 1's worker subject only: an Error "from pod 0" is
    refused by the server, and one that reached the master on the wrong subject anyway (a
    server without auth) is dropped and counted, never pod 0's fault."""
    async with master_service(nats_server, authority) as service:
        runner = await new_job(service, "imp", pods=2)
        p = runner.prefix
        spy = Spy(service.bus)
        await service.bus.subscribe(f"{p}.worker.*", spy.on)
        errors: list[str] = []
        pod1 = await fetch(service.grpc_port, "imp", "imp-1")
        bus1 = await connect(nats_server, pod1.creds, errors)
        try:
            forged = ack("imp", "imp-0")  # pod 0's ACK, from pod 1's credentials
            await bus1.publish(f"{p}.worker.imp-0", forged)
            await bus1.publish(f"{p}.worker", forged)
            await bus1.subscribe("_INBOX_default_imp_imp-0.>", spy.on)
            await bus1.flush()
            for verb, subject in (("Publish", f"{p}.worker.imp-0"),
                                  ("Publish", f"{p}.worker"),
                                  ("Subscription", "_INBOX_default_imp_imp-0.>")):  # fmt: skip
                await async_wait_until(
                    lambda v=verb, s=subject: refused(errors, v, f'"{s}"'), what=f"{verb} {subject}"
                )
            await spy.caught_up(f"{p}.worker.imp-0")
            assert forged not in spy.seen
            # on its own subject pod 1's own ACK is taken
            await bus1.publish(f"{p}.worker.imp-1", ack("imp", "imp-1"))
            await bus1.flush()
            await async_wait_until(lambda: runner.status.outstanding == 1, what="pod 1's ACK")
            # pod 0's ACK on pod 1's subject (as if the server had let it through)
            await runner.on_worker_message(f"{p}.worker.imp-1", forged)
            assert runner.drops.counts["wrong_pod"] == 1
            assert runner.status.outstanding == 1 and runner.status.phase is Phase.PENDING
        finally:
            await bus1.close()


# -- (d) the smaller ones ----------------------------------------------------------------------


async def test_inboxes_are_per_namespace(nats_server: EmbeddedNats, authority: Authority) -> None:
    """default/joba and team2/joba shared ``_INBOX_joba``: each now has its own (each pod
    its own, ``_INBOX_<ns>_<job>_<pod>``)."""
    a, b = (authority.worker_creds(ns, "joba", "joba-0", 60) for ns in ("default", "team2"))
    assert (a.inbox_prefix, b.inbox_prefix) == (
        "_INBOX_default_joba_joba-0",
        "_INBOX_team2_joba_joba-0",
    )
    errors_a: list[str] = []
    bus_a = await connect(nats_server, a, errors_a)
    bus_b = await connect(nats_server, b, [])
    master = await NatsBus.connect(nats_server.url, authority.master_creds())
    seen_a, seen_b = Spy(master), Spy(master)
    try:
        await bus_a.subscribe("_INBOX_team2_joba_joba-0.>", seen_a.on)
        await bus_b.subscribe("_INBOX_team2_joba_joba-0.>", seen_b.on)
        await bus_a.flush()
        await bus_b.flush()
        await async_wait_until(
            lambda: refused(errors_a, "Subscription", '"_INBOX_team2_joba_joba-0.>"'),
            what="refusal",
        )
        await seen_b.caught_up("_INBOX_team2_joba_joba-0.reply")
        assert seen_a.seen == []
    finally:
        for bus in (bus_a, bus_b, master):
            await bus.close()


async def test_every_refusal_looks_the_same_and_an_ended_job_gets_no_credentials(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    async with master_service(nats_server, authority) as service:
        runner = await new_job(service, "alive", pods=1)
        ended = await new_job(service, "ended", pods=1)
        await fetch(service.grpc_port, "ended", "ended-0")  # while it runs
        ended.platform_event(ev.QuitRequested("over"))
        await async_wait_until(ended.done.is_set, 60, "the job to end")
        answers = set()
        for job, pod, token in (
            ("nosuch", "nosuch-0", secret("nosuch", "nosuch-0")),  # no such job
            ("alive", "alive-0", "guess"),  # a wrong token
            ("alive", "alive-0", TOKEN),  # the job's secret is no pod's
            ("alive", "alive-9", secret("alive", "alive-9")),  # no such pod
            ("ended", "ended-0", secret("ended", "ended-0")),  # an ended job
            ("Alive", "Alive-0", secret("Alive", "Alive-0")),  # a name outside the rule
        ):
            with pytest.raises(grpc_creds.CredsRefusedError) as caught:
                await fetch(service.grpc_port, job, pod, token)
            answers.add((caught.value.reason, caught.value.detail))
        assert answers == {("permission_denied", grpc_creds.REFUSED)}
        assert runner.status.phase is Phase.PENDING


async def test_a_refused_request_logs_the_peers_strings_truncated_escaped_and_rarely(
    nats_server: EmbeddedNats, authority: Authority, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=grpc_creds.__name__)
    async with master_service(nats_server, authority) as service:
        await new_job(service, "alive", pods=1)
        pod = "alive-0\n2026-01-01 00:00:00 WARNING forged line " * 1000  # ~50 kB
        started = time.monotonic()
        for _ in range(20):
            with pytest.raises(grpc_creds.CredsRefusedError):
                await fetch(service.grpc_port, "alive", pod, "guess")
        with pytest.raises((ConnectionError, grpc_creds.CredsRefusedError)):  # over the size bound
            await fetch(service.grpc_port, "alive", "x" * 200_000, "guess")
        elapsed = time.monotonic() - started
    lines = [r.getMessage() for r in caplog.records if r.name == grpc_creds.__name__]
    assert 1 <= len(lines) <= 1 + int(elapsed // 10) + 1, lines
    for line in lines:
        assert "\n" not in line and len(line) < 600, line
        assert "\\n" in line and "characters)" in line  # escaped, and says it was cut


async def test_a_flood_of_bad_messages_is_counted_exactly_and_logged_rarely(
    nats_server: EmbeddedNats, authority: Authority, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aegis.master.drops")
    async with master_service(nats_server, authority) as service:
        runner = await new_job(service, "flood", pods=1)
        creds = await fetch(service.grpc_port, "flood", "flood-0")
        worker = await connect(nats_server, creds.creds, [])
        try:
            for i in range(300):
                await worker.publish(f"{runner.prefix}.worker.flood-0", b"{not json\n" + bytes(i))
            await worker.flush()
            await async_wait_until(lambda: runner.drops.counts["malformed"] == 300, 60, "drops")
        finally:
            await worker.close()
    assert runner.drops.total() == 300
    assert len([r for r in caplog.records if "dropped a message" in r.getMessage()]) <= 2


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_authority_save_replaces_an_existing_world_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "authority.json"
    path.write_text("old")
    path.chmod(0o644)
    before = path.stat().st_ino
    authority = Authority()
    authority.save(path)
    assert _mode(path) == 0o600 and path.stat().st_ino != before  # never written into
    assert Authority.load(path).account.public_key == authority.account.public_key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["authority.json"]


def test_a_pods_token_file_is_owner_only_from_its_first_byte(tmp_path: Path) -> None:
    folder = tmp_path / ".bootstrap-tokens"
    folder.mkdir(mode=0o755)
    token_file = folder / "j-0"
    token_file.write_text("")
    token_file.chmod(0o644)
    before = token_file.stat().st_ino
    path = write_pod_token(tmp_path, "s3cret", "default", "j", "j-0")
    assert path == token_file and _mode(folder) == 0o700
    assert token_file.read_text() == pod_token("s3cret", "default", "j", "j-0")
    assert _mode(token_file) == 0o600 and token_file.stat().st_ino != before
    assert sorted(p.name for p in folder.iterdir()) == ["j-0"]
    assert "s3cret" not in token_file.read_text()


@pytest.mark.timing
async def test_ctl_with_credentials_that_may_not_send_says_not_permitted(
    nats_server: EmbeddedNats, authority: Authority, tmp_path: Path
) -> None:
    async with master_service(nats_server, authority) as service:
        await new_job(service, "ctlj", pods=1)
        sub = await control.serve_control(service.bus, lambda ns, job: None, lambda: [])
        worker = await fetch(service.grpc_port, "ctlj", "ctlj-0")  # a pod's, not the master's
        target = control_file.ControlTarget(nats_server.url, worker.creds, "default", "ctlj",
                                       subject=sub.subject)  # fmt: skip
        control_file.write_control_file(tmp_path / "control.json", target)
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *AEGIS, "ctl", "stop", "ctlj", "--ctl-file", str(tmp_path / "control.json"),
            "--timeout-s", "60", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(90):
            _, err = await proc.communicate()
        await sub.unsubscribe()
    assert proc.returncode == 1
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aegis: error: not permitted"), lines
    assert time.monotonic() - started < 60  # said at once, not after the timeout


# -- (e) authentication on by default ----------------------------------------------------------


def test_the_master_will_not_start_without_keys_and_says_so_before_connecting() -> None:
    with socket.socket() as listener:  # where NATS would be: nobody may knock
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        url = f"nats://127.0.0.1:{listener.getsockname()[1]}"
        result = subprocess.run([*AEGIS, "master", "--nats", url], capture_output=True,
                                text=True, timeout=60, check=False)  # fmt: skip
        with pytest.raises(BlockingIOError):
            listener.accept()  # it never connected
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "--auth-file" in lines[0] and "--insecure" in lines[0], lines


async def test_insecure_is_the_explicit_way_to_run_without_authentication(tmp_path: Path) -> None:
    server = EmbeddedNats()
    await asyncio.to_thread(server.start)
    port = free_port()
    with (tmp_path / "master.log").open("ab") as out:
        proc = subprocess.Popen([*AEGIS, "master", "--nats", server.url, "--insecure",
                                 "--grpc-port", str(port), "--replica-id", "open"],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        access = ("default", "nosuch", "nosuch-0")

        async def answers() -> bool:
            assert proc.poll() is None, (tmp_path / "master.log").read_text()
            try:
                await fetch(port, access[1], access[2], ns=access[0])
            except grpc_creds.CredsRefusedError:
                return True  # it serves (and refuses an unknown job)
            except ConnectionError:
                return False
            return False

        await async_wait_until(answers, 60, "the insecure master's credentials server")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.stop()
