"""A real, private Slurm cluster for the tests: munged, slurmctld and three slurmd daemons, each
slurmd on a host of its own.

Everything runs as root inside a private namespace made for the cluster (``unshare --net --mount
--uts``: nothing touches the host's network or a real cluster) and every path (config, state,
spool, pid and log files, munge socket and key) is under a temporary directory, as a cluster
file system would be. The namespaces are those of ``aegis run --isolate-nodes``
(:class:`aegis.platforms.emulated.EmulatedCluster`, made by a holder process inside the
cluster's namespace): a bridge with 198.18.0.1, where ``slurmctld`` and ``munged`` run (hostname
``aegis-master``), and per node ``n1..n3`` a process holding its own network namespace (its
loopback, one address on the bridge: 198.18.0.10..12), mount namespace (a private ``/dev/shm``)
and UTS namespace (the node's name as hostname). Every one of them, slurmctld's included,
resolves every node's name through a bind-mounted hosts file. Each ``slurmd -N`` runs in its
node's namespaces (``nsenter``), and ``slurm.conf`` gives every node its own ``NodeAddr``: an
``srun`` step runs on a host of its own. Commands such as ``sbatch`` and ``sinfo`` run in
slurmctld's namespaces. Processes hold the namespaces (no files under ``/run/netns``): when the
test process ends (``stop()``, or killed) the cluster's holder kills every process left in the
cluster (a step outlives its slurmd) and the nodes' holders, and the namespaces go with the last
of them: a killed test leaves nothing.

``why_unavailable()`` says in one line why such a cluster cannot run here (not root, no
unshare, Slurm or munge not installed); the tests skip with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from aegis.platforms import emulated
from tests.waits import wait_until

NODES = ("n1", "n2", "n3")
ADDRESSES = emulated.addresses(NODES)  # n1 is 198.18.0.10, ...
CTL_HOST = emulated.MASTER_NAME  # slurmctld's hostname, at the bridge's address
BRIDGE_ADDR = emulated.BRIDGE_ADDR
CTLD_PORT, SLURMD_PORT = 6817, 6818  # every node has its own network namespace
TOOLS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "sinfo", "scontrol")
NS = ("--net", "--mount", "--uts")
REPO = Path(__file__).resolve().parents[1]


def why_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm tests start slurmctld/slurmd/munged and need root"
    tools = (*TOOLS, "unshare", "nsenter", "ip", "hostname", "mount")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}; .ci/run installs them)"
    probe = subprocess.run(["unshare", *NS, "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return (
            f"unshare {' '.join(NS)} denied here: {probe.stderr.decode(errors='replace').strip()}"
        )
    return None


def slurm_conf(root: Path) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={name} NodeAddr={address} Port={SLURMD_PORT} CPUs=4 "
        "RealMemory=1000 State=UNKNOWN"
        for name, address in ADDRESSES.items()
    )
    return f"""\
ClusterName=aegistest
SlurmctldHost={CTL_HOST}({BRIDGE_ADDR})
SlurmctldPort={CTLD_PORT}
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


def hold(state: str, nodes: Sequence[str]) -> None:
    """The cluster's holder, run in its new namespaces (``python -c``): slurmctld's hostname and
    hosts file, the bridge and the nodes (``emulated.EmulatedCluster``), the nodes' holders'
    pids in ``state/pids.json``; held until stdin closes (``stop()``, or the test process
    died), then every process left in the cluster (a step that outlived its slurmd) is killed."""
    asyncio.run(_hold(Path(state), nodes))


async def _hold(state: Path, nodes: Sequence[str]) -> None:
    cluster = emulated.EmulatedCluster(nodes, state)
    await cluster.start()
    subprocess.run(["hostname", CTL_HOST], check=True)
    subprocess.run(["mount", "--bind", str(cluster.hosts_file), "/etc/hosts"], check=True)
    for node in nodes:
        await cluster.prepare(node)
    pids = {node: cluster.nodes[node].holder.pid for node in nodes}
    namespaces = {_netns(os.getpid()), *(_netns(pid) for pid in pids.values())}
    (state / "pids.tmp").write_text(json.dumps(pids))
    (state / "pids.tmp").rename(state / "pids.json")
    try:
        await asyncio.to_thread(sys.stdin.buffer.read)
    finally:
        _sweep(namespaces)
        await cluster.close()


