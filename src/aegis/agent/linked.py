"""``aegis agent --master ...``: the agent under a master, wired here.

The supervisor reports to the link (:mod:`aegis.agent.link`), which sends the reports to the
master and takes its orders; the order executor (:mod:`aegis.agent.executor`) carries the orders
out on the supervisor and sends the heartbeats.

If the master or NATS does not answer within the connect timeout, the agent says so in one line
and runs the command independently (seed ``RunIndependent``); a refused bootstrap token is a
configuration error: one line, exit status 2.

Its PID-1 duties are the standalone agent's (:mod:`aegis.agent.runner`, tini's): SIGTERM stops
it (SIGTERM to the training group, grace period, SIGKILL; exit status 143) and each of
``pid1.FORWARDED_SIGNALS`` (SIGINT, SIGHUP, SIGUSR1, SIGPWR, ...: tini's) goes to the training
group that runs at the time (none between a stop and the next start). SIGINT included: it is not
a stop for the agent, as it is not for tini. Under a master, the pod ends on the master's order or
on the platform's SIGTERM; a ^C (or a ``kill -INT`` of the pod) reaches the training processes,
which decide: one that exits on it ends like any other exit (status 130), reported to the master,
which decides on the recovery; one that handles it (a checkpoint, a dump) runs on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from aegis.adapters.grpc.creds import CredsRefusedError, TlsRefusedError
from aegis.agent import (
    executor,
    health,
    link,
    link_settings,
    pid1,
    pycmd,
    reaper,
    supervisor,
    transport,
)
from aegis.checkpoint import layout as lay
from aegis.checkpoint import process
from aegis.checks import gpu, xids
from aegis.checks import host as check_host
from aegis.spawn import owners
from aegis.wire.logsafe import one_line

log = logging.getLogger(__name__)

CONFIG_ERROR_EXIT = 2

Saver = tuple[process.DaemonProcess, asyncio.Task[None]]  # the checkpoint saver, supervised


async def run_linked(
    sup_settings: supervisor.SupervisorSettings,
    settings: link_settings.LinkSettings,
    argv: Sequence[str],
) -> int | None:
    """Run under the master; ``None`` means the master is unreachable (run independently)."""
    the_link = link.MasterLink(settings)
    daemon_settings = _saver_settings(settings)
    if daemon_settings is not None:  # before any order: the job's committed step is kept
        the_link.hold_from = functools.partial(process.hold_from, daemon_settings.shm_dir)
        sup_settings = go_on_counting(sup_settings, daemon_settings.shm_dir)
    # before the ACK: the master watches the pod's heartbeats from then on
    checks = check_host.HostSettings(interpreter=await _check_interpreter(argv, os.environ))
    failed = await _connect(the_link)
    if failed != 0:
        return failed  # None: run independently; else a configuration error's exit status
    reaper.become_subreaper()
    env = {**os.environ, **the_link.env()}
    if daemon_settings is not None:
        env["AEGIS_CKPT_SHM"] = str(daemon_settings.shm_dir)
        env["AEGIS_CKPT_DIR"] = str(daemon_settings.ckpt_dir)
    async with (
        reaper.Reaper() as the_reaper,
        check_host.CheckHost(the_reaper, settings=checks) as host,
        supervisor.Supervisor(argv, sup_settings, the_reaper, the_link, env=env) as sup,
    ):
        orders = executor.OrderExecutor(the_link, sup, host)
        terminated = asyncio.Event()  # a SIGTERM: the agent ends now, nothing waits on the saver

        def on_sigterm() -> None:
            terminated.set()
            the_link.finish(128 + signal.SIGTERM)

        heard = xids.XidListener()  # from the watch's first look (none with --health-s 0)
        health_watch = health.watch(
            gpu.RealNvml(listener=heard), the_link.unhealthy, settings.health_s, the_link.done
        )
        with pid1.signals(sup.send_signal, on_sigterm):
            tasks = [
                asyncio.create_task(executor.beat(the_link, sup), name="heartbeat"),
                asyncio.create_task(the_link.resend(), name="resend"),
                asyncio.create_task(orders.run(), name="orders"),
                asyncio.create_task(health_watch, name="health"),
            ]
            saver: Saver | None = None
            if daemon_settings is not None:
                daemon = process.DaemonProcess(
                    daemon_settings,
                    spawner=the_reaper,
                    on_store=the_link.checkpoint_store,
                    on_stamped_commit=the_link.checkpoint_committed,
                )
                saver = daemon, asyncio.create_task(daemon.supervise(), name="ckpt-saver")
            try:
                code = await _wait_done(the_link, [*tasks, *([saver[1]] if saver else [])])
            finally:
                heard.stop()
                await _shut_down(the_link, tasks, sup, saver, terminated)
    return code


async def _check_interpreter(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Where the node checks run: the job's interpreter (``pycmd.job_interpreter``) when it can
    run them, else the agent's own (said in one line)."""
    job = pycmd.job_interpreter(argv, env)
    if job is None or check_host.is_agents(job):
        return sys.executable
    why = await check_host.runs_checks(job, env)
    if why is None:
        log.info("the node checks run in the job's interpreter, %s", job)
        return job
    log.warning("the node checks run in the agent's interpreter, %s: %s", sys.executable, why)
    return sys.executable


async def _connect_rejoining(the_link: link.MasterLink) -> None:
    """A pod placed again in a running job (``--rejoin``) is of no use on its own: it tries
    again until its master answers (a node cut off for a while) or its platform retires it
    (the master's join timeout moved it elsewhere)."""
    while True:
        try:
            await the_link.connect()
            return
        except transport.LinkUnavailableError as exc:
            print(f"aegis agent: warning: master {the_link.settings.grpc_target} unreachable "
                  f"({one_line(str(exc))}); this pod rejoins a running job: trying again",
                  file=sys.stderr, flush=True)  # fmt: skip
            await asyncio.sleep(transport.RETRY_S)  # a pause between tries, not a wait


