"""The master's Kubernetes side (``aegis master --kubernetes``): AegisJobs in, status out.

Who creates deletes: the operator creates the pods, the token Secret and owns the AegisJob; the
master only reads them and writes the AegisJob's ``.status``. This module runs next to a master
replica and acts only while that replica leads:

- jobs: every ``poll_s`` it lists the AegisJobs (a resync loop); a job the store does not hold
  yet is submitted (``submit_job``: spec from ``.spec``, token from the Secret
  ``<job>-aegis-job-token``, owned by the job) once every pod of the job is scheduled (the first
  record names each pod's node); the leader's replica then adopts it like any job;
- status: the job's record in the store is mirrored into ``.status`` (phase, recover_count,
  per-pod retries and reasons, ErrorNodes, the user-facing line, conditions), whenever it
  changed, and at once when the master blacklists a node or ends the job (the operator places
  replacements by the ErrorNodes it reads there);
- platform: it serves the ``Platform`` port to the leader over NATS (``RemotePlatform``'s
  requests). Replacing or evicting a pod is the operator's work (the pod exits and is recreated,
  or the operator deletes a pod listed in ``.status.replacing``); this side tells the master
  when the replacement is scheduled (``PodRestarted`` with its node and IP; which pod is the
  replacement is decided in ``replacements``);
- drains: the master records ``aegis ctl drain NODE`` in its store (``master.drained_nodes``);
  this side applies that record (``drains``: every poll, and at once on a drain request): the
  node is listed in every AegisJob's ``.status.drained_nodes`` (the operator keeps
  replacements off it, as off an ErrorNode, until ``aegis ctl undrain``) and, with ``cordon``,
  cordoned and marked as Aegis's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgspec

from aegis.adapters.aio import cancellations, raise_if_cancelled
from aegis.adapters.nats_bus import KvStore
from aegis.adapters.ports import Bus, StatusStore, StoreConflictError, Subscription
from aegis.core.model import name_problem
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.core.recovery import RecoveryLevel
from aegis.master.records import submit_job
from aegis.platforms.kubernetes import crd_status, drains, manifests, replacements
from aegis.wire import platform_msgs as pm

log = logging.getLogger(__name__)

Body = dict[str, Any]


class JobsApi(Protocol):
    """What the master reads and writes in Kubernetes (``cluster.KubernetesCluster``)."""

    async def list_jobs(self, namespaces: Sequence[str]) -> list[Body]:
        """Every AegisJob of these namespaces (all namespaces when empty)."""
        ...

    async def get_secret(self, namespace: str, name: str) -> Body | None: ...

    async def list_pods(self, namespace: str, job: str) -> list[Body]: ...

    async def patch_job_status(self, namespace: str, name: str, status: Body) -> None:
        """Merge ``status`` into the AegisJob's status subresource."""
        ...

    async def cordon_node(self, node: str) -> bool:
        """Cordon the node (marked as Aegis's); True when Aegis's cordon is on it now, False
        when someone else's was there already."""
        ...

    async def uncordon_node(self, node: str) -> None:
        """Lift Aegis's cordon (a cordon not marked as Aegis's stays)."""
        ...


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    namespaces: tuple[str, ...] = ()
    poll_s: float = 0.5
    cordon: bool = False  # cordon a drained node (needs the right to patch nodes)


@dataclass(slots=True)
class _Job:
    namespace: str
    name: str
    body: Body
    written: Body | None = None  # the last status written
    awaiting: dict[str, str] = field(default_factory=dict)  # pod -> uid of the pod replaced
    announced: set[tuple[str, str]] = field(default_factory=set)  # (pod, uid) reported back
    handled: set[str] = field(default_factory=set)  # request keys of this leadership term
    secret_refused: bool = False  # its token Secret is another object's (said once)
    requests: Subscription | None = None
    # One thing at a time per job: a poll, a request, a mirror. Interleaved, a poll's record
    # read before a decision undid the wait the request set meanwhile, and two status writes
    # computed against the same last write left a stale key on the resource for good (its
    # ``replacing`` never emptied: found by CI).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}"


class KubernetesPlatform:
    """The ``Platform`` port of one job, over the cluster (the operator does the pod work)."""

    def __init__(self, side: KubernetesSide, job: _Job) -> None:
        self.side, self.job = side, job

    async def replace_pod(self, job: str, pod: str, reason: str) -> None:
        await self.side.await_replacement(self.job, pod)

    async def evict_pod(self, job: str, pod: str, level: RecoveryLevel, reason: str) -> None:
        await self.side.await_replacement(self.job, pod)

    async def blacklist_node(self, job: str, node: str, reason: str) -> None:
        await self.side.mirror_now(self.job)

    async def end_job(self, job: str, phase: Phase) -> None:
        await self.side.mirror_now(self.job)

    async def drain_node(self, node: str, reason: str) -> None:
        await self.side.reconcile_drains()  # the record has it already

    async def undrain_node(self, node: str) -> None:
        await self.side.reconcile_drains()


