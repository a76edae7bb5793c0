"""Whether a job's creator on another host or container still leads it: the ``ping`` of the
control protocol.

A job's record names the ``aegis run`` that created it (``JobNotes.creator``). On its own host a
new run of the name judges that process itself (``spawn.owners``); another host's or another pid
namespace's it cannot, so it asks on the bus (:func:`still_led`): a ``ping`` of the job on the
shared control subject, sent again every second (NATS core delivers at most once), answered
only by the master service leading the job (:func:`serve`, subscribed by a ``MasterService``
as it creates its first job, whether or not the run serves a control channel), and a listen on
the job's worker subjects, where its pods report every second while they live. Only a reply
that says yes counts (anyone may send a no first on a server without auth). A link that is
down at any look, closed, or that carries no round trip at the end (a hung server looks
connected for minutes) is "cannot tell", never "gone". (A publish the server refuses for want
of permission reaches nats-py's error callback only: the master's credentials allow every
subject.)
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import msgspec

from aegis.adapters.aio import answers, cancellations, raise_if_cancelled
from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.ports import Bus, Subscription
from aegis.master.control import ControlReply, ControlRequest, ResolveJob
from aegis.master.control_file import CONTROL_SUBJECT

ELSEWHERE = "a run on another host or container"
ANSWERED = f"is led by {ELSEWHERE} (its master answers for it)"
REPORTING = f"is led by {ELSEWHERE} (a pod of it still reports)"
UNTOLD = f"may be led by {ELSEWHERE}: this run could not ask (no working link to NATS)"
LINK_CHECK_S = 5.0  # how long the bus has to answer a round trip before silence is believed


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
    creation: str = "",
) -> str | None:
    """Why the job's name stays held, asked for ``window_s`` (:data:`ANSWERED` before
    :data:`REPORTING`, or :data:`UNTOLD`); None when nobody answered for it the whole time,
    over a link that carried a round trip at the end. ``creation``: the record's (its pods
    report on its subjects)."""
    inbox = f"{inbox_prefix}.ping{secrets.token_hex(8)}"
    answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    reported = asyncio.Event()

    async def on_reply(_: str, payload: bytes) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            if msgspec.json.decode(payload, type=ControlReply).ok and not answered.done():
                answered.set_result(None)

    async def on_report(_: str, payload: bytes) -> None:
        reported.set()

    subs: list[Subscription] = []
    try:
        subs.append(await bus.subscribe(inbox, on_reply))
        reports = worker_subject(job_subject_prefix(namespace, job, creation), ">")  # every pod's
        subs.append(await bus.subscribe(reports, on_report))
        ping = ControlRequest("ping", inbox, namespace, job=job)
        return await _ask(bus, ping, answered, reported, window_s, every_s)
    except Exception:  # a closed link (nats-py's errors, or ours): nothing could be asked
        return UNTOLD
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _ask(
    bus: Bus,
    ping: ControlRequest,
    answered: asyncio.Future[None],
    reported: asyncio.Event,
    window_s: float,
    every_s: float,
) -> str | None:
    loop, since = asyncio.get_running_loop(), cancellations()
    deadline = loop.time() + window_s  # (each wait is bounded: a swallowed cancel ends too)
    payload = msgspec.json.encode(ping)
    while (left := deadline - loop.time()) > 0:
        raise_if_cancelled(since)
        if not bus.connected:
            return UNTOLD
        await bus.publish(CONTROL_SUBJECT, payload)
        await asyncio.wait({answered}, timeout=min(every_s, left))
        if answered.done():
            return ANSWERED
        if reported.is_set():  # (a master's answer, had it come in that second, says more)
            return REPORTING
    if not bus.connected or not await answers(bus, LINK_CHECK_S):
        return UNTOLD  # a hung link looks connected: was anything heard at all?
    return None
