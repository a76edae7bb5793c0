"""An emulated cluster on one machine (``aegis run --isolate-nodes``).

The whole cluster lives in one network namespace made for the run (``unshare --net``: nothing
touches the host's network). In it a bridge, ``aegis0``, carries our own test hosts' addresses
(198.18.0.0/24, inside that namespace only): the master, NATS and the gRPC bootstrap listen on
the bridge's 198.18.0.1. Each node is a process holding a network namespace of its own (its
loopback and one address on the bridge), a mount namespace with a private ``/dev/shm`` (tmpfs)
and an ``/etc/hosts`` that resolves every node's name to its address (gloo picks its interface
from the hostname), and a UTS namespace with the node's name as hostname. A node's agent (and
everything it starts) runs there through ``nsenter``, in the run's working directory. The file
system is shared, as a cluster file system would be; ``/dev/shm`` is not. No PID namespace:
every process is visible to ``ps`` and killable from the host. Every holder dies with the run
(parent-death signal), and with the last process in them the namespaces go too: a SIGKILLed run
leaves nothing behind.

:func:`run_outside` is the part on the host: it starts the run again inside a new network
namespace, forwards SIGINT/SIGTERM to it, serves ``--metrics-port`` on the host through a
forwarder, and returns its exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aegis.adapters import lifecycle, netns
from aegis.core.errors import AegisError
from aegis.core.rendezvous import TORCH_PORT, RendezvousRule

log = logging.getLogger(__name__)

CLUSTER_ENV = netns.CLUSTER_ENV  # inside the cluster: the path of its network namespace
INSIDE = "starting"  # the value run_outside sets; the run inside replaces it with the path
BRIDGE = "aegis0"
SUBNET = "198.18.0"  # RFC 2544's benchmarking range: our own test hosts
BRIDGE_ADDR = f"{SUBNET}.1"
BRIDGE_MAC = "02:ae:61:50:00:01"  # locally administered, fixed (see ``start``)
FIRST_NODE = 10
MASTER_NAME = "aegis-master"
# Rounds meet on rank 0's node, on a port of the range every node owns (its own namespace).
RULE = RendezvousRule(fallback_host=BRIDGE_ADDR, port_base=TORCH_PORT)
# A node's holder: its names set, then a sleep that ``ps`` shows as "aegis-node NODE HOSTS".
_HOLD = (
    'hostname "$1" && mount -t tmpfs -o mode=1777 aegis-shm /dev/shm && '
    'mount --bind "$2" /etc/hosts && echo ready && exec -a "aegis-node $1 $2" sleep infinity'
)


class ClusterError(AegisError, RuntimeError):
    """The emulated cluster could not be set up."""


def inside() -> bool:
    """True in the cluster's own network namespace (the run that ``run_outside`` started)."""
    return bool(os.environ.get(CLUSTER_ENV))


def addresses(nodes: Sequence[str]) -> dict[str, str]:
    """Each node's bridge address, in order (``node-0`` is 198.18.0.10)."""
    if len(nodes) > 254 - FIRST_NODE:
        raise ClusterError(f"{len(nodes)} nodes do not fit in {SUBNET}.0/24")
    return {node: f"{SUBNET}.{FIRST_NODE + i}" for i, node in enumerate(nodes)}


def hosts_text(table: dict[str, str]) -> str:
    lines = ["127.0.0.1 localhost", f"{BRIDGE_ADDR} {MASTER_NAME}"]
    lines += [f"{address} {node}" for node, address in table.items()]
    return "\n".join(lines) + "\n"


@dataclass(slots=True)
class _Node:
    name: str
    address: str
    holder: asyncio.subprocess.Process


