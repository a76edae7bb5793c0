"""The operator's control channel (the seed's atlctl): ``aegis ctl`` -> NATS -> the master.

Request/reply over the ``Bus`` port: the client subscribes to a private inbox, then publishes a
``ControlRequest`` (carrying ``reply_to``) on the master's own subject (``CONTROL_SUBJECT.
<random>``, in its control file: several runs share one NATS server, and a stop sent on one
subject for all once stopped another run's job of that name); the handler answers on that inbox.
On ``CONTROL_SUBJECT`` itself a run's master answers only ``stop`` and ``hang`` of a job it leads
(a Slurm attempt stops the one before it there); the leader of ``aegis master`` replicas (one
per server, by its lease) answers every request there too (a control file made by hand or by an
older version names no subject), but a ``ping`` (answered by the master service, ``master.ping``).
The subjects lie outside every job's prefix (``aegis.<ns>.<job>.>``): on a server with auth only
the master's credentials (in a 0600 control file) reach them, never a worker's.

Commands:
- ``stop JOB``: ``QuitRequested`` into the job's runner -> ``Failed`` with ``should_quit``.
- ``taint NODE.. --reason R`` / ``untaint NODE..``: add to / remove from the platforms' node
  blacklists (future placements avoid a tainted node; a running pod is not moved).
- ``drain NODE.. --reason R --deadline-s T``: planned maintenance. The nodes are blacklisted
  (and drained in Slurm), every job with a pod there is asked for a checkpoint; those pods leave
  when it is committed (or at the deadline, with a warning) for nodes elsewhere, and the job
  resumes from it. No fault is counted. ``undrain NODE..`` makes the nodes schedulable again.
- ``hang POD``: the pod is reported hung in the current round, named by the operator (no wait
  for the other pods' reports, ``master/hang_judge.py``), so the core marks it slow and evicts it
  at the next committed checkpoint; it is recorded in ``events.jsonl`` (``HangJudged``).
- ``ping JOB`` (no ``aegis ctl`` command): "I lead it" (``master.ping``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import msgspec

from aegis.adapters.ports import Bus, Handler, Subscription
from aegis.core import events as ev
from aegis.core.model import PodName
from aegis.master import node_drains
from aegis.master.control_file import (
    CONTROL_FILE,
    CONTROL_SUBJECT,
    bus_target,
    remove_control_file,
    write_control_file,
)
from aegis.master.job_runner import JobRunner
from aegis.master.node_drains import NodeBlacklist, NodeDrainer
from aegis.master.remote_platform import RemotePlatform

log = logging.getLogger(__name__)

Command = Literal["stop", "taint", "untaint", "hang", "drain", "undrain", "ping"]
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class ControlRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    command: Command
    reply_to: str
    namespace: str = "default"
    job: str = ""
    pod: str = ""
    nodes: list[str] = []
    reason: str = ""
    deadline_s: float = 60.0


class ControlReply(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    ok: bool
    message: str


@runtime_checkable
class KnownNodes(Protocol):
    """A platform that knows every node it may place pods on (so a typo is caught)."""

    def known_nodes(self) -> frozenset[str]: ...


ResolveJob = Callable[[str, str], JobRunner | None]  # (namespace, job)
ResolvePlatforms = Callable[[], Iterable[NodeBlacklist]]
ResolveJobs = Callable[[], Iterable[JobRunner]]


def job_of_pod(pod: str) -> str:
    """The job of a pod named ``<job>-<rank>``."""
    return pod.rsplit("-", 1)[0]


async def handle(
    request: ControlRequest,
    resolve_job: ResolveJob,
    resolve_platforms: ResolvePlatforms,
    resolve_jobs: ResolveJobs = lambda: (),
) -> ControlReply:
    match request.command:
        case "drain":
            return await _drain(request, list(resolve_platforms()), list(resolve_jobs()))
        case "undrain":
            return await _undrain(request, list(resolve_platforms()))
        case "stop" | "ping":
            runner = resolve_job(request.namespace, request.job)
            if runner is None:
                return ControlReply(False, f"no job {request.namespace}/{request.job}")
            if request.command == "ping":
                return ControlReply(True, f"job {request.namespace}/{request.job}: led here")
            runner.platform_event(ev.QuitRequested(request.reason or "stopped by aegis ctl"))
            return ControlReply(True, f"job {request.job}: stop requested")
        case "taint" | "untaint":
            return _taint(request, list(resolve_platforms()))
        case "hang":
            runner = resolve_job(request.namespace, request.job or job_of_pod(request.pod))
            if runner is None or request.pod not in runner.status.pod_infos:
                return ControlReply(False, f"no pod {request.pod}")
            await _feed_hang(runner, request.pod)
            return ControlReply(True, f"{request.pod}: reported hung")


async def _undrain(request: ControlRequest, platforms: list[NodeBlacklist]) -> ControlReply:
    if not request.nodes:
        return ControlReply(False, "no node given")
    for platform in platforms:
        for node in request.nodes:
            platform.blacklist.pop(node, None)
            if isinstance(platform, NodeDrainer):
                await platform.undrain_node(node)
    return ControlReply(True, f"undrained {', '.join(request.nodes)}: schedulable again")


def _taint(request: ControlRequest, platforms: list[NodeBlacklist]) -> ControlReply:
    if not request.nodes:
        return ControlReply(False, "no node given")
    for platform in platforms:
        for node in request.nodes:
            if request.command == "taint":
                platform.blacklist[node] = request.reason or "tainted by aegis ctl"
            else:
                platform.blacklist.pop(node, None)
    done = "tainted" if request.command == "taint" else "untainted"
    return ControlReply(True, f"{done} {', '.join(request.nodes)} "
                        f"on {len(platforms)} platform(s)")  # fmt: skip


async def _drain(
    request: ControlRequest, platforms: list[NodeBlacklist], runners: list[JobRunner]
) -> ControlReply:
    nodes = request.nodes
    if not nodes:
        return ControlReply(False, "no node given")
    for node in nodes:
        if not NODE_NAME.fullmatch(node):
            return ControlReply(False, f"bad node name {node!r}")
    on_node = {runner: node_drains.pods_on(runner.status, nodes) for runner in runners}
    known = [p.known_nodes() for p in platforms if isinstance(p, KnownNodes)]
    used = {info.node for r in runners for info in r.status.pod_infos.values()}
    for node in nodes:
        if known and not any(node in k for k in known) and node not in used:
            names = ", ".join(sorted(set().union(*known)))
            return ControlReply(False, f"unknown node {node!r} (known: {names})")
    reason = request.reason or "drained by aegis ctl"
    for platform in platforms:
        for node in nodes:
            await node_drains.keep_out(platform, node, reason)
    moved = []
    for runner, pods in on_node.items():
        if pods:
            runner.drain(pods, reason, request.deadline_s)
            moved.append(f"job {runner.spec.job}: {', '.join(pods)} leave(s) at the next "
                         f"checkpoint (requested now) or in {request.deadline_s:g} s")  # fmt: skip
    where = ", ".join(nodes)
    if not moved:
        return ControlReply(True, f"drained {where}: no pod runs there, nothing to move")
    return ControlReply(True, f"drained {where}: " + "; ".join(moved))


async def _feed_hang(runner: JobRunner, pod: str) -> None:
    runner.hang_named(PodName(pod), "hang: reported by aegis ctl hang")


@dataclass(frozen=True, slots=True)
class Serving:
    """A master's control channel: its own subject (for its control file) and its
    subscriptions (that subject, and ``CONTROL_SUBJECT``)."""

    subject: str
    subs: tuple[Subscription, ...]

    async def unsubscribe(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()


def leads(request: ControlRequest, resolve_job: ResolveJob, *, leader: bool = False) -> bool:
    """Whether a request on the shared subject is this master's to answer: a ``stop`` or a
    ``hang`` of a job it leads (the others keep silent, and the one that leads it answers); the
    ``leader`` of replicas answers every other request too, but a ``ping`` (``master.ping``)."""
    if request.command == "ping":
        return False
    if leader:
        return True
    if request.command == "stop":
        return resolve_job(request.namespace, request.job) is not None
    if request.command == "hang":
        return resolve_job(request.namespace, request.job or job_of_pod(request.pod)) is not None
    return False


async def serve_control(
    bus: Bus,
    resolve_job: ResolveJob,
    resolve_platforms: ResolvePlatforms,
    resolve_jobs: ResolveJobs = lambda: (),
    *,
    leader: bool = False,
) -> Serving:
    """Answer control requests on a subject of this master's own, and on ``CONTROL_SUBJECT``
    those :func:`leads` says (``leader``: of replicas); a bad request is logged and dropped."""
    decoder = msgspec.json.Decoder(ControlRequest)
    subject = f"{CONTROL_SUBJECT}.{secrets.token_hex(8)}"

    def on(shared: bool) -> Handler:
        async def on_request(_: str, payload: bytes) -> None:
            try:
                request = decoder.decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("control: dropped a bad request (%s)", exc)
                return
            if shared and not leads(request, resolve_job, leader=leader):
                return
            try:
                reply = await handle(request, resolve_job, resolve_platforms, resolve_jobs)
            except Exception as exc:  # a control request must never kill the master
                log.exception("control: %s failed", request.command)
                reply = ControlReply(False, f"{request.command} failed: {exc}")
            log.warning("control: %s %s -> %s", request.command, request.job or request.pod
                        or ",".join(request.nodes), reply.message)  # fmt: skip
            await bus.publish(request.reply_to, msgspec.json.encode(reply))

        return on_request

    own = await bus.subscribe(subject, on(shared=False))
    return Serving(subject, (own, await bus.subscribe(CONTROL_SUBJECT, on(shared=True))))


async def serve_leader(
    bus: Bus, runners: Callable[[], Mapping[str, JobRunner]], drained: NodeBlacklist,
    log_dir: Path | None,
) -> Subscription:  # fmt: skip
    """``aegis ctl`` for a master replica while it leads (a standby would answer "no job"):
    stop, taint, hang, drain and undrain reach every job it leads (``runners``: by key); the
    drained nodes' record (``drained``) first, so later jobs learn them, then the job
    platforms, which carry out node drains. The control file (``control.json`` in
    ``log_dir``, 0600) holds this replica's credentials and its own subject; it answers on the
    shared one too (:func:`serve_control`'s ``leader``)."""

    def resolve(namespace: str, job: str) -> JobRunner | None:
        return runners().get(f"{namespace}.{job}")

    def platforms() -> list[NodeBlacklist]:
        remote = [r.platform for r in runners().values() if isinstance(r.platform, RemotePlatform)]
        return [drained, *remote]

    def jobs() -> list[JobRunner]:
        return list(runners().values())

    sub = await serve_control(bus, resolve, platforms, jobs, leader=True)
    log.info("control: serving aegis ctl on %s and %s", sub.subject, CONTROL_SUBJECT)
    target = bus_target(bus, "default", "", sub.subject)
    if log_dir is None or target is None:
        return sub
    writer = secrets.token_hex(8)  # this lead's, in the file (insecure replicas' are alike)
    write_control_file(log_dir / CONTROL_FILE, target, writer=writer)
    return _Leading(sub, log_dir / CONTROL_FILE, writer)


@dataclass(frozen=True, slots=True)
class _Leading:
    """A leader's control channel: its end also removes the control file it wrote (its
    credentials; ``aegis ctl`` says "no live run" rather than wait on a master that is gone),
    unless a successor leading by now replaced it with its own (replicas share a directory)."""

    sub: Subscription
    path: Path
    writer: str

    async def unsubscribe(self) -> None:
        await self.sub.unsubscribe()
        remove_control_file(self.path, self.writer)


async def request(
    bus: Bus,
    req: Callable[[str], ControlRequest],
    *,
    inbox_prefix: str,
    timeout_s: float = 10.0,
    subject: str = CONTROL_SUBJECT,
) -> ControlReply:
    """Send one request (built for a fresh inbox) on ``subject`` (a master's own, from its
    control file) and wait for its reply."""
    inbox = f"{inbox_prefix}.ctl{secrets.token_hex(8)}"
    answer: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()

    async def on_reply(subject: str, payload: bytes) -> None:
        if not answer.done():
            answer.set_result(msgspec.json.decode(payload, type=ControlReply))

    sub = await bus.subscribe(inbox, on_reply)
    try:
        await bus.flush()
        await bus.publish(subject, msgspec.json.encode(req(inbox)))
        async with asyncio.timeout(timeout_s):
            return await answer
    finally:
        await sub.unsubscribe()
