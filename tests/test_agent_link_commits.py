"""Which of the saver daemon's commits the agent reports after an in-place restart: the pure
rule, then a real supervisor restarting a real training process on the master's orders (the
daemon's commits made by the test, with the daemon's own ``commit_one``, when a slow disk would
finish them)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from aegis.agent import (
    commit_rule,
    executor,
    link,
    link_settings,
    linked,
    ports,
    reaper,
    supervisor,
)
from aegis.checkpoint import api, daemon, process
from aegis.checkpoint import layout as lay
from aegis.core.phases import Order, Phase
from aegis.wire import messages as m
from tests import forkserver_harness as harness
from tests.waits import async_wait_until

SETTINGS = link_settings.LinkSettings("127.0.0.1:1", "ns", "job", "job-1", "t")
Current = commit_rule.Current


@pytest.mark.parametrize(
    ("step", "incarnation", "current", "dropped"),
    [
        (30, 0, Current(1, 20), True),  # the abandoned timeline's step, persisted late
        (30, 2, Current(3, 20), True),
        (20, 0, Current(1, 20), False),  # at the resume step: the shared history
        (10, 0, Current(1, 20), False),
        (30, 1, Current(1, 20), False),  # the current incarnation's own
        (30, -1, Current(1, 20), False),  # not known (an older slot): reported as before
        (30, 0, Current(1, None), False),  # resumed from nothing said: nothing dropped
        (30, 0, Current(0, None), False),
        (30, 5, Current(1, 20), False),  # a newer one than the agent knows: not older
    ],
)
def test_only_an_older_incarnations_commit_past_the_resume_step_is_dropped(
    step: int, incarnation: int, current: commit_rule.Current, dropped: bool
) -> None:
    assert commit_rule.abandoned(step, incarnation, current) is dropped


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"AEGIS_RESUME_STEP": "20"}, 20),
        ({"AEGIS_RESUME_STEP": "0"}, 0),
        ({"AEGIS_RESUME_STEP": ""}, None),
        ({"AEGIS_RESUME_STEP": "-3"}, None),
        ({"AEGIS_RESUME_STEP": "twenty"}, None),
    ],
)
def test_the_resume_step_is_the_orders_and_a_malformed_one_is_none(
    env: dict[str, str], expected: int | None
) -> None:
    assert commit_rule.resume_step_of(env) == expected


# A training process under the supervisor: it saves through Aegis as its environment says
# (AEGIS_RESTART_COUNT, AEGIS_RESUME_STEP), each save of 30 once the test opens the FIFO.
TRAINING = """
import os, signal, sys
import torch
from aegis.checkpoint import api
resume = int(os.environ.get("AEGIS_RESUME_STEP") or 0)
saver = api.Saver(api.SaverSettings.from_env())
for step in (20, 30):
    if step > resume:
        if step == 30:
            open(sys.argv[1]).read()
        saver.save(step, {"w": torch.full((4,), float(step))})
