"""The owner of what a process leaves behind, named by pid namespace, pid and start time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aegis.spawn import owners


def test_a_directory_is_held_only_by_a_live_owner_of_this_pid_namespace(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    owners.claim(mine)  # made, and this process's
    assert owners.held(mine)
    assert [p.name for p in mine.iterdir()] == [owners.OWNER]  # no temporary file left
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    owners.claim(mine, pid=child.pid)  # claimed again: by the child now
    assert owners.held(mine)
    child.wait()
    assert not owners.held(mine)  # its owner is gone
    ns, pid = owners.pid_ns(), os.getpid()
    for text, held in [
        (f"{ns} {pid} {owners.started_ms(pid)}\n", True),
        (f"{ns} {pid} 1\n", False),  # the pid is another process's now
        (f"{ns + 1} {pid} {owners.started_ms(pid)}\n", False),  # another pid namespace's
        ("not an owner\n", False),
    ]:
        (mine / owners.OWNER).write_text(text)
        assert owners.held(mine) is held, text
    assert not owners.held(tmp_path / "none")  # no owner file (or no directory)
    assert owners.gone(pid, 1) and not owners.gone(pid, owners.started_ms(pid) or 0)


def test_a_process_named_for_any_host_is_known_gone_only_on_this_hosts_boot_and_namespace() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    named = owners.process_name(child.pid)
    boot, ns, pid, started = named.split()
    assert (boot, int(ns), int(pid)) == (owners.boot_id(), owners.pid_ns(), child.pid)
    assert boot and not owners.process_gone(owners.process_name())  # this one runs
    child.wait()
    assert owners.process_gone(named)
    for other in (
        f"{'0' * 8}-{boot[9:]} {ns} {pid} {started}",  # another host, or boot: not judged
        f"{boot} {int(ns) + 1} {pid} {started}",  # another pid namespace (a container)
        f" {ns} {pid} {started}",  # no boot id known
        "not a process",
    ):
        assert not owners.process_gone(other), other
