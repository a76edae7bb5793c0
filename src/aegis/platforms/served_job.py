"""A job handed to master replicas that run elsewhere (``aegis master``): its first record is
written to the status bucket, where the leader picks it up, and this process's platform is
served to whichever replica leads (``PlatformServer``). The job's state is read back from the
store: the masters, not this process, decide.

Used by ``aegis run --masters N`` (masters it starts) and by ``aegis slurm coordinator
--master`` (a master that was already running).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from typing import Any

from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import TERMINAL_PHASES
from aegis.master.job_runner import status_key
from aegis.master.ports import Platform
from aegis.master.records import submit_job
from aegis.platforms.platform_server import PlatformServer
from aegis.wire import status_json
from aegis.wire.tokens import pod_token


@dataclass(slots=True)
class ServedJob:
    store: KvStore
    spec: JobSpec
    server: PlatformServer
    token: str  # the job's secret: each pod's is derived from it (the leader checks it)

    @classmethod
    async def submit(
        cls,
        bus: NatsBus,
        store: KvStore,
        spec: JobSpec,
        nodes: list[str],
        platform: Platform,
        pod_ips: list[str] | None = None,
    ) -> ServedJob:
        """Serve ``platform`` for the job, then submit it (so no request finds no server)."""
        server = PlatformServer(bus, platform, namespace=spec.namespace, job=spec.job)
        await server.start()
        token = secrets.token_urlsafe(24)
        await submit_job(store, spec, nodes, token, pod_ips)
        return cls(store, spec, server, token)

    async def close(self) -> None:
        """The job is over: stop serving its platform."""
        await self.server.stop()

    def pod_token(self, pod: str) -> str:
        """The bootstrap secret to hand pod ``pod``'s agent (``--token-file``), and no other."""
        return pod_token(self.token, self.spec.namespace, self.spec.job, pod)

    async def record(self) -> dict[str, Any]:
        """The job's record as the leader last stored it (``job_record``'s fields)."""
        got = await self.store.get(status_key(self.spec))
        if got is None:
            raise LookupError(f"job {self.spec.job} is not in the store")
        record: dict[str, Any] = json.loads(got[0])
        return record

    async def status(self) -> JobStatus:
        return status_json.from_dict(await self.record())[1]

    async def wait(self, stop: asyncio.Event | None = None, poll_s: float = 0.2) -> JobStatus:
        """The status once the job is over, or once ``stop`` is set (whichever is first)."""
        stop = stop or asyncio.Event()
        while (status := await self.status()).phase not in TERMINAL_PHASES and not stop.is_set():
            try:
                async with asyncio.timeout(poll_s):
                    await stop.wait()
            except TimeoutError:
                pass
        return status
