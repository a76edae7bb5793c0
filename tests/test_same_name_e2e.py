"""End to end: ``aegis run --nats URL`` under a job name already used on that NATS server (its
status store keeps every job's record). A plain script that never imports aegis.

- While a run of that name is not over, a second one is refused in one line (exit 1), having
  started nothing; the first one goes on to its end.
- Once it has ended, the name is free: the next run of it replaces the ended job's record (it
  crashed with the store's conflict before).
- A run killed in another container (a pid namespace of its own: this host cannot tell whether
  its master lives): no master answers for its job, and the next run takes the name; a live one
  there answers, and keeps it.
- Two runs of other names on one server: ``aegis ctl`` with one run's control file reaches that
  run's master only (both answered, and the other's "no job" often came first).

About the shared-host mode itself: the emulated cluster runs its own NATS (``--isolate-nodes``
refuses ``--nats``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aegis.adapters.nats_server import EmbeddedNats
from tests.cluster import AEGIS, PLAIN_DDP, ctl, leftovers
from tests.test_agent_cli import unshare_works
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _argv(url: str, where: Path, *script: str, job: str = "same") -> list[str]:
    return [*AEGIS, "run", "--nats", url, "--job", job, "--nodes", "1", "--view", "plain",
            "--log-dir", str(where / "logs"), "--status-file", str(where / "status.json"), "--",
            sys.executable, str(PLAIN_DDP), "--steps", "5", "--step-time-s", "0",
            "--ckpt-dir", str(where / "ckpt"), *script]  # fmt: skip


def _run(url: str, where: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_argv(url, where), capture_output=True, text=True, timeout=240,
                          check=False, stdin=subprocess.DEVNULL)  # fmt: skip


def _phase(where: Path) -> str:
    return str(json.loads((where / "status.json").read_text())["status"]["phase"])


async def _start_waiting(
    url: str, where: Path, gate: Path, job: str = "same", *, inside: tuple[str, ...] = ()
) -> asyncio.subprocess.Process:
    """A run whose script waits for ``gate`` before training; returned once it is started (its
    output in ``<where>.out``). ``inside``: the command it runs under (a container's)."""
    said = where.with_suffix(".out")
    with said.open("wb") as out:
        running = await asyncio.create_subprocess_exec(
            *inside, *_argv(url, where, "--prepare-until", str(gate), job=job),
            stdout=out, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    try:
        await async_wait_until(lambda: "phase RunCommand" in said.read_text(), 180,
                               "the run's script started", seen=said.read_text)  # fmt: skip
    except BaseException:
        running.kill()
        await running.wait()
        raise
    return running


async def _refused_while_live(
    url: str, tmp_path: Path, why: str, *, inside: tuple[str, ...] = ()
) -> None:
    """A run of the name started (under ``inside``), a second run refused in one line (``why``)
    with no pod started, then the first run let go to its end: Succeed."""
    first, second, gate = tmp_path / "first", tmp_path / "second", tmp_path / "go"
    running = await _start_waiting(url, first, gate, inside=inside)
    try:
        refused = await asyncio.to_thread(_run, url, second)
        assert refused.returncode == 1, refused
        assert refused.stderr.splitlines() == [
            f"aegis: error: job default/same in the status store of {url} {why}; run it under "
            "another --job"
        ], refused.stderr
        assert not (second / "logs" / "pods").exists()  # no pod of it started
        assert leftovers(second / "logs") == []
        gate.touch()
        assert await asyncio.wait_for(running.wait(), 240) == 0
    finally:
        if running.returncode is None:
            running.kill()
            await running.wait()
    assert _phase(first) == "Succeed"


async def _killed_then_run_again(
    url: str, tmp_path: Path, *, inside: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """A run of the name SIGKILLed (under ``inside``) mid-job, its pods gone; then the next run
    of the name, which succeeds (returned)."""
    killed, after = tmp_path / "killed", tmp_path / "after"
    running = await _start_waiting(url, killed, tmp_path / "never", inside=inside)
    running.kill()
    await running.wait()
    await async_wait_until(lambda: leftovers(killed / "logs") == [], 60, "its pods gone",
                           seen=lambda: leftovers(killed / "logs"))  # fmt: skip
    again = await asyncio.to_thread(_run, url, after)
    assert again.returncode == 0, again.stderr
    assert _phase(after) == "Succeed"
    assert leftovers(after / "logs") == []
    return again


async def test_a_name_in_use_is_refused_in_one_line_and_free_again_at_the_jobs_end(
    tmp_path: Path, open_nats: EmbeddedNats
) -> None:
    why = ("is not over (phase RunCommand): another run leads it, or one on another host or "
           "container was killed before its end")  # fmt: skip
    await _refused_while_live(open_nats.url, tmp_path, why)
    third = tmp_path / "third"
    again = await asyncio.to_thread(_run, open_nats.url, third)  # the name is free again
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr
    assert _phase(third) == "Succeed"
    assert leftovers(tmp_path / "first" / "logs") == leftovers(third / "logs") == []


async def test_the_name_of_a_killed_runs_job_is_free_once_the_run_is_gone(
    tmp_path: Path, open_nats: EmbeddedNats
) -> None:
    """A SIGKILLed run cannot end its job's record (RunCommand for ever): the next run of the
    name on this host sees that the master which created it is gone, and replaces it."""
    again = await _killed_then_run_again(open_nats.url, tmp_path)
    assert "nobody answered" not in again.stderr  # judged here: nothing asked


# Another container of this host: a pid namespace of its own (its processes' pids say nothing
# here), all of it SIGKILLed when ``unshare`` is (its first process gets the signal, and the
# namespace ends with it).
CONTAINER = ("unshare", "--pid", "--mount-proc", "--kill-child")
IN_A_CONTAINER = pytest.mark.skipif(not unshare_works(), reason="unshare --pid is denied here")


@IN_A_CONTAINER
async def test_the_name_of_a_run_killed_in_another_container_is_free_when_no_master_answers(
    tmp_path: Path, open_nats: EmbeddedNats
) -> None:
    """This host cannot tell whether the master that created the job lives (another pid
    namespace, or another host): it was refused for ever, and freed by hand (``nats kv del``).
    Now a new run asks on the control subject whether a master leads the job; none answers
    within 10 s, and no pod of it reports, so it takes the name."""
    again = await _killed_then_run_again(open_nats.url, tmp_path, inside=CONTAINER)
    assert "nobody answered for the run on another host or container" in again.stderr


@IN_A_CONTAINER
async def test_a_live_run_in_another_container_keeps_its_name(
    tmp_path: Path, open_nats: EmbeddedNats
) -> None:
    """Its master answers that it leads the job: the new run is refused, and the first one goes
    on to its end."""
    why = "is led by a run on another host or container (its master answers for it)"
    await _refused_while_live(open_nats.url, tmp_path, why, inside=CONTAINER)


async def test_ctl_with_a_runs_control_file_reaches_that_runs_master_only(
    tmp_path: Path, open_nats: EmbeddedNats
) -> None:
    """Runs of jobs ``one`` and ``two`` on one server. Every master answered every request on
    the one control subject: a ``stop one`` sent with run two's file stopped run one, and a
    ``hang one-0`` sent with run one's file was answered "no pod one-0" by run two as often as
    not (exit 1), while run one counted the fault (a user who tried again counted another)."""
    one, two = tmp_path / "one", tmp_path / "two"
    gate = tmp_path / "go"
    runs = [await _start_waiting(open_nats.url, one, gate, job="one")]
    try:
        runs.append(await _start_waiting(open_nats.url, two, gate, job="two"))
        for _ in range(3):  # either answer could come first
            said = await ctl("stop", "one", "--log-dir", str(two / "logs"))
            assert said == "1: aegis ctl: no job default/one\n", said
        assert runs[0].returncode is None and "control: stop" not in _said(one)
        said = await ctl("stop", "one", "--log-dir", str(one / "logs"))
        assert said == "0: aegis ctl: job one: stop requested\n", said
        assert await asyncio.wait_for(runs[0].wait(), 120) == 1
        assert _said(one).count("control: stop one -> job one: stop requested") == 1
        assert _said(two).count("control: stop one") == 3  # those sent to it only
        gate.touch()
        assert await asyncio.wait_for(runs[1].wait(), 240) == 0
    finally:
        for running in runs:
            if running.returncode is None:
                running.kill()
                await running.wait()
    assert (_phase(one), _phase(two)) == ("Failed", "Succeed")
    assert leftovers(one / "logs") == leftovers(two / "logs") == []


def _said(where: Path) -> str:
    return where.with_suffix(".out").read_text()
