"""An agent whose run is gone says nothing more to the job's subjects: under ``aegis run
--nats URL`` a new run of the job's name may lead it by then (it takes over the name of a killed
run's job), and would take the old agent's words, said while it stops, as its own pod's.

A real nats-server (no auth, as ``--nats`` servers are) and the agent's real transport.
"""

from __future__ import annotations

import os

from aegis.adapters import lifecycle
from aegis.adapters.grpc.creds import WorkerCreds
from aegis.adapters.nats_auth import UserCreds
from aegis.adapters.nats_bus import NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.agent import link_settings
from aegis.agent.transport import Transport
from aegis.core.phases import Phase
from aegis.wire import codec
from aegis.wire import messages as m
from tests.waits import async_wait_until

PREFIX = "aegis.default.same"


def _ack(incarnation: str) -> m.Message:
    return m.Message(job="same", namespace="default", pod="same-0", type=m.MessageType.ACK,
                     phase=Phase.PENDING, seq=0, ts=0.0, data=m.AckData(incarnation=incarnation),
                     id=f"same-0/{incarnation}/0")  # fmt: skip


async def _transport(url: str, parent: int | None) -> Transport:
    settings = link_settings.LinkSettings("127.0.0.1:1", "default", "same", "same-0", "t",
                                          parent=parent)  # fmt: skip

    async def nothing(*_: object) -> None:
        return None

    transport = Transport(settings, nothing, nothing, lambda: False)
    transport.bus = await NatsBus.connect(url, None, name="agent")
    transport.creds = WorkerCreds(url, UserCreds("", b"", "", None), PREFIX, 1, 0)
    return transport


def test_the_parent_is_gone_once_this_process_has_another() -> None:
    assert not lifecycle.parent_gone(None)  # not started by an aegis run: never
    assert not lifecycle.parent_gone(os.getppid())
    assert lifecycle.parent_gone(os.getppid() + 1)


async def test_an_agent_whose_run_is_gone_sends_nothing(open_nats: EmbeddedNats) -> None:
    heard: list[bytes] = []
    listener = await NatsBus.connect(open_nats.url, None, name="new-run")

    async def hear(subject: str, payload: bytes) -> None:
        heard.append(payload)

    await listener.subscribe(f"{PREFIX}.worker.*", hear)
    await listener.flush()
    led = await _transport(open_nats.url, os.getppid())  # its run still leads the job
    orphan = await _transport(open_nats.url, os.getppid() + 1)  # its run is gone
    try:
        await orphan.publish(_ack("old"))
        assert orphan.bus is not None
        await orphan.bus.flush()  # had it gone out, the server would have it before the next
        await led.publish(_ack("new"))
        await async_wait_until(lambda: heard, what="the led agent's ACK")
        await listener.flush()
        said = [codec.decode(payload).data for payload in heard]
        assert said == [m.AckData(incarnation="new")], said
    finally:
        await led.close()
        await orphan.close()
        await listener.close()
