"""SOAK (3 minutes in ``make test``; ``AEGIS_SOAK_S`` for longer, e.g. 7200): a standalone
master serving jobs submitted and ended every few seconds, polling its buckets ten times a
second (the old watcher per poll filled the status bucket's 1,000 consumers within a minute of
this). Every job must be adopted, by the
first poll that began after it was stored; the consumers of every bucket stay bounded; the
records of ended jobs are removed after a retention (30 s here), so the bucket holds the live
jobs and the recently ended ones, not every job ever run. The figures (polls, consumers,
adoption latency, records) are printed for ``benchmarks/RESULTS.md``.

Jobs are submitted as ``aegis run --masters`` does (``ServedJob``: the platform served over
NATS, then the first record) and end by their platform's quit event (a stop from outside)."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass

import psutil
import pytest

from aegis.core import events as ev
from aegis.core.model import JobSpec
from aegis.core.phases import TERMINAL_PHASES
from aegis.master.ports import NullPlatform
from aegis.platforms.served_job import ServedJob
from tests.poll_helpers import Master, consumer_counts, leads, standalone_master
from tests.waits import async_wait_until

SOAK_S = float(os.environ.get("AEGIS_SOAK_S", "180"))
KEEP_S = 30.0  # the records of ended jobs are removed after this: the bucket stays small
PACE_S = 2.0  # a job submitted (and one ended) every PACE_S: the load, not a synchronisation
LIVE = 3  # jobs running at once

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(int(SOAK_S) + 300)]


@dataclass
class Submitted:
    served: ServedJob
    key: str
    at: float  # monotonic, once its record was stored
    polls_before: int  # adoption polls begun by then
    adopted_s: float = -1.0


async def _submit(master: Master, index: int) -> Submitted:
    spec = JobSpec(job=f"soak-{index:04d}", namespace="default", worker_num=2, max_retry=1)
    served = await ServedJob.submit(
        master.bus, master.store, spec, ["node-0", "node-1"], NullPlatform()
    )
    job = Submitted(served, f"default.{spec.job}", time.monotonic(), master.polls.started["jobs"])
    await async_wait_until(lambda: leads(master, job.key), what=f"{job.key} adopted")
    job.adopted_s = time.monotonic() - job.at
    return job


async def _end(job: Submitted) -> None:
    job.served.server.sink(ev.QuitRequested("soak: the job is over"))

    async def ended() -> bool:
        return (await job.served.status()).phase in TERMINAL_PHASES

    await async_wait_until(ended, what=f"{job.key} to end")
    await job.served.close()  # the submitter's own subscription goes too


async def test_soak_a_standalone_master_adopts_every_job_and_its_consumers_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with standalone_master(monkeypatch, poll_s=0.1, keep_ended_s=KEEP_S) as master:
        rss_start = psutil.Process().memory_info().rss
        jobs: list[Submitted] = []
        live: list[Submitted] = []
        peak: dict[str, int] = {}
        listed_peak = 0  # records in the status bucket
        start = time.monotonic()
        while time.monotonic() - start < SOAK_S:
            job = await _submit(master, len(jobs))
            jobs.append(job)
            live.append(job)
            if len(live) > LIVE:
                await _end(live.pop(0))
            for bucket, count in (await consumer_counts(master.bus)).items():
                peak[bucket] = max(peak.get(bucket, 0), count)
            listed_peak = max(listed_peak, len(await master.store.keys()))
            await asyncio.sleep(PACE_S)  # pacing the load (nothing waits on it)
        for job in live:
            await _end(job)
        runners = list(master.replica.runners.values())
        await async_wait_until(
            lambda: all(r.done.is_set() for r in runners), what="every job's loop over"
        )
        # a master serving for days keeps only the running jobs (and their subscriptions)
        await async_wait_until(
            lambda: not master.replica.runners, what="every ended job's runner dropped"
        )
        assert (
            not any(r.subscribed for r in runners)
            and not master.replica.platform_events.subscriptions
        )
        # ended jobs leave only their keys behind (a refresh in flight may keep one or two)
        assert len(master.replica.records) <= LIVE, len(master.replica.records)
        # every ended job's record is removed after the retention, none before it is seen ended
        await async_wait_until(
            lambda: master.replica.removed == len(jobs), KEEP_S + 60, "every record removed"
        )
        assert not master.replica.finished and await master.store.keys() == []
        # the bucket held the live jobs and those ended within KEEP_S (one ends every PACE_S
        # or slower), never every job ever run
        assert listed_peak <= LIVE + 1 + KEEP_S / PACE_S + 5, listed_peak
        _report(master, jobs, peak, time.monotonic() - start, rss_start, listed_peak)

        polls = master.polls
        assert all(count <= 2 for count in peak.values()), peak
        for job in jobs:  # adopted by the first poll begun after it was stored (or the next
            # one, for each poll that failed: none expected)
            assert polls.adopted_at[job.key] == polls.first_listed[job.key], job.key
            assert polls.first_listed[job.key] <= job.polls_before + 1 + polls.failed["jobs"]
        assert polls.failed == {}, polls.failed
        assert master.replica.malformed.count == 0


def _report(
    master: Master,
    jobs: list[Submitted],
    peak: dict[str, int],
    took_s: float,
    rss_start: int,
    listed_peak: int,
) -> None:
    latencies = sorted(job.adopted_s for job in jobs)
    rss_mib = (psutil.Process().memory_info().rss - rss_start) / 2**20
    print(
        f"\nsoak: {took_s:.0f} s, {len(jobs)} jobs, polls {dict(master.polls.started)}, "
        f"failed {dict(master.polls.failed)}, peak consumers {peak}, adoption latency "
        f"median {statistics.median(latencies):.3f} s max {latencies[-1]:.3f} s, "
        f"test process RSS {rss_mib:+.1f} MiB, records in the bucket at most {listed_peak}, "
        f"removed {master.replica.removed}"
    )
