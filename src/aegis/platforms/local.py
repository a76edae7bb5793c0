"""The local platform: one agent process per pod on this machine, each bound to a simulated node.

Nodes come from a pool (``node-0``.. plus spares ``spare-0``..). A pod evicted for its node
(level 3, slow eviction) is placed on a healthy spare; a container restart (level 2) and a lost
pod come back on the same node. Blacklisted nodes (ErrorNodes) are never used again. Agents run in
their own sessions and die with ``aegis run`` (parent-death signal), so nothing is left behind.
A pod ends with its agent, as a container ends with its PID 1: what the agent leaves when it
exits (a SIGKILLed agent's training, its saver daemon) is SIGKILLed at once. A pod's processes
are those in its agent's session and those that carry its mark (``AEGIS_POD_MARK``, in the
environment every process of the pod inherits: torchrun's workers lead sessions of their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aegis.adapters import lifecycle
from aegis.agent import hang_policy, link_settings, watchdog
from aegis.core import events as ev
from aegis.platforms.process_pods import Pod, PodSettings, ProcessPods

log = logging.getLogger(__name__)

SLOW = "slow"  # --inject-fault NODE:slow: the local platform slows that node's pods down
# (from the start, or once ``turn_slow`` is called: a node that turns slow during training)
# A broken container, not a broken node: the fault is in the pod's first container on the node
# and gone from the next one (a container restart, level 2, heals it; a gpu or io fault stays
# with the node until the pod moves off it).
CONTAINER_FAULTS = frozenset({"runtime"})
MARK_ENV = "AEGIS_POD_MARK"


@dataclass(frozen=True, slots=True)
class LocalSettings(PodSettings):
    ckpt_dir: Path | None = None  # the pods' checkpoint saver persists under <ckpt_dir>/<pod>
    prewarm: str = "auto"  # AEGIS_PREWARM for the agents: auto, 0 (cold restarts) or modules
    # an injected slow node is stopped ``slow_stop_s`` of every ``slow_period_s`` (SIGSTOP and
    # SIGCONT from outside). The period is long beside a step: in a short one (40 of 50 ms) a rank
    # still fits a few short steps into every running slice, and on a machine with CPU to spare
    # the others take its share, so the job hardly slowed (18 %, no slowdown seen, on an idle
    # 2-core machine). Stopped 0.4 s at a time, the whole job waits; it runs at most a fifth.
    slow_stop_s: float = 0.4
    slow_period_s: float = 0.5
    slow_from_start: bool = True  # False: injected slow nodes turn slow at ``turn_slow()``
    # ...or at the first committed checkpoint this long after the first pod started: the pace
    # watch finds a drop from a pace it measured (a full window at full pace), not a node slow
    # from before it had one
    slow_after_s: float = 0.0


class Hosts(Protocol):
    """Where a node's processes run: this one host, or a node of an emulated cluster."""

    async def prepare(self, node: str) -> None:
        """Ready ``node`` for a pod (made when first used)."""
        ...

    def wrap(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``node``."""
        ...

    def address(self, node: str) -> str:
        """``node``'s address: the pod IP of the pods placed there."""
        ...

    def down(self, node: str) -> str | None:
        """Why ``node`` is down (None: it is up, or not made yet)."""
        ...

    def shm_root(self, node: str) -> Path | None:
        """``node``'s ``/dev/shm`` as seen from here (None: its own, gone with the node)."""
        ...


class SharedHost:
    """Every node is this host (one loopback, one ``/dev/shm``): NCCL on a multi-GPU box."""

    async def prepare(self, node: str) -> None:
        return None

    def wrap(self, node: str, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def address(self, node: str) -> str:
        return "127.0.0.1"

    def down(self, node: str) -> str | None:
        return None  # this host runs us: it is up

    def shm_root(self, node: str) -> Path | None:
        return Path("/dev/shm")


class LocalPlatform(ProcessPods):
    task_name = "local-platform"

    def __init__(self, settings: LocalSettings, hosts: Hosts | None = None) -> None:
        super().__init__(settings)
        self.settings: LocalSettings = settings
        self.hosts: Hosts = hosts or SharedHost()
        self._watches: set[asyncio.Task[None]] = set()  # one per agent: its pod ends with it
        self._run_mark = secrets.token_hex(6)
        self._marks: dict[int, str] = {}  # an agent's pid -> its pod's mark
        self.slowed: set[str] = {
            node
            for node, faults in settings.inject.items()
            if settings.slow_from_start and SLOW in faults
        }
        self._first_start: float | None = None  # time.monotonic() of the first pod's start

    def turn_slow(self) -> list[str]:
        """The nodes injected ``slow`` turn slow now: every pod running there, and every later
        one. Returns the nodes that turned slow just now."""
        nodes = self.never_slowed()
        for node in nodes:
            self.slowed.add(node)
            log.warning("injected fault: node %s turns slow", node)
            for state in self.pods.values():
                if state.node == node and state.process is not None:
                    self._background(self._slow_down(state.process))
        return nodes

    def turn_slow_at_commit(self, event: ev.Event) -> None:
        """A job's event: injected slow nodes turn slow at its first committed checkpoint once
        ``slow_after_s`` passed since the first pod started (the run has kept its pace for a
        while, and the master's pace watch sees it drop)."""
        if isinstance(event, ev.CheckpointCommitted) and slow_due(
            self._first_start, time.monotonic(), self.settings.slow_after_s
        ):
            self.turn_slow()

    def never_slowed(self) -> list[str]:
        """The nodes injected ``slow`` that never turned slow (the job committed no checkpoint
        late enough)."""
        return sorted(
            node for node, faults in self.settings.inject.items()
            if SLOW in faults and node not in self.slowed
        )  # fmt: skip

    async def blacklist_node(self, job: str, node: str, reason: str) -> None:
        log.warning("node %s blacklisted: %s", node, reason)
        self.blacklist[node] = reason

    def _address(self, node: str) -> str:
        return self.hosts.address(node)

    def _down(self, node: str) -> str | None:
        return self.hosts.down(node)

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        grace_s = 0.0 if self.killed else self.settings.grace_s
        await _kill_group(proc, grace_s, lambda: self._members(proc))

    def _members(self, proc: asyncio.subprocess.Process, *, live: bool = False) -> list[int]:
        """The processes of the pod whose agent is ``proc`` (see the module)."""
        return pod_members(proc.pid, self._marks.get(proc.pid), live=live)

    async def _start(self, state: Pod, token_file: Path) -> bool:
        s = self.settings
        await self.hosts.prepare(state.node)
        if self.killed:  # (while the node was made)
            return False
        argv: Sequence[str] = [
            sys.executable, "-m", "aegis", "agent",
            "--master", self.master,
            "--namespace", self.namespace, "--job", self.job,
            "--pod", state.name, "--node", state.node,
            "--token-file", str(token_file),
            "--grace-s", str(s.grace_s), *hang_policy.flag(s.hang_timeout_s),
            "--heartbeat-s", str(s.heartbeat_s), "--health-s", str(s.health_s),
            *(["--rejoin"] if state.incarnation > 1 else []),
            "--", *s.command,
        ]  # fmt: skip
        env = self._agent_env(state)
        with self.pod_log(state, "incarnation").open("ab") as out:
            state.process = await asyncio.create_subprocess_exec(
                *self.hosts.wrap(state.node, argv),
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        self._marks[state.process.pid] = env[MARK_ENV]
        watch = asyncio.create_task(self._end_with_agent(state.name, state.process))
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)
        if self.killed:  # (while it started)
            _signal_all(self._members(state.process), signal.SIGKILL)
            return False
        if self._first_start is None:
            self._first_start = time.monotonic()
        if state.node in self.slowed:
            self._background(self._slow_down(state.process))
        return True

    def _agent_env(self, state: Pod) -> dict[str, str]:
        s = self.settings
        env = lifecycle.child_env()
        env.pop("AEGIS_INJECT_FAULT", None)
        injected = s.inject.get(state.node, frozenset()) - {SLOW}
        if state.containers_on_node > 1:
            injected -= CONTAINER_FAULTS
        if injected:
            env["AEGIS_INJECT_FAULT"] = ",".join(sorted(injected))
        if s.ckpt_dir is not None:
            env["AEGIS_CKPT_DIR"] = str(s.ckpt_dir)
        env.setdefault("AEGIS_PREWARM", s.prewarm)
        env["AEGIS_POD_IP"] = self.hosts.address(state.node)  # what its ACK says
        env[MARK_ENV] = f"{self._run_mark}.{state.name}.{state.incarnation}"
        return env

    async def _end_with_agent(self, pod: str, proc: asyncio.subprocess.Process) -> None:
        """When ``pod``'s agent exits, SIGKILL what is left of the pod, as the kernel does with
        a PID namespace whose init ended: a SIGKILLed agent's training went on committing its
        old timeline (to its node's ``/dev/shm`` too) until the master had missed its heartbeats
        and the pod was replaced. (Not a platform task: ``stop_all`` waits for those.)"""
        code = await proc.wait()
        left = self._members(proc, live=True)
        for _ in range(50):  # again while any is left: one may have forked before its kill
            if not (alive := self._members(proc, live=True)):
                break
            _signal_all(alive, signal.SIGKILL)
            await asyncio.sleep(0.02)
        if left:
            log.warning("%s's agent exited %s: the %d process(es) it left killed, as a "
                        "container's are", pod, code, len(left))  # fmt: skip

    def kill_now(self) -> None:
        """SIGKILL every pod's agent and all it started, and start no other (the run's second
        stop signal: the user will not wait for the pods' grace period or their last save).
        Their checkpoint memory on this host goes when they are gone (``stop_all``)."""
        self.killed = True
        for state in self.pods.values():
            if state.process is not None and state.process.returncode is None:
                _signal_all(self._members(state.process), signal.SIGKILL)

    async def stop_all(self) -> None:
        """Stop every pod (``ProcessPods.stop_all``), then remove the checkpoint memory and the
        progress files that a killed agent left on this host (one that exits removes its own;
        the next agent to start here would remove the progress files, not the run's end)."""
        await super().stop_all()
        roots = set()
        for pod, node in set(self.placements):
            prefix = link_settings.memory_prefix(self.namespace, self.job, pod, node)
            if (shm_root := self.hosts.shm_root(node)) is not None:
                link_settings.forget_memory(shm_root, prefix, f"{pod}'s killed agent")
                roots.add(shm_root)
        for root in roots:
            if removed := watchdog.sweep_dead_owners(str(root)):
                log.info("removed the progress files killed agents left: %s", ", ".join(removed))
        after_s = self.settings.slow_after_s
        for node in self.never_slowed():
            log.warning("injected fault %s:slow never took effect: no checkpoint was committed "
                        "%.0f s or more after the first pod started (a script that never "
                        "imports aegis commits none)", node, after_s)  # fmt: skip

    async def _slow_down(self, proc: asyncio.subprocess.Process) -> None:
        """A slow node, really: every process of the pod (agent, training, checks) is stopped
        for ``slow_stop_s`` of every ``slow_period_s`` until the pod ends."""
        s = self.settings
        while proc.returncode is None:
            members = self._members(proc)
            _signal_all(members, signal.SIGSTOP)
            await asyncio.sleep(s.slow_stop_s)
            _signal_all(members, signal.SIGCONT)
            await asyncio.sleep(s.slow_period_s - s.slow_stop_s)
        _signal_all(self._members(proc), signal.SIGCONT)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def session_members(sid: int, *, live: bool = False) -> list[int]:
    """Every process in session ``sid`` (an agent and the training groups it started); with
    ``live``, not those already dead (zombies)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and not (live and fields[0] == b"Z"):  # state ppid pgrp sid
            members.append(int(entry.name))
    return members


def pod_members(sid: int, mark: str | None, *, live: bool = False) -> list[int]:
    """The processes of a pod: those in session ``sid`` (its agent's) and those whose
    environment carries ``mark`` (``AEGIS_POD_MARK``; None: none is looked for); with ``live``,
    not those already dead."""
    members = session_members(sid, live=live)
    if mark is None:
        return members
    needle = f"\0{MARK_ENV}={mark}\0".encode()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) not in members:
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as environ:
                    found = needle in b"\0" + environ.read()  # (a zombie's is empty)
            except OSError:
                continue
            if found:
                members.append(int(entry.name))
    return members


async def _kill_group(
    proc: asyncio.subprocess.Process, grace_s: float, members: Callable[[], list[int]]
) -> None:
    """Stop an agent and every process of its pod (``members``: training processes and its
    saver daemon included, also when the agent itself was SIGKILLed and left them behind):
    SIGTERM, grace, SIGKILL."""
    _signal_all(members(), signal.SIGTERM)
    deadline = asyncio.get_running_loop().time() + grace_s
    while members() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    _signal_all(members(), signal.SIGKILL)
    if proc.returncode is None:
        await proc.wait()


def slow_due(first_start: float | None, now: float, after_s: float) -> bool:
    """Whether a commit at ``now`` turns the injected slow nodes slow: ``after_s`` after the
    first pod started (at once when it is 0)."""
    return after_s <= 0 or (first_start is not None and now - first_start >= after_s)
