"""The agent under a master: fallback to independent mode, refusal of a wrong token."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_server import EmbeddedNats, free_port
from aegis.core.phases import Order, Phase
from aegis.wire import messages as m

AGENT = [sys.executable, "-m", "aegis", "agent"]


def _agent(tmp_path: Path, master: str, token: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    return subprocess.run(
        [
            *AGENT,
            "--master",
            master,
            "--job",
            "job-a",
            "--pod",
            "job-a-0",
            "--token-file",
            str(token_file),
            "--connect-timeout-s",
            "2",
            "--",
            *cmd,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_agent_with_unreachable_master_runs_command_independently(tmp_path: Path) -> None:
    result = _agent(tmp_path, f"127.0.0.1:{free_port()}", "t", "echo alone; exit 7")
    assert result.returncode == 7
    assert result.stdout == "alone\n"
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "independently" in warnings[0]


@pytest.fixture
async def creds_target(nats_server: EmbeddedNats, authority: Authority) -> AsyncIterator[str]:
    access = grpc_creds.JobAccess("default", "job-a", "right", ("job-a-0",))
    server, port = await grpc_creds.serve(authority, nats_server.url, lambda ns, job: access)
    yield f"127.0.0.1:{port}"
    await server.stop(grace=None)


async def test_agent_with_wrong_token_is_refused_with_one_line_and_exit_2(
    tmp_path: Path, creds_target: str
) -> None:
    import asyncio

    result = await asyncio.to_thread(_agent, tmp_path, creds_target, "wrong", "echo never")
    assert result.returncode == 2
    assert "never" not in result.stdout
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and "refused" in errors[0] and "wrong bootstrap token" in errors[0]


class _Training:
    """What the link reads of the supervisor while a checkpoint request is pending."""

    def __init__(self) -> None:
        self.running = True
        self.takes_checkpoint_requests = False
        self.last_step: int | None = None


async def _declined_within(
    the_link: Any, training: _Training, deadline_s: float
) -> list[m.CheckpointDeclinedData]:
    sent: list[m.CheckpointDeclinedData] = []

    async def send(kind: m.MessageType, phase: Phase, seq: int, data: m.Payload) -> None:
        if isinstance(data, m.CheckpointDeclinedData):
            sent.append(data)

    the_link._send = send
    order = m.Message(
        job="j", namespace="ns", pod="j-0", type=m.MessageType.ORDER, phase=Phase.RUN_COMMAND,
        seq=4, ts=0.0, data=m.OrderData(Order.CHECKPOINT),
    )  # fmt: skip
    task = asyncio.ensure_future(the_link._decline_unless_taken(training, order, 4))
    await asyncio.wait({task}, timeout=deadline_s)
    training.running = False  # ends the watch
    await task
    return sent


@pytest.mark.timing
async def test_a_script_that_never_reported_a_step_is_declined_when_silent() -> None:
    from aegis.agent import link

    the_link = link.MasterLink(
        link.LinkSettings("127.0.0.1:1", "ns", "j", "j-0", "t", decline_after_s=0.3)
    )
    [declined] = await _declined_within(the_link, _Training(), deadline_s=5.0)
    assert "does not take checkpoint requests" in declined.reason


@pytest.mark.timing
async def test_a_restarting_script_that_reported_steps_before_is_given_time() -> None:
    """The request comes with a restart; a slow node restarts slowly: no step for longer than
    decline_after_s is no reason to decline a script that reported steps before."""
    from aegis.agent import link

    the_link = link.MasterLink(
        link.LinkSettings("127.0.0.1:1", "ns", "j", "j-0", "t", decline_after_s=0.3)
    )
    the_link.ever_stepped = True  # an earlier incarnation reported steps
    training = _Training()
    assert await _declined_within(the_link, training, deadline_s=1.5) == []
    # once it steps on without taking requests, it is declined
    the_link2 = link.MasterLink(
        link.LinkSettings("127.0.0.1:1", "ns", "j", "j-0", "t", decline_after_s=0.3)
    )
    the_link2.ever_stepped = True
    stepping = _Training()

    async def steps() -> None:
        for step in range(1, 50):
            stepping.last_step = step
            await asyncio.sleep(0.05)

    stepper = asyncio.ensure_future(steps())
    [declined] = await _declined_within(the_link2, stepping, deadline_s=5.0)
    stepper.cancel()
    assert "does not take checkpoint requests" in declined.reason


@pytest.mark.parametrize(
    ("exit_status", "sig", "sent_class"),
    [
        (1, None, "python_traceback"),  # died of its uncaught exception: a software fault
        (137, 9, "killed"),  # the OOM killer after an earlier logged traceback
        (2, None, ""),  # an exit status of its own after printing a caught exception
    ],
)
async def test_a_traceback_is_the_fault_only_when_it_is_what_ended_the_process(
    exit_status: int, sig: int | None, sent_class: str
) -> None:
    from aegis.agent import link, ports

    the_link = link.MasterLink(link.LinkSettings("127.0.0.1:1", "ns", "j", "j-0", "t"))
    sent: list[m.ErrorData] = []

    async def send(kind: m.MessageType, phase: Phase, seq: int, data: m.Payload) -> None:
        assert isinstance(data, m.ErrorData)
        sent.append(data)

    the_link._send = send  # type: ignore[method-assign]
    match = ports.SignatureMatch("python_traceback", "python_traceback", "stderr", "KeyError: 3")
    evidence = ports.Evidence("python_traceback", (match,), ("KeyError: 3",))
    report = ports.ExitReport(
        1234, 0, exit_status, sig, ports.ExitReason.EXITED, evidence
    )  # fmt: skip
    await the_link.child_exited(report)
    [error] = sent
    assert error.fault_class == sent_class and error.exit_code == exit_status
    assert "python_traceback: KeyError: 3" in error.lines  # the evidence travels in any case
