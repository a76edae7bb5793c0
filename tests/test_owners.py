"""The owner of what a process leaves behind, named by boot, pid namespace, pid and start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil._pslinux
import pytest

from aegis.adapters import nats_server
from aegis.agent import watchdog
from aegis.spawn import owners


def test_what_a_live_owner_holds_stays_its_own_when_the_clock_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel moves the boot time when the clock is set (an NTP step; a slew, slowly), and
    a start time in seconds since the epoch is that boot time plus the ticks since boot. Named
    so, a live agent read again after the clock moved looked like another process: its
    checkpoint memory, its progress file and its NATS directory looked left over, and the next
    agent or server on the host removed them. Named by ticks since boot, they stay."""
    memory = tmp_path / "memory"
    owners.claim(memory)
    progress = watchdog.ProgressFile()
    server_dir = tmp_path / f"{nats_server.DIR_PREFIX}live"
    server_dir.mkdir()
    (server_dir / nats_server.OWNER).write_text(nats_server.owner_line(os.getpid()))
    booted = psutil._pslinux.boot_time()
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted - 1.0)  # the clock set
    try:
        assert owners.held(memory)
        assert os.path.basename(progress.path) not in watchdog.sweep_dead_owners(
            os.path.dirname(progress.path)
        )
        assert nats_server.sweep_abandoned(tmp_path) == [] and server_dir.is_dir()
    finally:
        progress.close()


def test_a_directory_is_held_only_by_a_live_owner_of_this_pid_namespace(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    owners.claim(mine)  # made, and this process's
    assert owners.held(mine)
    assert [p.name for p in mine.iterdir()] == [owners.OWNER]  # no temporary file left
    child = _waiting_child()
    owners.claim(mine, pid=child.pid)  # claimed again: by the child now
    assert owners.held(mine)
    _end(child)
    assert not owners.held(mine)  # its owner is gone
    ns, pid, boot = owners.pid_ns(), os.getpid(), owners.boot_id()
    ticks, other_boot = owners.start_ticks(pid), f"{'f' if boot[0] != 'f' else 'e'}{boot[1:]}"
    for text, held in [
        (f"boot={boot} ns={ns} pid={pid} ticks={ticks}\n", True),
        (f"boot={boot} ns={ns} pid={pid} ticks=1\n", False),  # the pid is another process's now
        (f"boot={other_boot} ns={ns} pid={pid} ticks={ticks}\n", False),  # of an earlier boot
        (f"boot={boot} ns={ns + 1} pid={pid} ticks={ticks}\n", False),  # another pid namespace's
        (f"boot={boot} ns={ns} pid=0 ticks={ticks}\n", False),
        # an older version's: "<pid ns> <pid> <start ms>", judged as it was
        (f"{ns} {pid} {owners.started_ms(pid)}\n", True),
        (f"{ns} {pid} 1\n", False),
        (f"{ns + 1} {pid} {owners.started_ms(pid)}\n", False),
        ("not an owner\n", False),
    ]:
        (mine / owners.OWNER).write_text(text)
        assert owners.held(mine) is held, text
    assert not owners.held(tmp_path / "none")  # no owner file (or no directory)
    assert owners.legacy_gone(pid, 1) and not owners.legacy_gone(pid, owners.started_ms(pid) or 0)


def test_a_process_named_for_any_host_is_known_gone_only_on_this_hosts_boot_and_namespace() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    named = owners.process_name(child.pid)
    boot, ns, pid = owners.boot_id(), owners.pid_ns(), child.pid
    ticks = owners.start_ticks(child.pid)  # since boot: no wall clock
    assert named == f"boot={boot} ns={ns} pid={pid} ticks={ticks}"
    assert boot and not owners.process_gone(owners.process_name())  # this one runs
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not collected yet
    assert owners.zombie(child.pid) and owners.process_gone(named)  # gone all the same
    child.wait()
    assert not owners.zombie(child.pid) and owners.process_gone(named)
    other_boot = f"{'f' if boot[0] != 'f' else 'e'}{boot[1:]}"
    earlier = f"boot={other_boot} ns={ns} pid={pid} ticks={ticks}"
    assert owners.process_gone(earlier, local=True)  # found in this host's files: rebooted since
    for other in (
        f"boot={other_boot} ns={ns} pid={pid} ticks={ticks}",  # another host, or boot
        f"boot={boot} ns={ns + 1} pid={pid} ticks={ticks}",  # another pid namespace (a container)
        f"boot= ns={ns} pid={pid} ticks={ticks}",  # no boot id known
        f"boot={boot} ns={ns} pid=0 ticks={ticks}",  # no process's pid
        f"{boot} {ns} {pid} {ticks}",  # another form (another version's): not judged
        "not a process",
    ):
        assert not owners.process_gone(other), other
    # which of them this host cannot judge (a new run asks the bus for those: ``master.ping``)
    assert not owners.elsewhere(named) and not owners.elsewhere(owners.process_name())
    assert owners.elsewhere(earlier)  # another host's, or this one's before a restart
    assert owners.elsewhere(f"boot={boot} ns={ns + 1} pid={pid} ticks={ticks}")  # a container's
    assert owners.elsewhere(f"boot= ns={ns} pid={pid} ticks={ticks}")
    assert not owners.elsewhere(f"{boot} {ns} {pid} {ticks}")  # another form: judged as before
    assert not owners.elsewhere("not a process")


def test_a_process_whose_start_cannot_be_read_is_not_known_gone() -> None:
    """Another user's process where /proc hides it (``hidepid``): it exists (signalling it is
    refused, not failed) but its start is unreadable: not gone. Its pid reused: gone."""
    me = owners.process_name()
    hidden = owners.process_gone(me, exists_now=lambda pid: True, seen_of=lambda pid: None)
    assert not hidden
    reused = owners.process_gone(me, exists_now=lambda pid: True, seen_of=lambda pid: (1, False))
    assert reused
    ticks = owners.start_ticks(os.getpid())
    assert ticks is not None and owners.seen(os.getpid()) == (ticks, False)
    assert not owners.process_gone(me, seen_of=lambda pid: (ticks, False))
    assert owners.process_gone(me, seen_of=lambda pid: (ticks, True))  # ended, not collected
    assert owners.process_gone(me, exists_now=lambda pid: False)
    assert owners.exists(os.getpid()) and not owners.exists(_a_gone_pid())


def _waiting_child() -> subprocess.Popen[bytes]:
    """A process that lives until :func:`_end` (one that exits at once may be a zombie, gone,
    before the test looks at it)."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip


def _end(child: subprocess.Popen[bytes]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    child.wait(60)


def _a_gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
