"""Whether a job's creator on another host or container still leads it: the ``ping`` of the
control protocol.

A job's record names the ``aegis run`` that created it (``JobNotes.creator``). On its own host a
new run of the name judges that process itself (``spawn.owners``); another host's or another pid
namespace's it cannot, so it asks on the bus (:func:`still_led`): a ``ping`` of the job on the
shared control subject, sent again every second (NATS core delivers at most once), answered
only by the master service leading the job (:func:`serve`, subscribed by every
``MasterService`` from its start, whether or not the run serves a control channel), and a
listen on the job's worker subjects, where its pods report every second while they live. Only
a reply that says yes counts (anyone may send a no first on a server without auth); a bus that
is down at a look, or a ping that cannot be sent, is "cannot tell", never "gone".
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import msgspec

from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.ports import Bus, Subscription
from aegis.master.control import ControlReply, ControlRequest, ResolveJob
from aegis.master.control_file import CONTROL_SUBJECT

ANSWERED = "its master answers for it"
REPORTING = "a pod of it still reports"
UNTOLD = "this master's link to NATS is down: it cannot tell"


async def serve(bus: Bus, resolve_job: ResolveJob) -> Subscription:
    """Answer ``ping`` on ``CONTROL_SUBJECT`` for each job ``resolve_job`` knows, and keep
    silent otherwise (another master answers for its own; a bad request is the control
    channel's to log)."""
    decoder = msgspec.json.Decoder(ControlRequest)

    async def on_ping(_: str, payload: bytes) -> None:
        try:
            asked = decoder.decode(payload)
        except msgspec.DecodeError:
            return
        if asked.command == "ping" and resolve_job(asked.namespace, asked.job) is not None:
            said = ControlReply(True, f"job {asked.namespace}/{asked.job}: led here")
            await bus.publish(asked.reply_to, msgspec.json.encode(said))

    return await bus.subscribe(CONTROL_SUBJECT, on_ping)


async def still_led(
    bus: Bus,
    namespace: str,
    job: str,
    *,
    inbox_prefix: str,
    window_s: float,
    every_s: float = 1.0,
) -> str | None:
    """Why the job is still led, asked for ``window_s`` (:data:`ANSWERED`, :data:`REPORTING`,
    :data:`UNTOLD`); None when nobody answered for it the whole time."""
    inbox = f"{inbox_prefix}.ping{secrets.token_hex(8)}"
    heard: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def hear(why: str) -> None:
        if not heard.done():
            heard.set_result(why)

    async def on_reply(_: str, payload: bytes) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            if msgspec.json.decode(payload, type=ControlReply).ok:
                hear(ANSWERED)

    async def on_report(_: str, payload: bytes) -> None:
        hear(REPORTING)

    subs: list[Subscription] = []
    try:
        subs.append(await bus.subscribe(inbox, on_reply))
        reports = worker_subject(job_subject_prefix(namespace, job), ">")  # every pod's
        subs.append(await bus.subscribe(reports, on_report))
        return await _ask(bus, ControlRequest("ping", inbox, namespace, job=job), heard,
                          window_s, every_s)  # fmt: skip
    except Exception:  # a subscription refused (closed, permissions): nothing was asked
        return UNTOLD
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _ask(
    bus: Bus, ping: ControlRequest, heard: asyncio.Future[str], window_s: float, every_s: float
) -> str | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window_s  # (each wait is bounded: a swallowed cancel ends too)
    payload = msgspec.json.encode(ping)
    while (left := deadline - loop.time()) > 0:
        if not bus.connected:
            return UNTOLD
        try:
            await bus.publish(CONTROL_SUBJECT, payload)
        except Exception:  # (closed, or the server refused): nothing was asked
            return UNTOLD
        await asyncio.wait({heard}, timeout=min(every_s, left))
        if heard.done():
            return heard.result()
    return UNTOLD if not bus.connected else None
