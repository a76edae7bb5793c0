"""The agent under a master: fallback to independent mode, refusal of a wrong token."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_server import EmbeddedNats, free_port

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
