"""The master tells the pods each new step the whole job committed (``CommittedData``), once
its record holds it: their savers keep that step and every newer one, so a pod ahead of one
whose store is down keeps the step the job resumes from."""

from __future__ import annotations

from aegis.master import job_record
from aegis.master.job_settings import status_key
from aegis.wire import codec
from aegis.wire import messages as m
from tests.test_job_runner import Harness, _to_running, harness, healthy  # noqa: F401 (the fixture)
from tests.waits import async_wait_until


def words(h: Harness) -> list[int]:
    return [o.data.step for o in h.orders if isinstance(o.data, m.CommittedData)]


async def test_each_new_committed_step_is_told_once_after_the_record_holds_it(
    harness: Harness,  # noqa: F811 (the fixture)
) -> None:
    h = harness
    stored_when_told: list[int] = []

    async def on_word(subject: str, payload: bytes) -> None:
        if isinstance(codec.decode(payload).data, m.CommittedData):
            got = await h.store.get(status_key(h.runner.spec))
            assert got is not None
            stored_when_told.append(job_record.decode(got[0]).committed_step)

    await h.bus.subscribe(h.runner.master_subject, on_word)
    await _to_running(h)
    await h.send("job-0", m.MessageType.CHECKPOINT, m.CheckpointData(5))
    await h.settle()
    assert words(h) == []  # one pod only: not the job's
    await h.send("job-1", m.MessageType.CHECKPOINT, m.CheckpointData(5))
    await async_wait_until(lambda: words(h) == [5], what="step 5 told")
    for pod in ("job-0", "job-1"):  # a repeated report commits nothing new
        await h.send(pod, m.MessageType.CHECKPOINT, m.CheckpointData(5))
    await h.send("job-0", m.MessageType.CHECKPOINT, m.CheckpointData(10))
    await h.send("job-1", m.MessageType.CHECKPOINT, m.CheckpointData(10))
    await async_wait_until(lambda: words(h) == [5, 10], what="step 10 told")
    await h.settle()
    assert words(h) == [5, 10] and stored_when_told == [5, 10]
    told = [o for o in h.orders if isinstance(o.data, m.CommittedData)]
    assert all(o.pod == "master" and o.type is m.MessageType.ORDER for o in told)


async def test_a_training_round_says_the_committed_step_again(harness: Harness) -> None:  # noqa: F811 (the fixture)
    """A pod that joined since the word was said (a replacement, a restarted agent) hears it
    with the round that starts its training."""
    h = harness
    await _to_running(h)  # the first round: nothing committed, nothing said
    for pod in ("job-0", "job-1"):
        await h.send(pod, m.MessageType.CHECKPOINT, m.CheckpointData(8))
    await async_wait_until(lambda: words(h) == [8], what="step 8 told")
    await h.send("job-1", m.MessageType.ERROR, m.ErrorData("crashed", exit_code=1))
    await h.settle()
    for pod in ("job-0", "job-1"):  # the troubleshooting round finds both healthy
        await h.send(pod, m.MessageType.FINISH, healthy())
    await async_wait_until(lambda: words(h) == [8, 8], what="the restart's word")
    kinds = [(o.seq, type(o.data).__name__) for o in h.orders][-2:]
    assert kinds[0][1] == "OrderData" and kinds[1] == (kinds[0][0], "CommittedData")
    restart = h.orders[-2].data
    assert isinstance(restart, m.OrderData) and restart.env[m.RESUME_STEP_ENV] == "8"