class KubernetesSide:
    def __init__(
        self,
        api: JobsApi,
        bus: Bus,
        store: StatusStore,
        settings: KubernetesSettings,
        *,
        leading: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
        drained: drains.DrainedRecord | None = None,
    ) -> None:
        self.api, self.bus, self.store, self.settings = api, bus, store, settings
        self.leading, self.clock = leading, clock
        self.jobs: dict[str, _Job] = {}
        self.drains = (
            None
            if drained is None
            else drains.Drains(api, drained, cordon=settings.cordon, clock=clock)
        )
        self._drain_lock = asyncio.Lock()
        self._led = False
        self._decoder = msgspec.json.Decoder(pm.PlatformRequest)
        self._encoder = msgspec.json.Encoder()

    async def run(self) -> None:
        """Until cancelled: one sync every ``poll_s`` while leading (errors logged, retried)."""
        since = cancellations()
        try:
            while True:
                try:
                    await self.sync_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    raise_if_cancelled(since)
                    log.exception("kubernetes: sync failed; retrying")
                raise_if_cancelled(since)
                await asyncio.sleep(self.settings.poll_s)
        finally:
            await self._end_term()

    async def sync_once(self) -> None:
        if not self.leading():
            if self._led:
                await self._end_term()
            return
        self._led = True
        await self.reconcile_drains()
        seen = set()
        for body in await self.api.list_jobs(self.settings.namespaces):
            meta = body.get("metadata") or {}
            job = _Job(meta.get("namespace", "default"), meta["name"], body)
            job = self.jobs.setdefault(job.key, job)
            job.body = body
            seen.add(job.key)
            await self._sync_job(job)
        for key in set(self.jobs) - seen:  # the AegisJob was deleted
            await self._forget(self.jobs.pop(key))

    async def _sync_job(self, job: _Job) -> None:
        async with job.lock:
            await self._sync_job_locked(job)

    async def _sync_job_locked(self, job: _Job) -> None:
        record = await self._record(job)
        if record is None:
            await self._submit(job)
            return
        if job.requests is None:
            subject = pm.subject(job.namespace, job.name, "requests")
            platform = KubernetesPlatform(self, job)
            job.requests = await self.bus.subscribe(
                subject, lambda s, payload: self._on_request(job, platform, payload)
            )
        if record["status"]["phase"] not in [p.value for p in TERMINAL_PHASES]:
            await self._announce_replacements(job, record)
        await self._mirror(job, record)

    async def _record(self, job: _Job) -> dict[str, Any] | None:
        got = await self.store.get(job.key)
        if got is None:
            return None
        record: dict[str, Any] = json.loads(got[0])
        return record

    # -- jobs in -------------------------------------------------------------------------------

    async def _submit(self, job: _Job) -> None:
        view = manifests.view(job.body)
        if view.over:
            return  # a finished job whose record is gone: nothing to run
        problem = name_problem("namespace", job.namespace) or name_problem("job", job.name)
        if problem is not None:  # said once on the AegisJob itself: kubectl shows why
            if (job.body.get("status") or {}).get("message") != f"refused: {problem}":
                log.warning("kubernetes: AegisJob %s refused: %s", job.key, problem)
                await self.api.patch_job_status(
                    job.namespace, job.name, {"phase": "Failed", "message": f"refused: {problem}"}
                )
            return
        try:
            spec = crd_status.job_spec(job.body)
        except ValueError as exc:
            log.warning("kubernetes: AegisJob %s refused: %s", job.key, exc)
            return
        secret = await self.api.get_secret(job.namespace, crd_status.token_secret_name(job.name))
        try:
            crd_status.check_owner(secret, view.uid)
        except crd_status.SecretOwnerError as exc:  # another object's: never its token
            if not job.secret_refused:
                log.warning("kubernetes: AegisJob %s not submitted: %s", job.key, exc)
                job.secret_refused = True
            return
        token = crd_status.token(secret)
        if token is None:
            return  # the operator has not created it yet
        nodes = crd_status.scheduled_nodes(spec, await self.api.list_pods(job.namespace, job.name))
        if nodes is None:
            return  # pods not created or not scheduled yet
        with contextlib.suppress(StoreConflictError):  # submitted already (a retried sync)
            await submit_job(cast(KvStore, self.store), spec, nodes, token)  # it only puts
            log.info("kubernetes: submitted AegisJob %s (%d pods on %s)", job.key,
                     spec.worker_num, ", ".join(nodes))  # fmt: skip

    # -- status out ----------------------------------------------------------------------------

    async def mirror_now(self, job: _Job) -> None:
        async with job.lock:
            record = await self._record(job)
            if record is not None:
                await self._mirror(job, record)

    async def _mirror(self, job: _Job, record: Mapping[str, Any]) -> None:
        previous = (job.body.get("status") or {}).get("conditions") or []
        replacing = {pod: uid for pod, uid in job.awaiting.items() if uid}
        status = crd_status.cr_status(record, previous, now=crd_status.rfc3339(self.clock()),
                                      replacing=replacing, drained=self.drained)  # fmt: skip
        if job.written is not None and crd_status.same_status(job.written, status):
            return
        before = job.written or job.body.get("status")
        patch = crd_status.merge_patch(before, status)
        await self.api.patch_job_status(job.namespace, job.name, patch)
        job.written = status
        job.body = {**job.body, "status": status}

    # -- the platform port ---------------------------------------------------------------------

    async def _on_request(self, job: _Job, platform: KubernetesPlatform, payload: bytes) -> None:
        if not self.leading():
            return  # the leader's side answers; a new leader re-issues what is pending
        try:
            request = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("kubernetes: dropped a platform request of %s: %s", job.key, exc)
            return
        if request.key in job.handled:
            return
        job.handled.add(request.key)
        try:
            match request.kind:
                case pm.RequestKind.REPLACE:
                    await platform.replace_pod(job.name, request.pod, request.reason)
                case pm.RequestKind.EVICT:
                    level = RecoveryLevel(request.level)
                    await platform.evict_pod(job.name, request.pod, level, request.reason)
                case pm.RequestKind.BLACKLIST:
                    await platform.blacklist_node(job.name, request.node, request.reason)
                case pm.RequestKind.END:
                    await platform.end_job(job.name, Phase(request.phase))
                case pm.RequestKind.DRAIN:
                    await platform.drain_node(request.node, request.reason)
                case pm.RequestKind.UNDRAIN:
                    await platform.undrain_node(request.node)
                case pm.RequestKind.RESEND:
                    pass  # no node is found down here (the pods are watched): nothing to resend
        except Exception:
            log.exception("kubernetes: %s of %s failed", request.kind, job.key)

    @property
    def drained(self) -> dict[str, crd_status.DrainedNode]:
        """The drained nodes as applied this term (``drains``)."""
        return self.drains.drained if self.drains is not None else {}

    async def reconcile_drains(self) -> None:
        """Apply the drain record (every poll, and at once on a drain or undrain request; see
        ``drains``); every AegisJob's status shows the change at once."""
        if self.drains is None:
            return
        async with self._drain_lock:
            if await self.drains.reconcile():
                await self._mirror_all()

    async def _mirror_all(self) -> None:
        for job in list(self.jobs.values()):
            await self.mirror_now(job)

    async def await_replacement(self, job: _Job, pod: str) -> None:
        """The master waits for ``pod`` to come back: remember the pod that is there now (unless
        it already is the replacement) and publish the ErrorNodes it must avoid."""
        async with job.lock:
            record = await self._record(job)
            if record is None:
                return
            pods = await self.api.list_pods(job.namespace, job.name)
            job.awaiting[pod] = replacements.uid_replaced(record, pods, pod)
            await self._mirror(job, record)
            await self._announce_replacements(job, record)

    async def _announce_replacements(self, job: _Job, record: Mapping[str, Any]) -> None:
        waiting = replacements.waiting(record)
        for name in list(job.awaiting):
            if name not in waiting:
                del job.awaiting[name]  # back (it ACKed), or no longer wanted
        for name in waiting:
            job.awaiting.setdefault(name, "")  # after a takeover: the uid replaced is unknown
        if not job.awaiting:
            return
        pods = await self.api.list_pods(job.namespace, job.name)
        for name, pod in replacements.back(record, pods, job.awaiting, job.announced):
            job.announced.add((name, replacements.uid(pod)))
            del job.awaiting[name]
            node = str((pod.get("spec") or {}).get("nodeName"))
            ip = (pod.get("status") or {}).get("podIP")
            event = pm.PlatformEvent(kind="restarted", pod=name, node=node, pod_ip=ip)
            await self.bus.publish(pm.subject(job.namespace, job.name, "events"),
                                   self._encoder.encode(event))  # fmt: skip
            log.info("kubernetes: %s of %s is back on %s", name, job.key, node)

    # -- leadership ----------------------------------------------------------------------------

    async def _end_term(self) -> None:
        """Not (or no longer) leading: stop answering requests; forget this term's work."""
        self._led = False
        if self.drains is not None:
            self.drains.clear()  # the next term applies the record again
        for job in self.jobs.values():
            await self._forget(job)
            job.handled.clear()
            job.awaiting.clear()

    async def _forget(self, job: _Job) -> None:
        if job.requests is not None:
            with contextlib.suppress(Exception):
                await job.requests.unsubscribe()
            job.requests = None
