"""The agent under a master: fallback to independent mode, refusal of a wrong token, a hostile
master's refusal shown on one line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.grpc._generated import aegis_pb2_grpc
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_server import EmbeddedNats
from aegis.spawn.ports import free_port
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
    """What the executor reads of the training while a checkpoint request is pending."""

    def __init__(self, ever_stepped: bool = False) -> None:
        self.running = True
        self.last_step: int | None = None
        self.ever_stepped = ever_stepped  # an earlier incarnation reported steps

    def progress(self) -> Any:
        from aegis.agent import ports

        stepped = self.ever_stepped or self.last_step is not None
        return ports.Progress(step=self.last_step, ever_stepped=stepped)


async def _declined_within(training: _Training, deadline_s: float) -> list[str]:
    from aegis.agent import decline_rule, executor

    declined: list[str] = []

    async def decline() -> None:
        declined.append(decline_rule.REASON)

    task = asyncio.ensure_future(
        executor.decline_unless_taken(training, 0.3, decline, ended=lambda: False)
    )
    await asyncio.wait({task}, timeout=deadline_s)
    training.running = False  # ends the watch
    await task
    return declined


@pytest.mark.timing
async def test_a_script_that_never_reported_a_step_is_declined_when_silent() -> None:
    [declined] = await _declined_within(_Training(), deadline_s=5.0)
    assert "does not take checkpoint requests" in declined


@pytest.mark.timing
async def test_a_restarting_script_that_reported_steps_before_is_given_time() -> None:
    """The request comes with a restart; a slow node restarts slowly: no step for longer than
    decline_after_s is no reason to decline a script that reported steps before."""
    training = _Training(ever_stepped=True)
    assert await _declined_within(training, deadline_s=1.5) == []
    # once it steps on without taking requests, it is declined
    stepping = _Training(ever_stepped=True)

    async def steps() -> None:
        for step in range(1, 50):
            stepping.last_step = step
            await asyncio.sleep(0.05)

    stepper = asyncio.ensure_future(steps())
    [declined] = await _declined_within(stepping, deadline_s=5.0)
    stepper.cancel()
    assert "does not take checkpoint requests" in declined


@pytest.mark.parametrize(
    ("exit_status", "sig", "sent_class"),
    [
        (1, None, "python_traceback"),  # died of its uncaught exception: a software fault
        (137, 9, "killed"),  # the OOM killer after an earlier logged traceback
        (2, None, ""),  # an exit status of its own after printing a caught exception
    ],
)
def test_a_traceback_is_the_fault_only_when_it_is_what_ended_the_process(
    exit_status: int, sig: int | None, sent_class: str
) -> None:
    from aegis.agent import encode, ports

    match = ports.SignatureMatch("python_traceback", "python_traceback", "stderr", "KeyError: 3")
    evidence = ports.Evidence("python_traceback", (match,), ("KeyError: 3",))
    report = ports.ExitReport(
        1234, 0, exit_status, sig, ports.ExitReason.EXITED, evidence
    )  # fmt: skip
    sent = encode.exited(report, dying_reported=False)
    assert sent is not None
    kind, error = sent
    assert kind is m.MessageType.ERROR and isinstance(error, m.ErrorData)
    assert error.fault_class == sent_class and error.exit_code == exit_status
    assert "python_traceback: KeyError: 3" in error.lines  # the evidence travels in any case


class _HostileCreds(aegis_pb2_grpc.CredentialsServicer):
    """A 'master' whose refusal carries a newline, a forged agent line and escape sequences."""

    async def SyncWorkerCreds(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, FORGED)


FORGED = "no\naegis agent: forged line\x1b[2J\x1b]0;owned\x07\u202e"


async def test_a_masters_refusal_is_shown_on_one_line_escaped(tmp_path: Path) -> None:
    server = grpc.aio.server()
    aegis_pb2_grpc.add_CredentialsServicer_to_server(_HostileCreds(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        result = await asyncio.to_thread(_agent, tmp_path, f"127.0.0.1:{port}", "t", "echo never")
    finally:
        await server.stop(grace=None)
    assert result.returncode == 2
    assert "never" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aegis agent: error: the master refused"), lines
    assert "no\\naegis agent: forged line\\x1b[2J\\x1b]0;owned\\x07\\u202e" in lines[0]
    assert not any(c in result.stderr for c in ("\x1b", "\x07", "\u202e"))


def test_a_rejoining_agent_never_runs_the_command_alone_and_tries_again(tmp_path: Path) -> None:
    """A pod placed again in a running job (``--rejoin``: its platform says so) is of no use on
    its own: it keeps trying to reach its master (a node cut off for a while) until its
    platform retires it. Before, it ran the command independently and ended."""
    token_file = tmp_path / "token"
    token_file.write_text("t")
    marker = tmp_path / "ran"
    argv = [*AGENT, "--master", f"127.0.0.1:{free_port()}", "--job", "job-a", "--pod",
            "job-a-0", "--token-file", str(token_file), "--connect-timeout-s", "0.5", "--rejoin",
            "--", "touch", str(marker)]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        tries = []
        while len(tries) < 3:  # three tries, each ended by its own timeout
            line = proc.stderr.readline()
            assert line, f"the agent ended: {proc.wait()}"
            if "trying again" in line:
                tries.append(line)
        assert "this pod rejoins a running job" in tries[0]
        assert proc.poll() is None and not marker.exists()
    finally:
        proc.kill()
        proc.wait()
