"""A real, private Slurm cluster for the tests: munged, slurmctld and three slurmd daemons.

Everything runs as root inside a private network namespace (``unshare -n``; ``lo`` up with
127.0.0.2 added) so nothing touches the host's network or a real cluster, and every path
(config, state, spool, pid and log files, munge socket and key) is under a temporary directory.
The three nodes ``n1..n3`` are three ``slurmd -N`` instances on this one machine (Debian's
slurmd is built with ``--enable-multiple-slurmd``), each on its own port. Commands such as
``sbatch`` and ``sinfo`` run in the namespace through ``nsenter``.

``why_unavailable()`` says in one line why such a cluster cannot run here (not root, no
unshare, Slurm or munge not installed); the tests skip with that reason.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

NODES = ("n1", "n2", "n3")
TOOLS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "sinfo", "scontrol")


def why_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm tests start slurmctld/slurmd/munged and need root"
    missing = [tool for tool in (*TOOLS, "unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}; .ci/run installs them)"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"unshare -n denied here: {probe.stderr.decode(errors='replace').strip()}"
    return None


def slurm_conf(root: Path, ctld_port: int, slurmd_ports: Sequence[int]) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=4 "
        "RealMemory=1000 State=UNKNOWN"
        for name, port in zip(NODES, slurmd_ports, strict=True)
    )
    return f"""\
ClusterName=aegistest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
JobRequeue=1
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _die_with_parent() -> None:
    """A daemon gets SIGTERM when the test process dies, so a crashed run leaves none behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _free_ports(count: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class SlurmCluster:
    """Start with ``start()``, stop with ``stop()``; ``run(argv)`` inside the namespace."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.holder: subprocess.Popen[bytes] | None = None
        self.daemons: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _ns(self, argv: Sequence[str]) -> list[str]:
        assert self.holder is not None
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", *argv]

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        merged = self.env | dict(env or {})
        result = subprocess.run(
            self._ns(argv), capture_output=True, text=True, env=merged, check=False, timeout=60
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
        return result

    def _daemon(self, argv: Sequence[str], log_name: str) -> None:
        self.daemons.append(self.spawn(argv, log_name))

    def spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        """A long-running process inside the namespace (it dies with the test process)."""
        with (self.root / "log" / log_name).open("ab") as out:
            return subprocess.Popen(
                self._ns(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def start(self, timeout_s: float = 60.0) -> None:
        for sub in ("munge", "state", "run", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        ports = _free_ports(1 + len(NODES))
        self.conf.write_text(slurm_conf(self.root, ports[0], ports[1:]))
        setup = "ip link set lo up && ip addr add 127.0.0.2/8 dev lo && exec cat"
        self.holder = subprocess.Popen(
            ["unshare", "-n", "bash", "-c", setup], stdin=subprocess.PIPE, start_new_session=True
        )
        self._wait(self._lo_up, timeout_s, "the namespace's loopback")
        key = self.root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, timeout=30)
        munge = self.root / "munge"
        self._daemon(
            ["munged", "-F", "--force", f"--socket={munge}/munge.socket", f"--key-file={key}",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"],
            "munged.out",
        )  # fmt: skip
        self._wait((munge / "munge.socket").exists, timeout_s, "munged")
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for node in NODES:
            self._daemon(["slurmd", "-D", "-N", node, "-f", str(self.conf)], f"slurmd.{node}.out")
        self._wait(self._all_idle, timeout_s, "every node idle in sinfo")

    def _lo_up(self) -> bool:
        if self.holder is None or self.holder.poll() is not None:
            raise AssertionError("unshare -n failed")
        argv = self._ns(["ip", "-o", "addr", "show", "dev", "lo"])
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        return "127.0.0.2" in out.stdout

    def _all_idle(self) -> bool:
        for daemon in self.daemons:
            if daemon.poll() is not None:
                raise AssertionError(f"{daemon.args} exited: {self.logs()}")
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    def node_state(self, node: str) -> tuple[str, str]:
        """(state, reason) as ``sinfo`` shows them."""
        out = self.run(["sinfo", "-h", "-n", node, "-N", "-o", "%T|%E"]).stdout.strip()
        state, _, reason = out.partition("|")
        return state, reason

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    @staticmethod
    def _wait(condition: object, timeout_s: float, what: str) -> None:
        assert callable(condition)
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.05)

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if self.holder is not None:
            assert self.holder.stdin is not None
            self.holder.stdin.close()
            self.holder.wait(timeout=10)