signal.pause()
"""


def _order(seq: int, env: dict[str, str]) -> m.Message:
    return m.Message(job="job", namespace="ns", pod="master", type=m.MessageType.ORDER,
                     phase=Phase.RUN_COMMAND, seq=seq, ts=1.0,
                     data=m.OrderData(Order.RUN, env=env))  # fmt: skip


the_reaper, devnull = harness.the_reaper, harness.devnull  # fixtures


class Pod:
    """The agent's side of one pod: its link (what it sends is kept), a supervisor and the
    order executor, the tail of the saver's ``commits.jsonl``."""

    def __init__(
        self, tmp: Path, the_reaper: reaper.Reaper, devnull: int, *, linked_start: bool = False
    ) -> None:
        self.shm, self.ckpt, self.go = tmp / "shm", tmp / "ckpt", tmp / "go"
        if not self.go.exists():
            os.mkfifo(self.go)
        self.link = link.MasterLink(SETTINGS)
        self.sent: list[m.Payload] = []
        self.link.send = self._send  # type: ignore[method-assign]
        env = {**os.environ, "AEGIS_CKPT_SHM": str(self.shm), "AEGIS_CKPT_DIR": str(self.ckpt),
               "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
        settings = supervisor.SupervisorSettings(grace_s=5.0, hang_timeout_s=0.0,
                                                 stdout_fd=devnull, stderr_fd=devnull)  # fmt: skip
        if linked_start:  # as an agent starts under its master (the pod's shared memory known)
            settings = linked.go_on_counting(settings, self.shm)
        argv = [sys.executable, "-c", TRAINING, str(self.go)]
        self.sup = supervisor.Supervisor(argv, settings, the_reaper, ports.RecordingReports(),
                                         env=env)  # fmt: skip
        self.orders = executor.OrderExecutor(self.link, self.sup)
        tail = process.DaemonSettings(self.shm, self.ckpt)
        self.tail = process.DaemonProcess(tail, on_stamped_commit=self.link.checkpoint_committed)

    async def _send(self, kind: m.MessageType, data: m.Payload, round_: object = None) -> None:
        self.sent.append(data)

    async def order(self, seq: int, env: dict[str, str]) -> None:
        msg = _order(seq, env)
        assert isinstance(msg.data, m.OrderData)
        await self.orders.execute(msg, msg.data)

    async def handed(self, step: int, incarnation: int) -> None:
        """Once the training handed off ``step`` saved by ``incarnation``."""
        await async_wait_until(lambda: lay.slot_incarnation(self.shm, step) == incarnation,
                               what=f"step {step} of incarnation {incarnation}")  # fmt: skip

    async def save_30(self) -> None:
        await asyncio.to_thread(self.go.write_text, "go")  # (blocks until the training reads)

    async def commit(self, step: int) -> list[int]:
        """The saver daemon commits ``step``; what the agent's tail reads then."""
        daemon.commit_one(self.shm, self.ckpt, step, 0.0, 3)
        return await self.tail.poll_commits()

    def reported(self) -> list[int]:
        return [d.step for d in self.sent if isinstance(d, m.CheckpointData)]

    def lines(self) -> list[tuple[int, int]]:
        text = (self.shm / lay.COMMITS_LOG).read_text()
        return [(r["step"], r["incarnation"]) for r in map(json.loads, text.splitlines())]


@pytest.fixture
async def pod(tmp_path: Path, the_reaper: reaper.Reaper, devnull: int) -> AsyncIterator[Pod]:
    p = Pod(tmp_path, the_reaper, devnull)
    async with p.sup:
        yield p


async def test_a_commit_of_the_abandoned_timeline_is_not_reported_after_a_restart(
    pod: Pod,
) -> None:
    """The bug: the daemon outlives the restart and commits the crashed incarnation's step 30
    after the job rewound to step 20. Reported, the master would count it for the new timeline.
    It is not; the new incarnation's own step 30 is."""
    await pod.order(3, {})  # incarnation 0
    await pod.handed(20, 0)
    assert await pod.commit(20) == [20] and pod.reported() == [20]
    await pod.save_30()
    await pod.handed(30, 0)  # handed off; its persist is slow
    await pod.order(5, {m.RESUME_STEP_ENV: "20"})  # the crash: a restart from step 20
    assert pod.link.current == commit_rule.Current(1, 20)
    assert await pod.commit(30) == [30]  # the old 30 persisted late: the daemon's line
    assert pod.reported() == [20]  # not reported
    await pod.save_30()
    await pod.handed(30, 1)
    assert await pod.commit(30) == [30]
    assert pod.reported() == [20, 30]  # the new timeline's 30
    assert pod.lines() == [(20, 0), (30, 0), (30, 1)]


async def test_after_a_container_restart_the_count_goes_on_and_the_old_timeline_is_not_reported(
    tmp_path: Path, the_reaper: reaper.Reaper, devnull: int
) -> None:
    """The agent died with its container (SIGKILL: nothing cleaned up), leaving the pod's shared
    memory: step 20 committed and reported, step 30 handed off and not yet persisted. The next
    agent's training is incarnation 1, not 0 again, so the old 30, persisted late after the job
    rewound to 20, is the abandoned timeline's and is not reported; the new 30 is. (Counted
    from 0, the old 30 was reported as the new one's.) The old commit line it reads anew before
    its first order is reported, as its predecessor did: the master has not rewound yet."""
    first = Pod(tmp_path, the_reaper, devnull, linked_start=True)
    async with first.sup:
        await first.order(3, {})
        await first.handed(20, 0)
        assert await first.commit(20) == [20] and first.reported() == [20]
        await first.save_30()
        await first.handed(30, 0)
    second = Pod(tmp_path, the_reaper, devnull, linked_start=True)
    assert await second.tail.poll_commits() == [20] and second.reported() == [20]
    async with second.sup:
        await second.order(2, {m.RESUME_STEP_ENV: "20"})  # the new master round: from 20
        assert second.sup.restart_count == 1
        assert second.link.current == commit_rule.Current(1, 20)
        assert await second.commit(30) == [30] and second.reported() == [20]  # the old 30
        await second.save_30()
        await second.handed(30, 1)
        assert await second.commit(30) == [30] and second.reported() == [20, 30]
    assert second.lines() == [(20, 0), (30, 0), (30, 1)]


def test_the_newest_incarnation_of_a_pods_shared_memory_is_its_slots_and_commit_lines(
    tmp_path: Path,
) -> None:
    shm = tmp_path / "shm"
    assert lay.newest_incarnation(shm) == lay.UNKNOWN  # nothing there
    api.Saver(api.SaverSettings(shm, tmp_path / "ckpt", incarnation=2)).save(
        4, {"w": torch.ones(4)}
    )
    assert lay.newest_incarnation(shm) == 2
    local = lay.local_dir(shm, 1)
    local.mkdir()
    (local / lay.COMMITS_LOG).write_text('{"step": 2, "incarnation": 5}\nnot json\n[1]\n'
                                         '{"step": 3, "incarnation": true}\n')  # fmt: skip
    assert lay.newest_incarnation(shm) == 5


async def test_a_commit_of_a_slot_that_does_not_say_its_incarnation_is_reported(
    tmp_path: Path,
) -> None:
    """Slots of an older Aegis (no incarnation) commit and are reported as before, after a
    restart too; an older incarnation's commit at the resume step is the shared history."""
    shm, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    the_link = link.MasterLink(SETTINGS)
    sent: list[m.Payload] = []

    async def send(kind: m.MessageType, data: m.Payload, round_: object = None) -> None:
        sent.append(data)

    the_link.send = send  # type: ignore[method-assign]
    the_link.begin_incarnation(commit_rule.Current(1, 20))
    tail = process.DaemonProcess(process.DaemonSettings(shm, ckpt),
                                 on_stamped_commit=the_link.checkpoint_committed)  # fmt: skip
    api.Saver(api.SaverSettings(shm, ckpt)).save(30, {"w": torch.ones(4)})
    slot = json.loads(lay.slot_json(shm, 30).read_text())
    del slot["incarnation"]  # as an older Aegis wrote it
    lay.slot_json(shm, 30).write_text(json.dumps(slot))
    daemon.commit_one(shm, ckpt, 30, 0.0, 3)
    old = api.Saver(api.SaverSettings(shm, ckpt, incarnation=0))
    old.save(20, {"w": torch.ones(4)})
    daemon.commit_one(shm, ckpt, 20, 0.0, 3)
    assert await tail.poll_commits() == [30, 20]
    assert [r["incarnation"] for r in map(json.loads, (shm / lay.COMMITS_LOG).open())] == [-1, 0]
    assert [d.step for d in sent if isinstance(d, m.CheckpointData)] == [30, 20]
