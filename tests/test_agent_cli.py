"""``aegis agent`` as a real process: exit statuses, signals, grace period, zombies and orphans."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aegis.agent import runner
from aegis.spawn.ports import free_port
from tests import agent_waits as waits
from tests.waits import wait_until


def run_agent(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*waits.AGENT, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def start_agent(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*prefix, *waits.AGENT, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("script", "status"),
    [
        ("exit 0", 0),
        ("exit 1", 1),
        ("exit 7", 7),
        ("exit 255", 255),
        ("kill -9 $$", 128 + 9),
        ("kill -15 $$", 128 + 15),
    ],
)
def test_agent_exits_with_command_status_when_command_ends(script: str, status: int) -> None:
    assert run_agent("--", script).returncode == status


def test_agent_passes_output_through_when_command_prints() -> None:
    result = run_agent(
        "--", sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"
    )
    assert result.returncode == 0
    assert result.stdout == "out\n"
    assert "err\n" in result.stderr


def test_a_log_level_that_is_none_is_a_warning_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent is PID 1 of its pod: a mistyped AEGIS_LOG_LEVEL raised before the command
    started."""
    monkeypatch.setenv("AEGIS_LOG_LEVEL", "verbose")
    result = run_agent("--", "true")
    assert result.returncode == 0, result.stderr
    assert "AEGIS_LOG_LEVEL='verbose' is no log level" in result.stderr


@pytest.mark.parametrize("flags", [[], ["--no-prewarm"], ["--master", "127.0.0.1:{port}"]])
def test_a_prewarm_that_names_no_module_in_the_environment_is_a_warning_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    """``AEGIS_PREWARM`` comes from the pod's environment (under ``aegis run``, from the
    user's shell, and it wins over ``--prewarm``): one that names no module exited the agent
    2, and the run waited on a pod that never came. Now the pod runs (cold restarts); the
    agent warns only where warm restarts would be used (under --master)."""
    monkeypatch.setenv("AEGIS_PREWARM", "torch numpy")
    port = free_port()
    args = [f.format(port=port) for f in flags]
    result = run_agent(*args, "--connect-timeout-s", "0.5", "--", "echo trained")
    assert (result.returncode, result.stdout) == (0, "trained\n"), result.stderr
    warned = "AEGIS_PREWARM: not a module name: 'torch numpy'" in result.stderr
    assert warned is ("--master" in flags), result.stderr


def test_agent_exits_127_when_command_is_missing() -> None:
    result = run_agent("--", "/nonexistent/train", "--epochs", "3")
    assert result.returncode == 127
    assert "cannot execute /nonexistent/train" in result.stderr


def test_agent_exits_127_when_shell_string_names_missing_command() -> None:
    assert run_agent("--", "no-such-command-aegis --flag").returncode == 127


def test_agent_exits_126_when_command_is_not_executable(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    assert run_agent("--", str(script), "x").returncode == 126


def test_agent_forwards_sigterm_to_whole_group_when_agent_is_stopped(tmp_path: Path) -> None:
    proc = start_agent(
        "--grace-s", "10", "--", sys.executable, str(waits.BIN / "term_tree.py"), str(tmp_path)
    )
    pids = [int(p) for p in waits.read_line_with(proc, "READY").split()[1:]]
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 5  # the parent's own exit status on SIGTERM
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("term-*")) == sorted(pids)
    assert all(waits.really_gone(pid) for pid in pids)


