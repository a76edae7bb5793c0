"""Bootcheck's environment reports across pods: a version mismatch is flagged."""

from __future__ import annotations

from aegis.adapters import memory
from aegis.core.model import JobSpec, initial_status
from aegis.core.phases import Phase
from aegis.core.recovery import CheckType
from aegis.master.env_report import EnvironmentReport
from aegis.master.job_runner import JobRunner, JobSettings
from aegis.master.ports import NullPlatform
from aegis.wire import messages as m

LINE = (
    "python=3.11.7; torch={torch}; cuda=12.4; nccl=2.21.5; cudnn=90100; "
    "cuda_available=true; device_count=8; device_name=NVIDIA H100"
)


def _runner() -> JobRunner:
    spec = JobSpec("env", "default", 3, 1)
    return JobRunner(
        spec,
        initial_status(spec),
        bus=memory.MemoryBus(),
        store=memory.MemoryStore(),
        platform=NullPlatform(),
        settings=JobSettings(),
        log_dir=None,
    )


def _answer(pod: str, torch: str, seq: int = 1) -> m.Message:
    result = m.CheckResult(CheckType.RUNTIME, True, LINE.format(torch=torch), 0.1, 0.0)
    return m.Message(
        job="env",
        namespace="default",
        pod=pod,
        type=m.MessageType.FINISH,
        phase=Phase.BOOT_CHECKING,
        seq=seq,
        ts=0.0,
        data=m.ChecksData(m.CheckResponse([result])),
    )


def test_bootcheck_flags_multiple_versions_when_pods_differ() -> None:
    runner, report = _runner(), EnvironmentReport()
    for pod, torch in (("env-0", "2.13.0"), ("env-1", "2.12.1"), ("env-2", "2.13.0")):
        report.on_message(runner, _answer(pod, torch))
    assert report.warning is not None and "multiple versions" in report.warning
    assert "2.12.1 (env-1)" in report.warning


def test_bootcheck_is_quiet_when_every_pod_matches_and_waits_for_all() -> None:
    runner, report = _runner(), EnvironmentReport()
    report.on_message(runner, _answer("env-0", "2.13.0"))
    report.on_message(runner, _answer("env-1", "2.11.0"))
    assert report.warning is None  # not every pod has answered yet
    for pod in ("env-0", "env-1", "env-2"):
        report.on_message(runner, _answer(pod, "2.13.0", seq=4))  # a new round starts afresh
    assert report.warning is None
