"""A slow pod's checkpoint request after the pace watch's round: its step lies ahead of where
the restarted training is, by this round's heartbeats; not a step extrapolated from before the
round (tests/test_slow_node_e2e.py on a loaded machine: a 60-s troubleshoot round made the
request name a step past the end of the job, and the slow pod waited for the next periodic
checkpoint), and not "the next call" (tests/test_cluster_e2e.py: the slow node's agent, stopped
part of every period, handed the request to its rank a step after the others had saved, and
ranks that saved different steps stalled each other into a counted hang)."""

from __future__ import annotations

from aegis.core import events as ev
from aegis.master.safe_points import RequestSettings, SafePoints
from aegis.wire import messages as m
from tests.core_helpers import Driver


def test_a_request_after_a_rewind_lies_ahead_of_the_restarted_trainings_first_steps() -> None:
    job = Driver(workers=3)
    job.to_running()
    safe = SafePoints("job", RequestSettings(lead_s=1.0))
    a, b, _ = job.pods
    seq = job.status.seq
    for pod in (a, b):
        safe.step_seen(job.status, pod, seq, 1700, now=100.0)
        safe.step_seen(job.status, pod, seq, 1720, now=101.0)  # 20 steps/s
    assert safe.target_step(now=160.0) == 1720 + 20 * 59 + 20 + 1  # extrapolated over 59 s
    safe.rewound()  # the restart after the round: training resumes from the committed step
    assert safe.step_rate == 20.0  # the pace is still known for later requests
    job.feed(ev.DrainRequested((job.pod(1),), "maintenance"))
    assert safe.request(job.status, now=160.0) is None  # no step of this round seen yet
    assert safe.request(job.status, now=165.0) is None
    safe.step_seen(job.status, a, job.status.seq, 1500, now=166.0)  # resumed from 1500
    env = safe.request(job.status, now=166.5)
    assert env is not None
    assert env[m.CKPT_STEP_ENV] == str(int(1500 + 20 * 0.5 + 20 * 1.0) + 1)