def test_agent_kills_command_after_grace_when_command_ignores_sigterm() -> None:
    proc = start_agent("--grace-s", "0.5", "--", sys.executable, str(waits.BIN / "ignore_term.py"))
    pid = int(waits.read_line_with(proc, "READY").split()[1])
    stopped_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 128 + signal.SIGKILL
    assert time.monotonic() - stopped_at >= 0.5  # it waited the grace period first
    assert waits.really_gone(pid)


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
     # neither forwarded nor handled, these ended the agent and left the command running
     signal.SIGPWR, signal.SIGALRM, signal.SIGXCPU, signal.SIGWINCH, signal.SIGRTMIN + 3],
)  # fmt: skip
def test_agent_forwards_the_signal_when_agent_receives_it(sig: int) -> None:
    """Each forwarded signal reaches the command, which says which one it got."""
    script = (
        "import signal, sys, time\n"
        f"signal.signal({int(sig)}, lambda n, _: sys.exit(40 + n % 20))\n"
        "print('READY', flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    proc = start_agent("--", sys.executable, "-c", script)
    waits.read_line_with(proc, "READY")
    proc.send_signal(sig)
    assert finish(proc) == 40 + int(sig) % 20


def test_agent_keeps_sigpipe_to_itself_when_agent_receives_it() -> None:
    """SIGPIPE is the agent's own (its write to a closed pipe): ignored, not forwarded. The
    command ends on the SIGALRM sent after it, which it gets after any SIGPIPE forwarded first
    (a lower number: delivered first when both are pending)."""
    script = (
        "import signal, sys, time\n"
        "seen = []\n"
        "signal.signal(signal.SIGPIPE, lambda n, _: seen.append(n))\n"
        "signal.signal(signal.SIGALRM, lambda n, _: sys.exit(40 + len(seen)))\n"
        "print('READY', flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    proc = start_agent("--", sys.executable, "-c", script)
    waits.read_line_with(proc, "READY")
    proc.send_signal(signal.SIGPIPE)
    proc.send_signal(signal.SIGALRM)
    assert finish(proc) == 40


def test_agent_logs_hang_with_stack_when_command_stops_progressing() -> None:
    proc = start_agent(
        "--hang-timeout-s", "1", "--grace-s", "1", "--",
        sys.executable, str(waits.BIN / "hang.py"), "progress",
    )  # fmt: skip
    waits.read_line_with(proc, "no progress for", stderr=True)
    line = waits.read_line_with(proc, ("stuck_in_allreduce", "py-spy"), timeout_s=60, stderr=True)
    assert proc.poll() is None  # reported, not killed
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 128 + signal.SIGTERM
    if "stuck_in_allreduce" not in line:
        pytest.skip(f"py-spy cannot attach here: {line}")
    assert "hang.py" in line


def check_orphans_and_zombies(proc: subprocess.Popen[bytes], tmp_path: Path, ppid: int) -> None:
    ready = json.loads(waits.read_line_with(proc, "READY").split(" ", 1)[1])
    assert set(ready["orphans"].values()) == {ppid}  # re-parented to the agent
    assert proc.stdin is not None
    proc.stdin.close()  # the command exits 3, leaving its zombies and orphans to the agent
    assert finish(proc) == 3


def test_agent_reaps_zombies_and_orphans_when_agent_is_subreaper(tmp_path: Path) -> None:
    marker = str(tmp_path)
    proc = start_agent(
        "--grace-s", "2", "--", sys.executable, str(waits.BIN / "orphans.py"), marker
    )
    ready = json.loads(waits.read_line_with(proc, "READY").split(" ", 1)[1])
    assert set(ready["orphans"].values()) == {proc.pid}  # subreaper: orphans come to the agent
    command = waits.processes_with(marker)
    zombies = [int(pid) for pid in ready["zombies"]]
    assert all(waits.gone(pid) for pid in zombies)  # exited, not yet reaped by their parent
    assert proc.stdin is not None
    proc.stdin.close()
    assert finish(proc) == 3
    for pid in [*zombies, *(int(p) for p in ready["orphans"])]:
        assert waits.really_gone(pid), f"pid {pid} left behind"
    assert not [p for p in command if p.is_running()]
    assert waits.processes_with(marker) == []


ORPHAN_THAT_EXITS = """
import os, sys, time
middle = os.fork()
if middle == 0:
    middle = os.getpid()
    if os.fork() == 0:  # the grandchild: waits to be re-parented, says so, exits
        while os.getppid() == middle:
            time.sleep(0.01)
        print("ORPHAN", os.getpid(), os.getppid(), flush=True)
        os._exit(0)
    os._exit(0)
sys.stdin.read()  # the command itself runs on (and never waits for the middle one)
sys.exit(3)
"""


def test_agent_reaps_an_orphan_that_exits_while_the_command_still_runs() -> None:
    """Only the agent can reap it (it is the orphan's parent now); checked while it runs."""
    proc = start_agent("--", sys.executable, "-c", ORPHAN_THAT_EXITS)
    _, orphan, parent = waits.read_line_with(proc, "ORPHAN").split()
    assert int(parent) == proc.pid  # re-parented to the agent (its subreaper)
    wait_until(lambda: waits.really_gone(int(orphan)), what="the agent reaps the orphan")
    assert proc.poll() is None  # the agent (and the command) still run
    assert proc.stdin is not None
    proc.stdin.close()
    assert finish(proc) == 3


def unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="unshare --pid --fork --mount-proc is denied here")
def test_agent_reaps_zombies_and_orphans_when_agent_is_pid_1(tmp_path: Path) -> None:
    marker = str(tmp_path)
    proc = start_agent(
        "--grace-s",
        "2",
        "--",
        sys.executable,
        str(waits.BIN / "orphans.py"),
        marker,
        prefix=("unshare", "--pid", "--fork", "--mount-proc"),
    )
    check_orphans_and_zombies(proc, tmp_path, ppid=1)
    assert waits.processes_with(marker) == []


def test_agent_runs_independently_when_master_does_not_answer() -> None:
    port = free_port()
    result = run_agent(
        "--master", f"127.0.0.1:{port}", "--connect-timeout-s", "1", "--", "echo trained; exit 4"
    )
    assert result.returncode == 4
    assert result.stdout == "trained\n"
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert f"127.0.0.1:{port}" in warnings[0] and "independently" in warnings[0]


def test_agent_exits_2_when_master_address_is_malformed() -> None:
    assert run_agent("--master", "nohostport", "--", "true").returncode == 2


def test_agent_reports_fault_class_when_command_fails_with_known_signature() -> None:
    line = "RuntimeError: CUDA error: an illegal memory access was encountered"
    result = run_agent("--", sys.executable, "-c", f"import sys; sys.exit({line!r})")
    assert result.returncode == 1
    assert line in result.stderr  # passed through unchanged
    assert "fault class: cuda_error" in result.stderr


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({}, "--job, --pod and --token-file"),
        ({"job": "j", "pod": "j-0"}, "--token-file"),  # (it said all three before)
        ({"job": "j"}, "--pod and --token-file"),
    ],
)
def test_an_agent_short_of_flags_names_the_ones_it_lacks(given: dict[str, str], said: str) -> None:
    assert runner.MasterAddress("127.0.0.1", 1, **given).missing_flags() == said
