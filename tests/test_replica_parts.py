"""The pure parts of a master replica: a remote platform's events decoded (a bad one dropped),
and what the credentials handshake may hand out for a job."""

from __future__ import annotations

import msgspec
import pytest

from aegis.adapters import memory
from aegis.core import events as ev
from aegis.core.model import NodeName, PodName
from aegis.core.phases import Phase
from aegis.master import job_record, platform_events, records
from aegis.master.job_runner import JobRunner, JobSettings
from aegis.master.ports import NullPlatform
from aegis.wire import platform_msgs as pm
from tests.core_helpers import Driver


@pytest.mark.parametrize(
    ("payload", "event"),
    [
        (b'{"kind":"restarted","pod":"j-1","node":"node-3","pod_ip":"10.0.0.3"}',
         ev.PodRestarted(PodName("j-1"), NodeName("node-3"), "10.0.0.3")),
        (b'{"kind":"restarted","pod":"j-1"}', ev.PodRestarted(PodName("j-1"), None, None)),
        (b'{"kind":"quit","reason":"no node left"}', ev.QuitRequested("no node left")),
        (b'{"kind":"node_down","node":"node-1","reason":"gone"}',
         ev.NodeDown(NodeName("node-1"), "gone")),
        (b'{"kind":"node_down","node":"node-1"}', ev.NodeDown(NodeName("node-1"), "node down")),
        (b'{"kind":"node_down","reason":"gone"}', None),  # no node named
        (b'{"kind":"quit","reason":"x","extra":1}', None),  # an unknown field
        (b'{"kind":"reboot"}', None),  # a kind this master does not know
        (b"not json", None),
        (b'{"pod":"j-1"}', None),  # no kind
    ],
)  # fmt: skip
def test_a_platforms_event_is_decoded_or_dropped(payload: bytes, event: ev.Event | None) -> None:
    assert platform_events.decode(payload) == event


RECORD = job_record.JobRecord(
    spec={}, status={"phase": "RunCommand", "pod_infos": {"j-10": {}, "j-2": {}}}, token="t0k",
    creation="0a1b2c3d",
)  # fmt: skip


def test_job_access_comes_from_the_runner_of_a_led_job_and_pods_are_in_rank_order() -> None:
    live = records.Live(["j-1", "j-0"], Phase.RUN_COMMAND, "live", "11111111")
    access = records.job_access("ns", "j", live, RECORD, ended=False)
    assert access is not None
    assert (access.token, access.pods, access.ended) == ("live", ("j-0", "j-1"), False)
    assert access.creation == "11111111"  # its pods' subjects, as the runner has them
    without = records.Live(["j-0"], Phase.RUN_COMMAND, "")  # the runner has no token: the record's
    assert (access := records.job_access("ns", "j", without, RECORD, ended=False)) is not None
    assert access.token == "t0k"


def test_job_access_from_a_record_and_an_ended_job_gets_no_more_credentials() -> None:
    access = records.job_access("ns", "j", None, RECORD, ended=False)
    assert access is not None and access.pods == ("j-2", "j-10") and not access.ended
    assert access.creation == "0a1b2c3d"
    assert (gone := records.job_access("ns", "j", None, RECORD, ended=True)) is not None
    assert gone.ended
    over = msgspec.structs.replace(RECORD, status={**RECORD.status, "phase": "Failed"})
    assert (failed := records.job_access("ns", "j", None, over, ended=False)) is not None
    assert failed.ended
    assert records.job_access("ns", "j", None, None, ended=False) is None


async def test_a_node_down_said_again_for_a_known_node_is_not_handed_to_the_job() -> None:
    """A new leader's resend says every node found down again: one the job knows already is
    nothing new (not logged, not counted as a rejection); another is handed on."""
    job = Driver(workers=2)
    job.to_running()
    job.feed(ev.NodeDown(NodeName("node-1"), "gone"))
    bus = memory.MemoryBus()
    runner = JobRunner(job.spec, job.status, bus=bus, store=memory.MemoryStore(),
                       platform=NullPlatform(), settings=JobSettings(), log_dir=None)  # fmt: skip
    await platform_events.PlatformEvents(bus).follow(runner)
    subject = pm.subject(job.spec.namespace, job.spec.job, "events")
    for node in ("node-1", "node-0"):
        event = pm.PlatformEvent(kind="node_down", node=node, reason="gone")
        await bus.publish(subject, msgspec.json.encode(event))
    await bus.flush()
    handed = [runner.queue.get_nowait() for _ in range(runner.queue.qsize())]
    assert [getattr(item, "event", None) for item in handed] == [
        ev.NodeDown(NodeName("node-0"), "gone")
    ]
    assert runner.drops.counts == {}
