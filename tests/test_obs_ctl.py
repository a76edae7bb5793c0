"""``aegis ctl`` against a running ``aegis run`` job: real nats-server with operator auth, the
master's control subscription, the CLI as a separate process with the run's control file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat
import sys
from pathlib import Path

import pytest

from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.cli import run_cmd
from aegis.core.phases import Phase
from aegis.master import control, control_file
from aegis.master.job_runner import JobRunner
from aegis.master.lease import LeaseSettings
from aegis.master.replica import Replica, ReplicaSettings
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

HANG = Path(__file__).parent / "bin" / "hang.py"
AEGIS = [sys.executable, "-m", "aegis.cli.main"]


async def ctl(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *AEGIS, "ctl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_ctl_taints_reports_a_hang_and_stops_a_running_job(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    settings = local_run.RunSettings(
        command=(sys.executable, str(HANG), "output"),  # never ends, never reports a hang
        nodes=2, spare_nodes=2, max_retry=3, job="ctl", log_dir=log_dir, grace_s=2.0,
    )  # fmt: skip
    observers = run_cmd.RunObservers(None)
    seen: dict[str, object] = {}

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        observers.attach(runner, platform)
        seen["runner"], seen["platform"] = runner, platform

    job = asyncio.create_task(local_run.run_local(settings, observe=observe))
    try:
        await async_wait_until(lambda: "runner" in seen, 60, "the job to start")
        runner, platform = seen["runner"], seen["platform"]
        assert isinstance(runner, JobRunner) and isinstance(platform, LocalPlatform)
        await async_wait_until(
            lambda: runner.status.phase is Phase.RUN_COMMAND, 90, "the job to run"
        )
        assert observers.control_ready is not None
        await asyncio.wait_for(observers.control_ready.wait(), 30)
        control_file = log_dir / "control.json"
        assert stat.S_IMODE(control_file.stat().st_mode) == 0o600
        assert json.loads(control_file.read_text())["jwt"]  # the master's credentials

        where = ("--log-dir", str(log_dir))
        code, out = await ctl("taint", "spare-0", "spare-1", "--reason", "bad fan", *where)
        assert code == 0, out
        assert platform.blacklist == {"spare-0": "bad fan", "spare-1": "bad fan"}
        code, out = await ctl("untaint", "spare-1", *where)
        assert code == 0 and platform.blacklist == {"spare-0": "bad fan"}, out

        code, out = await ctl("stop", "no-such-job", *where)
        assert code == 1 and "no job default/no-such-job" in out

        code, out = await ctl("hang", "ctl-1", *where)
        assert code == 0, out
        await async_wait_until(
            lambda: runner.status.phase is Phase.TROUBLESHOOTING, 30, "the hang to be handled"
        )
        assert runner.status.recover_count == 1
        info = runner.status.pod_infos["ctl-1"]  # type: ignore[index]
        assert info.slow and info.retries == 1

        code, out = await ctl("stop", "ctl", "--reason", "operator said so", *where)
        assert code == 0, out
        result = await asyncio.wait_for(job, 90)
    finally:
        if not job.done():
            job.cancel()
        observers.close()
    assert result.status.phase is Phase.FAILED and result.status.should_quit
    assert result.exit_code == 1
    assert not (log_dir / "control.json").exists()  # its credentials die with the run
    events = (log_dir / "events.jsonl").read_text()
    assert '"reason":"operator said so"' in events and '"type":"HangJudged"' in events


async def test_ctl_ends_with_exit_1_when_the_server_goes_away_while_it_waits(
    tmp_path: Path,
) -> None:
    """No master answers; the NATS server stops once ctl's request has reached it (ctl is then
    waiting for the reply): one line, exit 1, no hang."""
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    listener = await NatsBus.connect(server.url, None, name="test")
    arrived = asyncio.Event()

    async def on_request(subject: str, payload: bytes) -> None:
        arrived.set()

    await listener.subscribe(control.CONTROL_SUBJECT, on_request)
    target = control_file.ControlTarget(server.url, None, "default", "job")
    control_file.write_control_file(tmp_path / "control.json", target)
    proc = await asyncio.create_subprocess_exec(
        *AEGIS, "ctl", "stop", "job", "--log-dir", str(tmp_path), "--timeout-s", "5",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        await asyncio.wait_for(arrived.wait(), 60)
    finally:
        with contextlib.suppress(Exception):
            await listener.close()
        await asyncio.to_thread(server.stop)
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    assert proc.returncode == 1
    assert out.decode().strip().splitlines()[-1].startswith("aegis: error: ")


async def test_ctl_refused_by_the_server_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Credentials of another authority: the server refuses them; ctl says so in one line."""
    server = EmbeddedNats(Authority())
    await asyncio.to_thread(server.start)
    try:
        stranger = Authority().master_creds()
        target = control_file.ControlTarget(server.url, stranger, "default", "job")
        control_file.write_control_file(tmp_path / "control.json", target)
        proc = await asyncio.create_subprocess_exec(
            *AEGIS, "ctl", "stop", "job", "--log-dir", str(tmp_path), "--timeout-s", "5",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    finally:
        await asyncio.to_thread(server.stop)
    assert proc.returncode == 1, (out, err)
    lines = err.decode().strip().splitlines()
    assert lines == [f"aegis: error: {server.url} refused: Authorization Violation"], lines


@pytest.mark.parametrize("secure", [True, False])
@pytest.mark.parametrize("successor", [False, True])
async def test_a_master_replica_takes_its_control_file_with_its_lead(
    tmp_path: Path, successor: bool, secure: bool
) -> None:
    """A standalone ``aegis master`` writes ``control.json`` (its credentials) as it leads. A
    SIGTERM (its run cancelled) left the file, and ``aegis ctl`` waited on a master that was
    gone. Now the file goes with the lead, except one that a successor wrote since into the
    same directory (replicas share it): that one stays, even where the two files say the same
    (``--insecure`` replicas on one server have no credentials of their own)."""
    authority = Authority() if secure else None
    server = EmbeddedNats(authority)
    await asyncio.to_thread(server.start)
    path = tmp_path / "control.json"
    try:
        settings = ReplicaSettings(
            replica_id="m1", lease=LeaseSettings(lease_s=2.0), poll_s=0.05, log_dir=tmp_path
        )
        task = asyncio.create_task(Replica(authority, server.url, settings).run())
        await async_wait_until(path.exists, 60, "the leader's control file")
        mine = control_file.read_control_file(path)
        assert (mine.creds is not None) is secure
        if successor:  # what the next leader writes, as this one is stopped
            control_file.write_control_file(path, mine, writer="the successor")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await asyncio.to_thread(server.stop)
    assert path.exists() is successor
    assert [p.name for p in tmp_path.glob("control.json*")] == ["control.json"] * successor
