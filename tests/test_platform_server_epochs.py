"""The platform beside master replicas (``aegis run --masters N``) carries out requests of the
newest leader only: a deposed leader that wakes from a stall and sends what it had decided is
refused, as the agents refuse its orders."""

from __future__ import annotations

from aegis.adapters.memory import MemoryBus
from aegis.core.model import JobSpec
from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel
from aegis.master.ports import NullPlatform
from aegis.master.remote_platform import RemotePlatform
from aegis.platforms.platform_server import PlatformServer


class Recorder(NullPlatform):
    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []

    async def replace_pod(self, job: str, pod: str, reason: str) -> None:
        self.done.append(("replace", pod))

    async def evict_pod(self, job: str, pod: str, level: RecoveryLevel, reason: str) -> None:
        self.done.append(("evict", pod))

    async def end_job(self, job: str, phase: Phase) -> None:
        self.done.append(("end", phase.value))


async def test_requests_of_a_deposed_leader_are_dropped_and_counted() -> None:
    bus, platform = MemoryBus(), Recorder()
    spec = JobSpec(job="fenced", namespace="default", worker_num=2, max_retry=1)
    server = PlatformServer(bus, platform, namespace="default", job="fenced")
    await server.start()
    seq = iter(range(100))
    old = RemotePlatform(bus, spec, lambda: next(seq), epoch=3)
    new = RemotePlatform(bus, spec, lambda: next(seq), epoch=7)

    async def sent(request: object) -> None:
        await request  # type: ignore[misc]
        await bus.flush()

    await sent(old.replace_pod("fenced", "pod-0", "crashed"))  # nobody newer yet: carried out
    await sent(new.evict_pod("fenced", "pod-1", RecoveryLevel.EVICT_SLOW, "slow"))
    await sent(old.end_job("fenced", Phase.FAILED))  # the old leader woke: refused
    await sent(old.replace_pod("fenced", "pod-1", "crashed"))
    await sent(new.end_job("fenced", Phase.SUCCEED))
    assert platform.done == [("replace", "pod-0"), ("evict", "pod-1"), ("end", "Succeed")]
    assert server.stale == 2 and server.max_epoch == 7
    await server.stop()
