"""The immutable updaters of the core's records (aegis.core.updates)."""

from __future__ import annotations

import dataclasses

import immutables

from aegis.core import updates
from aegis.core.model import JobStatus, NodeName, PodInfo, PodName
from aegis.core.phases import Phase
from aegis.core.recovery import Classification


def test_updaters_may_replace_every_field_when_the_records_change() -> None:
    assert list(updates.PodChanges.__annotations__) == [f.name for f in dataclasses.fields(PodInfo)]
    assert list(updates.StatusChanges.__annotations__) == [
        f.name for f in dataclasses.fields(JobStatus)
    ]


def test_pod_replaces_the_given_fields_and_keeps_the_others_when_updated() -> None:
    info = PodInfo(Phase.TROUBLESHOOTING, NodeName("n1"), "10.0.0.1", retries=2, slow=True,
                   verdict=Classification.HEALTHY)  # fmt: skip
    new = updates.pod(info, finished=True, verdict=None, updated_ts=3.0)
    assert new == dataclasses.replace(info, finished=True, verdict=None, updated_ts=3.0)
    assert info.finished is False and info.verdict is Classification.HEALTHY  # unchanged


def test_status_replaces_the_given_fields_and_keeps_the_others_when_updated() -> None:
    pods = immutables.Map({PodName("j-0"): PodInfo(Phase.PENDING)})
    status = JobStatus(Phase.PENDING, 1, False, 4, pods, outstanding=1, repeat_reason="x")
    new = updates.status(status, seq=5, outstanding=0)
    assert new == dataclasses.replace(status, seq=5, outstanding=0)
    assert updates.status(status) == status and updates.status(status) is not status