async def _connect(the_link: link.MasterLink) -> int | None:
    """0 once connected; None when the master is unreachable (said in one line), the
    configuration error's exit status when it refuses."""
    target = the_link.settings.grpc_target
    try:
        await _connect_rejoining(the_link) if the_link.settings.rejoin else await the_link.connect()
    except transport.LinkUnavailableError as exc:
        print(
            f"aegis agent: warning: master {target} unreachable ({one_line(str(exc))}); "
            "running the command independently, without fault tolerance",
            file=sys.stderr,
            flush=True,
        )
        return None
    except TlsRefusedError as exc:
        print(f"aegis agent: error: no TLS session with the master: {one_line(exc.detail)}",
              file=sys.stderr)  # fmt: skip
        return CONFIG_ERROR_EXIT
    except CredsRefusedError as exc:
        print(f"aegis agent: error: the master refused credentials: {one_line(str(exc))}",
              file=sys.stderr)  # fmt: skip
        return CONFIG_ERROR_EXIT
    return 0


def _saver_settings(
    settings: link_settings.LinkSettings, shm_root: Path = Path("/dev/shm")
) -> process.DaemonSettings | None:
    """The pod's checkpoint saver: shared memory owned by this agent (keyed by node, so a
    replacement elsewhere reads the disk copy, and by the job's submission, so a new job of
    the same name never loads an old one's state), persisted under ``<ckpt_dir>/<pod>``. What
    an earlier submission's killed agent left in shared memory for this pod is removed."""
    if settings.ckpt_dir is None:
        return None
    s = settings
    prefix = link_settings.memory_prefix(s.namespace, s.job, s.pod, s.node)
    shm_dir = shm_root / (prefix + link_settings.digest(s.token))
    link_settings.forget_memory(
        shm_root, prefix, "an earlier submission", keep=shm_dir, level=logging.WARNING
    )
    try:  # this agent's now (a live one's is never removed as left over)
        owners.claim(shm_dir)
    except OSError as exc:  # a full /dev/shm: the saves say so; a run beside may remove it
        log.warning("cannot name this agent the owner of %s: %s", shm_dir, exc)
    return process.DaemonSettings(shm_dir=shm_dir, ckpt_dir=settings.ckpt_dir / settings.pod)


def go_on_counting(
    sup_settings: supervisor.SupervisorSettings, shm: Path
) -> supervisor.SupervisorSettings:
    """An agent that died with its container (killed, out of memory) left its saves in the pod's
    shared memory, stamped with its incarnations: this one's training goes on counting after
    them, so that a commit of the old timeline past the step the job resumes from, persisted
    after the round that rewound to it, is dropped as the abandoned timeline's
    (:mod:`aegis.agent.commit_rule`). Counted from 0 again, after a predecessor that had
    restarted in place, such a commit was reported as the new timeline's. (Before the first
    order every commit is reported, as the predecessor would have: the master has not rewound
    yet, and after a pod moved it runs its checks first.) Shared memory it cannot read counts
    as none."""
    try:
        newest = lay.newest_incarnation(shm)
    except OSError as exc:
        log.warning("cannot read %s for a previous agent's saves: %s", shm, exc)
        return sup_settings
    if newest < 0:
        return sup_settings
    log.warning("%s holds saves of incarnation %d, from this pod's previous agent: the "
                "training's restart count goes on from %d", shm, newest, newest + 1)  # fmt: skip
    return dataclasses.replace(sup_settings, first_count=newest + 1)


async def _shut_down(
    the_link: link.MasterLink,
    tasks: list[asyncio.Task[None]],
    sup: supervisor.Supervisor,
    saver: Saver | None,
    terminated: asyncio.Event,
) -> None:
    """The link's tasks cancelled, the link closed, then the training group stopped (SIGTERM,
    grace, SIGKILL) while the signals are still handled: a SIGINT during the grace period goes
    to the group, a second SIGTERM changes nothing. On the master's exit order (not on a
    SIGTERM, and no longer once one comes) what the training handed to the saver is persisted
    first (its last save returned once in shared memory; at most ``flush_s``); then the saver
    is stopped and its memory removed. Whatever fails on the way, the rest is done (the saver
    always stopped while the reaper still collects it)."""
    for task in tasks:
        task.cancel()
    # (a task that crashed was logged and re-raised by ``_wait_done``: its error must not cut
    # the clean-up short)
    await asyncio.gather(*tasks, return_exceptions=True)
    try:
        try:
            await the_link.close()
        except Exception as exc:  # a dead master's connection: nothing left to close
            log.warning("closing the link to the master: %r", exc)
        await sup.stop()
        if saver is not None and not terminated.is_set():
            await saver[0].flush(terminated)
    finally:
        if saver is not None:
            daemon, supervising = saver
            supervising.cancel()
            await asyncio.gather(supervising, return_exceptions=True)
            shutil.rmtree(daemon.settings.shm_dir, ignore_errors=True)


async def _wait_done(the_link: link.MasterLink, tasks: list[asyncio.Task[None]]) -> int:
    """The exit code ordered by the master; a crashed link task is logged and re-raised."""
    done_waiter: asyncio.Future[int] = asyncio.ensure_future(the_link.done)
    pending: set[asyncio.Future[object]] = {done_waiter, *tasks}  # type: ignore[arg-type]
    while not the_link.done.done():
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for future in finished:
            error = future.exception() if future is not done_waiter else None
            if error is not None:
                log.error("agent task crashed: %r", error)
                raise error
    return the_link.done.result()