def _netns(pid: int) -> tuple[int, int] | None:
    try:
        found = os.stat(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a zombie
        return None
    return found.st_dev, found.st_ino


def _sweep(namespaces: set[tuple[int, int] | None], timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``namespaces`` but this one, until none is left."""
    namespaces.discard(None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
        left = [pid for pid in pids if _netns(pid) in namespaces]
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # until the killed are gone (a zombie is in no namespace)


def _die_with_parent() -> None:
    """A daemon gets SIGTERM when the test process dies, so a crashed run leaves none behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class SlurmCluster:
    """Start with ``start()``, stop with ``stop()``; ``run(argv)`` in slurmctld's namespaces,
    ``spawn`` there or (``node=``) on a node."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.holder: subprocess.Popen[bytes] | None = None
        self.node_pids: dict[str, int] = {}  # a node -> the process holding its namespaces
        self.daemons: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env.pop(emulated.CLUSTER_ENV, None)
        return env

    def _ns(
        self, argv: Sequence[str], node: str | None = None, cwd: Path | None = None
    ) -> list[str]:
        """``argv`` in slurmctld's namespaces, or in ``node``'s, working in ``cwd`` (this
        process's by default: the file system is shared, and a user submits from a directory;
        entering a mount namespace alone would start it at ``/``)."""
        assert self.holder is not None
        pid = self.holder.pid if node is None else self.node_pids[node]
        return ["nsenter", "-t", str(pid), *NS, f"--wd={cwd or os.getcwd()}", "--", *argv]

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        node: str | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        merged = self.env | dict(env or {})
        result = subprocess.run(
            self._ns(argv, node, cwd), capture_output=True, text=True, env=merged, check=False,
            timeout=60,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
        return result

    def _daemon(self, argv: Sequence[str], log_name: str, node: str | None = None) -> None:
        self.daemons.append(self.spawn(argv, log_name, node=node))

    def spawn(
        self, argv: Sequence[str], log_name: str, *, node: str | None = None
    ) -> subprocess.Popen[bytes]:
        """A long-running process in slurmctld's namespaces or ``node``'s (it dies with the
        test process)."""
        with (self.root / "log" / log_name).open("ab") as out:
            return subprocess.Popen(
                self._ns(argv, node),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def start(self, timeout_s: float = 60.0) -> None:
        for sub in ("munge", "state", "run", "log", "hosts", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        self.conf.write_text(slurm_conf(self.root))
        self._make_hosts(timeout_s)
        key = self.root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, timeout=30)
        munge = self.root / "munge"
        self._daemon(
            ["munged", "-F", "--force", f"--socket={munge}/munge.socket", f"--key-file={key}",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"],
            "munged.out",
        )  # fmt: skip
        wait_until((munge / "munge.socket").exists, timeout_s, "munged")
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for node in NODES:
            argv = ["slurmd", "-D", "-N", node, "-f", str(self.conf)]
            self._daemon(argv, f"slurmd.{node}.out", node=node)
        wait_until(self._all_idle, timeout_s, "every node idle in sinfo")

    def _make_hosts(self, timeout_s: float) -> None:
        """The cluster's namespaces and, in them, the bridge and one set per node."""
        state = self.root / "hosts"
        env = self.env | {emulated.CLUSTER_ENV: "slurm-fixture"}  # EmulatedCluster's "inside"
        code = f"from tests.slurm_fixture import hold; hold({str(state)!r}, {NODES!r})"
        # No parent-death signal: the test process's end closes stdin, and the holder sweeps.
        with (self.root / "log" / "hosts.out").open("ab") as out:
            self.holder = subprocess.Popen(
                ["unshare", *NS, "--propagation", "private", sys.executable, "-c", code],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=REPO, start_new_session=True,
            )  # fmt: skip
        pids = state / "pids.json"
        wait_until(lambda: self._holder_alive() and pids.exists(), timeout_s, "the hosts")
        self.node_pids = {node: int(pid) for node, pid in json.loads(pids.read_text()).items()}

    def _holder_alive(self) -> bool:
        if self.holder is None or self.holder.poll() is not None:
            raise AssertionError(f"the cluster's namespaces could not be made: {self.logs()}")
        return True

    def _all_idle(self) -> bool:
        self._holder_alive()
        for daemon in self.daemons:
            if daemon.poll() is not None:
                raise AssertionError(f"{daemon.args!r} exited: {self.logs()}")
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
            try:
                self.holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
