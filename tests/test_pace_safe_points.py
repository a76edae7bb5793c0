"""A slow pod's checkpoint request after the pace watch's round: it is due at the first step
after the restart, not at a step extrapolated from before the round (tests/test_slow_node_e2e.py
on a loaded machine: a 60-s troubleshoot round made the request name a step past the end of the
job, and the slow pod waited for the next periodic checkpoint)."""

from __future__ import annotations

from aegis.master.safe_points import RequestSettings, SafePoints
from aegis.wire import messages as m
from tests.core_helpers import Driver


def test_a_request_after_a_rewind_is_due_at_the_first_step_of_the_restarted_training() -> None:
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
    assert safe.target_step(now=160.0) == 0  # the next call saves
    assert safe.step_rate == 20.0  # the pace is still known for later requests
    env = {m.CKPT_STEP_ENV: str(safe.target_step(now=160.0))}
    assert env[m.CKPT_STEP_ENV] == "0"
