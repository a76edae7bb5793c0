"""A run whose NATS port was taken between choosing and binding it (another test's server, in
a full ``make test``): the embedded server chooses another port, and the run (its own bus, its
masters, its agents) must use that one. A clean clone's CI had all nine tests of
``tests/test_obs_master.py`` time out: the run had taken the server's address before starting
it, and its bus tried the port it first chose for 240 s."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.phases import Phase
from aegis.platforms import replicated_run
from aegis.platforms.local_run import RunSettings
from aegis.platforms.replicated_run import ReplicatedRun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_a_run_uses_the_port_its_server_chose_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[socket.socket] = []

    class Contested(EmbeddedNats):
        """A server whose first port someone else binds right after it was chosen."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            other = socket.socket()
            other.bind((self.host, self.port))
            other.listen()
            taken.append(other)

    monkeypatch.setattr(replicated_run, "EmbeddedNats", Contested)
    settings = RunSettings(command=(sys.executable, "-c", "print('trained')"), nodes=1,
                           spare_nodes=0, max_retry=0, job="taken", grace_s=2.0,
                           log_dir=tmp_path)  # fmt: skip
    run = ReplicatedRun(settings, 1, tmp_path)
    try:
        await asyncio.wait_for(run.start(), 60)  # (before: the bus retried the first port)
        [other] = taken
        first = other.getsockname()[1]
        assert run.nats_url == run.server.url and not run.nats_url.endswith(f":{first}")
        result = await asyncio.wait_for(run.wait(), 120)
        assert result.status.phase is Phase.SUCCEED, result.status
    finally:
        await run.close()
        for other in taken:
            other.close()