class EmulatedCluster:
    """The nodes of one run, made when first used (a spare is a fresh namespace)."""

    rule = RULE
    bridge_addr = BRIDGE_ADDR

    def __init__(self, nodes: Sequence[str], state_dir: Path) -> None:
        self.table = addresses(nodes)
        self.state_dir = state_dir
        self.hosts_file = state_dir / "hosts"
        self.nodes: dict[str, _Node] = {}
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """The bridge, in this (the cluster's) network namespace."""
        if not inside():
            raise ClusterError("the emulated cluster is made inside the run's own namespace")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text(hosts_text(self.table))
        await _ip("link", "set", "lo", "up")
        await _ip("link", "add", BRIDGE, "type", "bridge")
        # its own MAC: a bridge left to take its ports' lowest one changed it when a node's
        # namespace went (a node lost), and every other node's ARP entry for the master and
        # NATS went stale for seconds: their pods' heartbeats were lost with it
        await _ip("link", "set", BRIDGE, "address", BRIDGE_MAC)
        await _ip("addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
        await _ip("link", "set", BRIDGE, "up")

    def address(self, node: str) -> str:
        return self.table[node]

    def shm_root(self, node: str) -> Path | None:
        return None  # a node's /dev/shm is its own tmpfs, gone with its namespaces

    def down(self, node: str) -> str | None:
        """A node whose holder exited is down: its namespaces go with its last process, and
        nothing can enter them again (a dead host)."""
        made = self.nodes.get(node)
        if made is None or made.holder.returncode is None:
            return None
        return f"its namespaces' holder exited {made.holder.returncode}"

    async def prepare(self, node: str) -> None:
        """Make ``node`` if it does not exist yet."""
        async with self._lock:
            if node not in self.nodes:
                self.nodes[node] = await self._make(node)

    def wrap(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespaces (after ``prepare``), in the run's working
        directory (the file system is shared; entering a mount namespace alone moves a process
        to its ``/``, where a relative ``python train.py`` finds nothing), with ``HOSTNAME`` the
        node's name (as Slurm and Kubernetes set it; not the host's, inherited by every node)."""
        pid = str(self.nodes[node].holder.pid)
        return ["nsenter", "-t", pid, "--net", "--mount", "--uts", f"--wd={os.getcwd()}", "--",
                "env", f"HOSTNAME={node}", *argv]  # fmt: skip

    async def _make(self, node: str) -> _Node:
        address = self.table[node]
        argv = lifecycle.pdeath_argv(
            ["unshare", "--net", "--mount", "--uts", "--propagation", "private",
             "bash", "-c", _HOLD, "bash", node, str(self.hosts_file)]
        )  # fmt: skip
        holder = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        assert holder.stdout is not None and holder.stderr is not None
        line = await holder.stdout.readline()
        if line.strip() != b"ready":
            problem = (await holder.stderr.read()).decode(errors="replace").strip()
            raise ClusterError(f"node {node}: its namespaces could not be made: {problem}")
        veth = f"aegis-n{list(self.table).index(node)}"
        await _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0",
                  "netns", str(holder.pid))  # fmt: skip
        await _ip("link", "set", veth, "master", BRIDGE, "up")
        inside_node = ["nsenter", "-t", str(holder.pid), "--net", "--", "ip"]
        await _run(*inside_node, "addr", "add", f"{address}/24", "dev", "eth0")
        await _run(*inside_node, "link", "set", "eth0", "up")
        await _run(*inside_node, "link", "set", "lo", "up")
        log.info("node %s: own namespaces, %s on %s", node, address, BRIDGE)
        return _Node(node, address, holder)

    async def close(self) -> None:
        """Stop every holder (run after the pods: their processes hold the namespaces too)."""
        for state in self.nodes.values():
            with contextlib.suppress(ProcessLookupError):
                state.holder.kill()
            await state.holder.wait()
        self.nodes.clear()


async def _ip(*args: str) -> None:
    await _run("ip", *args)


async def _run(*argv: str) -> None:
    """``argv`` to its end, in a session of its own: a Ctrl-C at the terminal (or ``timeout``,
    which signals the whole process group) stops the run, which then takes its cluster down,
    and not the ``ip`` command that builds it half-way (a ClusterError and a traceback)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)}: {err.decode(errors='replace').strip()}")


# -- the host's side ---------------------------------------------------------------------------


PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops the run inside


async def run_outside(argv: Sequence[str], forwarded: Sequence[tuple[str, int]] = ()) -> int:
    """Run ``argv`` (an ``aegis run``) in a new network namespace; returns its exit status.
    ``forwarded``: (host address, port) pairs served here and forwarded to the same port on
    the cluster namespace's loopback (``/metrics``)."""
    env = {**lifecycle.child_env(), CLUSTER_ENV: INSIDE}
    # In a session of its own: a Ctrl-C at the terminal (sent to the whole foreground process
    # group) would reach it directly and again through ``_pass_on``, and the second signal
    # kills the pods at once (``RunStop``).
    proc = await asyncio.create_subprocess_exec(
        *lifecycle.pdeath_argv(["unshare", "--net", "--", *argv]), env=env, start_new_session=True
    )
    loop = asyncio.get_running_loop()
    for sig in PASSED_ON:
        loop.add_signal_handler(sig, _pass_on, proc, sig)
    # (no longer in the terminal's process group, it stops and goes on with this one: Ctrl-Z)
    loop.add_signal_handler(signal.SIGTSTP, _stop_both, proc)
    loop.add_signal_handler(signal.SIGCONT, _pass_on, proc, signal.SIGCONT)
    connector = netns.Connector(netns.netns_path(proc.pid))
    servers = []
    try:
        for host, port in forwarded:
            servers.append(await netns.forward(connector, (host, port), ("127.0.0.1", port)))
        code = await proc.wait()
    finally:
        for server in servers:
            server.close()
        connector.close()
        for sig in (*PASSED_ON, signal.SIGTSTP, signal.SIGCONT):
            loop.remove_signal_handler(sig)
    if code < 0:  # killed by a signal before it could handle one (its first second)
        log.warning("the run in the cluster's namespace was killed by signal %d", -code)
    return shell_status(code)


def shell_status(returncode: int) -> int:
    """A child's exit status as a shell says it: 128 + n for one killed by signal n (asyncio's
    -n, given to ``sys.exit``, came out as 256 - n: 241 for SIGTERM)."""
    return 128 - returncode if returncode < 0 else returncode


def _pass_on(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def _stop_both(proc: asyncio.subprocess.Process) -> None:
    """Ctrl-Z: the run inside stops, then this one, as the shell expects."""
    _pass_on(proc, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def run_again_inside(forwarded: Sequence[tuple[str, int]]) -> int:
    """This very command line (``aegis run ... --isolate-nodes``), inside the cluster."""
    argv = [sys.executable, "-m", "aegis", *sys.argv[1:]]
    return asyncio.run(run_outside(argv, forwarded))


def enter_cluster() -> None:
    """In the run inside: say where the cluster's namespace is, for every child and tool."""
    os.environ[CLUSTER_ENV] = netns.netns_path(os.getpid())
