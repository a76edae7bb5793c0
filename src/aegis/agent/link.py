"""The agent's link to the master: one gRPC call for credentials, then NATS for everything else.

``MasterLink`` implements the supervisor's ``AgentReports`` port (exits, hangs) by publishing
Finish/Error/Hang on ``<prefix>.worker``, beats every ``heartbeat_s``, and executes the master's
orders (bootcheck, run, restart, stop, troubleshoot, exit) in order, each round at most once
(an order re-sent after a master failover or for a lost message is ignored). When its
credentials expire the server closes the connection for good; the link bootstraps again.

An order is taken only when signed with the master's key (the issuer of the link's own
credentials; a server without auth has none), so no one else can move its epoch; of its
environment only the keys the master sends (``messages.ORDER_ENV_KEYS``) are applied, any other
is dropped. Whatever is dropped is counted (``dropped``, ``dropped_env``), logged at a bounded
rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import re
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from aegis.adapters import nats_auth
from aegis.adapters.aio import cancellations, raise_if_cancelled
from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_bus import BusClosedError, NatsBus
from aegis.agent import decline_rule, exit_rule, ports, supervisor
from aegis.checkpoint import outage
from aegis.checks import config as checks_config
from aegis.checks import host as check_host
from aegis.checks import suites
from aegis.checks.base import DEFAULT_BUDGETS_S, CheckSettings, GroupInfo, PerfSettings
from aegis.core.errors import AegisError
from aegis.core.phases import Order, Phase
from aegis.wire import codec
from aegis.wire import messages as m
from aegis.wire.logsafe import RateLimitedLog, shown

log = logging.getLogger(__name__)

WATCHDOG_EVERY_BEATS = 30

_ACK = m.MessageType.ACK


@dataclass(frozen=True, slots=True)
class LinkSettings:
    grpc_target: str
    namespace: str
    job: str
    pod: str
    token: str
    node: str = ""
    heartbeat_s: float = 1.0
    resend_s: float = 2.0
    connect_timeout_s: float = 10.0
    scratch_dir: Path = Path("/tmp")
    inject: frozenset[str] = frozenset()
    checks: checks_config.ChecksConfig = field(default_factory=checks_config.ChecksConfig)
    ckpt_dir: Path | None = None  # where this pod's saver daemon persists (None: no saver)
    decline_after_s: float = 5.0  # a script silent this long after a checkpoint request
    tls_ca: Path | None = None  # TLS to the master and NATS, trusting this CA only


class LinkUnavailableError(AegisError):
    """Neither the master nor NATS answered in time: run independently."""


class MasterLink:
    def __init__(self, settings: LinkSettings) -> None:
        self.settings = settings
        self.incarnation = secrets.token_hex(4)
        self._ids = itertools.count()
        self.bus: NatsBus | None = None
        self.creds: grpc_creds.WorkerCreds | None = None
        self.sup: supervisor.Supervisor | None = None
        self.orders: asyncio.Queue[m.Message] = asyncio.Queue()
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.executed: set[tuple[int, str]] = set()
        self.run_round: tuple[Phase, int] = (Phase.RUN_COMMAND, -1)
        self._rebootstrapping = False
        self.hung = False
        # (pid, restart count) of incarnations whose fault went ahead of their exit
        self.dying_reported: set[tuple[int, int]] = set()
        self.ever_stepped = False  # some incarnation reported a step (aegis.progress)
        self.max_epoch = 0
        self.pending: list[m.Message] = []  # reports not yet answered by a newer round
        self.check_host: check_host.CheckHost | None = None  # warm collective checks (issue 9)
        self._tasks: set[asyncio.Task[None]] = set()
        self.verify: Callable[[bytes, str], bool] | None = None  # an order's signature
        self.dropped: Counter[str] = Counter()  # orders dropped, by reason
        self.dropped_env: Counter[str] = Counter()  # environment keys dropped from orders
        self._drop_log = RateLimitedLog(log)

    # -- connection ----------------------------------------------------------------------------

    async def connect(self) -> None:
        s = self.settings
        try:
            self.creds = await self._fetch_creds()
            self.bus = await NatsBus.connect(
                self.creds.nats_url,
                self.creds.creds,
                name=f"aegis-agent-{s.pod}",
                on_error=self._on_nats_error,
                on_closed=self._on_closed,
                connect_timeout_s=s.connect_timeout_s,
                tls_ca=s.tls_ca,
            )
        except (ConnectionError, OSError, TimeoutError) as exc:
            raise LinkUnavailableError(str(exc)) from exc
        self.verify = nats_auth.order_verifier(self.creds.creds.jwt)
        await self.bus.subscribe(f"{self.creds.subject_prefix}.master", self._on_order)
        await self._send(
            m.MessageType.ACK, Phase.PENDING, 0,
            m.AckData(s.node, pod_address(os.environ, s.grpc_target), self.incarnation),
        )  # fmt: skip
        await self.bus.flush()

    async def _fetch_creds(self) -> grpc_creds.WorkerCreds:
        """Any master replica hands out credentials: try each address in turn. A refusal looks
        the same whatever its cause (a replica may not know the job yet): the next one is
        asked; a refusal is final when no replica gives credentials. With ``tls_ca`` the call
        speaks TLS, trusting that CA only; a TLS mismatch is a refusal (``TlsRefusedError``)."""
        s = self.settings
        targets = [t.strip() for t in s.grpc_target.split(",") if t.strip()]
        per_target = s.connect_timeout_s / max(1, len(targets))
        error: Exception = ConnectionError(f"no master address in {s.grpc_target!r}")
        refused: grpc_creds.CredsRefusedError | None = None
        for target in targets:
            try:
                return await grpc_creds.fetch(
                    target,
                    namespace=s.namespace,
                    job=s.job,
                    pod=s.pod,
                    token=s.token,
                    timeout_s=per_target,
                    tls_ca=s.tls_ca,
                )
            except (ConnectionError, OSError, TimeoutError) as exc:
                error = exc
            except grpc_creds.CredsRefusedError as exc:
                refused = exc
        raise refused or error

    def _on_nats_error(self, exc: Exception) -> None:
        if "expired" in str(exc).lower():
            self._on_closed()

    def _on_closed(self) -> None:
        """The connection closed for good without our asking (the server closes it when the
        credentials expire): bootstrap again, in the background."""
        if self._rebootstrapping or self.done.done():
            return
        self._rebootstrapping = True
        task = asyncio.get_running_loop().create_task(self._rebootstrap(), name="rebootstrap")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _rebootstrap(self) -> None:
        """Fetch new credentials and reconnect, trying again until it works (reports made
        meanwhile wait in ``pending`` and go out with the next resend)."""
        log.warning("the NATS connection closed (credentials expired?): bootstrapping again")
        old = self.bus
        try:
            while not self.done.done():
                try:
                    await self.connect()
                    break
                except LinkUnavailableError as exc:
                    log.warning("bootstrapping again failed (%s); trying again in 1 s", exc)
                    await asyncio.sleep(1.0)
                except grpc_creds.CredsRefusedError as exc:  # an ended job, most likely
                    log.warning("bootstrapping again refused (%s); trying again in 5 s", exc)
                    await asyncio.sleep(5.0)
        finally:
            self._rebootstrapping = False
        if old is not None and old is not self.bus:
            await old.close()

    def env(self) -> dict[str, str]:
        """The environment of the training command: torchrun's and Kubeflow's variables."""
        assert self.creds is not None
        s, c = self.settings, self.creds
        return {
            "RANK": str(c.rank),
            "WORLD_SIZE": str(c.worker_num),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "PET_NNODES": str(c.worker_num),
            "PET_NODE_RANK": str(c.rank),
            "AEGIS_JOB": s.job,
            "AEGIS_NAMESPACE": s.namespace,
            "AEGIS_POD": s.pod,
            "AEGIS_NODE": s.node,
        }

    # -- reports (the supervisor's port) -------------------------------------------------------

    async def child_exited(self, report: ports.ExitReport) -> None:
        incarnation = (report.pid, report.restart_count)
        reported = incarnation in self.dying_reported
        self.dying_reported.discard(incarnation)
        phase, seq = self.run_round
        match exit_rule.on_exit(report, reported):
            case exit_rule.Finished():
                await self._send(m.MessageType.FINISH, phase, seq, m.ExitData(0))
            case exit_rule.Failed(reason=reason, fault_class=cls):
                await self._send_error(phase, seq, reason, report.exit_status, report.evidence, cls)
            case None:
                pass

    async def child_dying(self, report: ports.DyingReport) -> None:
        """The training process is exiting on an uncaught exception: report the fault now (the
        master's round begins while the interpreter finishes; its order stops what is left)."""
        phase, seq = self.run_round
        self.dying_reported.add((report.pid, report.restart_count))
        said = _exception_line(report.evidence, report.exception)
        reason = f"uncaught {said} (reported as the process exits)"
        await self._send_error(phase, seq, reason, 1, report.evidence)

    async def _send_error(
        self,
        phase: Phase,
        seq: int,
        reason: str,
        exit_code: int,
        evidence: ports.Evidence,
        fault_class: str | None = None,
    ) -> None:
        lines = [f"{x.fault_class}: {x.line}" for x in evidence.matches[-5:]]
        lines += list(evidence.last_lines[-20:])
        cls = evidence.fault_class or "" if fault_class is None else fault_class
        step = self.sup.last_step if self.sup is not None else None
        data = m.ErrorData(reason=reason, fault_class=cls, exit_code=exit_code, lines=lines,
                           step=step)  # fmt: skip
        await self._send(m.MessageType.ERROR, phase, seq, data)

    async def hang_detected(self, report: ports.HangReport) -> None:
        self.hung = True
        stacks = "\n".join(s.section() for s in report.stacks)
        phase, seq = self.run_round
        data = m.HangData(report.idle_s, stacks, report.timeout_s, report.why)
        await self._send(m.MessageType.HANG, phase, seq, data)

    async def checkpoint_committed(self, step: int) -> None:
        """The saver daemon committed ``step``: the master's safe point for evictions."""
        phase, seq = self.run_round
        await self._send(m.MessageType.CHECKPOINT, phase, seq, m.CheckpointData(step))

    async def checkpoint_store(self, report: outage.StoreReport) -> None:
        """The saver daemon cannot persist (or can again): the master logs and counts it."""
        phase, seq = self.run_round
        await self._send(m.MessageType.CHECKPOINT, phase, seq, report)

    async def fault_seen(self, report: ports.FaultReport) -> None:
        log.info("fault signature %s: %s", report.match.fault_class, report.match.line)

    async def _send(self, kind: m.MessageType, phase: Phase, seq: int, data: m.Payload) -> None:
        if self.bus is None or self.creds is None:
            return
        s = self.settings
        msg = m.Message(
            job=s.job,
            namespace=s.namespace,
            pod=s.pod,
            type=kind,
            phase=phase,
            seq=seq,
            ts=time.time(),
            data=data,
            id=f"{s.pod}/{self.incarnation}/{next(self._ids)}",
        )
        if kind not in (m.MessageType.HEARTBEAT, m.MessageType.CHECKPOINT):
            self.pending.append(msg)
        await self._publish(msg)

    async def _publish(self, msg: m.Message) -> None:
        """Out on the worker subject; while the connection is closed (until it is bootstrapped
        again) nothing goes: a report stays in ``pending`` for the resend."""
        assert self.bus is not None and self.creds is not None
        try:
            subject = nats_auth.worker_subject(self.creds.subject_prefix, self.settings.pod)
            await self.bus.publish(subject, codec.encode(msg))
        except BusClosedError:
            log.debug("not sent while disconnected: %s %s", msg.type, msg.id)

    async def resend(self) -> None:
        """Reports that may have reached no master (a failover) go again, same id, until a
        newer round shows they were heard; the master counts each at most once."""
        since = cancellations()
        while not self.done.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.done), self.settings.resend_s)
            except TimeoutError:
                raise_if_cancelled(since)
                if self.bus is not None and self.creds is not None:
                    for msg in list(self.pending):
                        await self._publish(msg)

    async def beat(self) -> None:
        since = cancellations()
        said, beats = "", 0
        while not self.done.done():
            phase, seq = self.run_round
            seen = self.sup.last_progress if self.sup is not None else None
            step, step_ts = (None, None) if seen is None else seen
            self.ever_stepped |= step is not None
            watchdog = self.sup.hang_timeout_text if self.sup is not None else ""
            # the watchdog's choice when it changes, and now and then (a new leader learns it)
            again = watchdog != said or beats % WATCHDOG_EVERY_BEATS == 0
            # when the step ended and when this beat left, on this host's clock: the master's
            # straggler scores (core/stragglers.py)
            sent = time.monotonic() if seen is not None else None
            input_s = self.sup.last_input_s if self.sup is not None else None
            data = m.HeartbeatData(step, watchdog if again else "", step_ts, sent, input_s)
            said, beats = watchdog, beats + 1
            await self._send(m.MessageType.HEARTBEAT, phase, seq, data)
            try:
                await asyncio.wait_for(asyncio.shield(self.done), self.settings.heartbeat_s)
            except TimeoutError:
                raise_if_cancelled(since)

    # -- orders --------------------------------------------------------------------------------

    async def _on_order(self, subject: str, payload: bytes) -> None:
        msg = self._accepted_order(payload)
        if msg is None:
            return
        assert isinstance(msg.data, m.OrderData)
        if msg.epoch < self.max_epoch:
            log.warning(
                "ignored an order of a deposed master (epoch %d < %d)", msg.epoch, self.max_epoch
            )
            return
        self.max_epoch = msg.epoch
        self.pending = [r for r in self.pending if r.seq >= msg.seq and r.type is not _ACK]
        if msg.data.pods and self.settings.pod not in msg.data.pods:
            return
        self.orders.put_nowait(msg)

    def _accepted_order(self, payload: bytes) -> m.Message | None:
        """The order, signed by the master, of this job, with only the environment keys the
        agent knows; None (counted, logged at a bounded rate) for anything else."""
        try:
            msg = codec.decode(payload)
        except codec.WireError as exc:
            self._drop(exc.reason, str(exc))
            return None
        if not isinstance(msg.data, m.OrderData):
            self._drop("not_an_order", f"a {msg.type} on the master subject")
            return None
        if self.verify is not None and not self.verify(codec.signed_part(msg), msg.sig):
            self._drop("unsigned", f"{msg.data.order}#{msg.seq} epoch {msg.epoch}")
            return None
        if (msg.job, msg.namespace) != (self.settings.job, self.settings.namespace):
            self._drop("wrong_job", f"an order of {msg.namespace}/{msg.job}")
            return None
        unknown = sorted(k for k in msg.data.env if k not in m.ORDER_ENV_KEYS)
        if not unknown:
            return msg
        for key in unknown:  # bounded: at most 64 distinct names kept, each at most 64 long
            kept = key[:64] if key[:64] in self.dropped_env or len(self.dropped_env) < 64 else ""
            self.dropped_env[kept or "(others)"] += 1
        self._drop_log.warning(
            "dropped environment key(s) %s of order %s#%d (not a key orders carry; %d in all)",
            ", ".join(shown(k) for k in unknown[:5]), msg.data.order, msg.seq,
            sum(self.dropped_env.values()),
        )  # fmt: skip
        env = {k: v for k, v in msg.data.env.items() if k in m.ORDER_ENV_KEYS}
        return msgspec.structs.replace(msg, data=msgspec.structs.replace(msg.data, env=env))

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        self._drop_log.warning("dropped an order (%s: %s; %d in all)", reason,
                               shown(detail, 200), sum(self.dropped.values()))  # fmt: skip

    async def execute_orders(self, sup: supervisor.Supervisor) -> None:
        self.sup = sup
        while not self.done.done():
            msg = await self.orders.get()
            assert isinstance(msg.data, m.OrderData)
            key = (msg.seq, msg.data.order.value + msg.data.env.get(m.CKPT_REQUEST_ENV, ""))
            if key in self.executed:
                continue  # a round already executed (re-sent order): harmless
            self.executed.add(key)
            await self._execute(sup, msg, msg.data)

    async def _execute(
        self, sup: supervisor.Supervisor, msg: m.Message, order: m.OrderData
    ) -> None:
        log.info("order %s#%d", order.order, msg.seq)
        match order.order:
            case Order.RUN | Order.RESTART:
                self.run_round = (msg.phase, msg.seq)
                self.hung = False
                env = _round_env(order.env)
                if order.order is Order.RESTART or sup.running:
                    await sup.restart(env)  # AEGIS_RESTART_COUNT + 1, same agent
                else:
                    await sup.start(env)
            case Order.STOP:
                await sup.stop()
            case Order.BOOTCHECK | Order.TROUBLESHOOT:
                if order.order is Order.TROUBLESHOOT:
                    await sup.stop()
                results = await self._checks(order)
                response = m.ChecksData(m.CheckResponse(results))
                await self._send(m.MessageType.FINISH, msg.phase, msg.seq, response)
            case Order.EXIT:
                await sup.stop()
                if not self.done.done():
                    self.done.set_result(order.exit_code)
            case Order.CHECKPOINT:
                self._checkpoint_requested(sup, msg, order)

    def _checkpoint_requested(
        self, sup: supervisor.Supervisor, msg: m.Message, order: m.OrderData
    ) -> None:
        """Hand the master's checkpoint request to the training (through the progress file),
        and tell the master when the script will never answer it."""
        env = order.env
        request = int(env.get(m.CKPT_REQUEST_ENV, str(msg.seq)))
        target = int(env.get(m.CKPT_STEP_ENV, "0"))
        hold_s = float(env.get(m.CKPT_HOLD_ENV, "0"))
        if not sup.running:
            log.info("checkpoint request %d: no training running", request)
            return
        log.info("checkpoint request %d: save at step %d, hold %.0f s", request, target, hold_s)
        sup.request_checkpoint(request, target, hold_s)
        task = asyncio.get_running_loop().create_task(
            self._decline_unless_taken(sup, msg, request), name="checkpoint-request"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _decline_unless_taken(
        self, sup: supervisor.Supervisor, msg: m.Message, request: int
    ) -> None:
        """Tell the master when the training shows it will not answer (``decline_rule``), so
        the drain does not wait in vain; the progress file has no notification: looked at
        every 0.1 s."""
        first = sup.last_step
        loop = asyncio.get_running_loop()
        started = loop.time()
        while sup.running and not self.done.done():
            if sup.takes_checkpoint_requests:
                return
            step = sup.last_step
            self.ever_stepped |= step is not None
            if first is None:
                first = step
            waited_s = loop.time() - started
            if decline_rule.declines(
                first, step, self.ever_stepped, waited_s, self.settings.decline_after_s
            ):
                reason = (
                    "the training does not take checkpoint requests "
                    "(it never calls aegis.checkpoint.save_if_requested)"
                )
                log.warning("checkpoint request %d declined: %s", request, reason)
                data = m.CheckpointDeclinedData(str(request), reason)
                await self._send(m.MessageType.CHECKPOINT, msg.phase, msg.seq, data)
                return
            await asyncio.sleep(0.1)

    async def _checks(self, order: m.OrderData) -> list[m.CheckResult]:
        group = None
        if self.creds is not None and "CHECK_MASTER_PORT" in order.env:
            group = GroupInfo(
                rank=self.creds.rank,
                world_size=self.creds.worker_num,
                master_addr=order.env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(order.env["CHECK_MASTER_PORT"]),
            )
        configured = self.settings.checks
        settings = CheckSettings(
            scratch_dir=self.settings.scratch_dir,
            budgets_s={**DEFAULT_BUDGETS_S, **configured.budgets_s},
            enabled=configured.enabled,
            inject=self.settings.inject,
            group=group,
            hung=self.hung and _held_hung(order.env, self.settings.pod),
            host=self.check_host,
            ckpt_dir=self.settings.ckpt_dir / self.settings.pod if self.settings.ckpt_dir else None,
            perf=PerfSettings(straggler_score=own_score(order.env, self.settings.pod)),
        )
        if order.order is Order.BOOTCHECK:
            return await suites.bootcheck(settings)
        return await suites.troubleshoot(settings)

    async def close(self) -> None:
        if self.bus is not None:
            with contextlib.suppress(Exception):  # closed already (expired, never reconnected)
                await self.bus.flush()
            await self.bus.close()


def _round_env(order_env: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in order_env.items() if not k.startswith("CHECK_")}
    if "MASTER_ADDR" in env:
        env["PET_MASTER_ADDR"] = env["MASTER_ADDR"]
    if "MASTER_PORT" in env:
        env["PET_MASTER_PORT"] = env["MASTER_PORT"]
    return env


POD_IP_ENV = "AEGIS_POD_IP"


def pod_address(env: Mapping[str, str], master: str) -> str:
    """Where this pod's peers reach it (what its ACK says): ``AEGIS_POD_IP`` where the platform
    knows it (the local platform, a pod's ``status.podIP``), else this host's address on the
    route toward the master (a UDP socket's local address: no packet is sent); "" if neither."""
    given = env.get(POD_IP_ENV, "").strip()
    if given:
        return given
    host, _, port = master.split(",", maxsplit=1)[0].strip().rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host.strip("[]"), int(port)))
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return ""


def inject_from_env() -> frozenset[str]:
    """The chaos switch set by ``aegis run --inject-fault NODE:CHECK`` for this node."""
    raw = os.environ.get("AEGIS_INJECT_FAULT", "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _held_hung(env: dict[str, str], pod: str) -> bool:
    """Whether this pod's hang counts in the checks: the master names the pods it holds hung
    (a rank that waited in a collective for the stuck one is not); no name list: it does."""
    named = env.get(m.HUNG_PODS_ENV)
    return named is None or pod in named.split(",")


def own_score(env: Mapping[str, str], pod: str) -> float:
    """This pod's straggler score in a troubleshooting order (0.0: none, or not a number)."""
    for entry in env.get(m.STRAGGLER_SCORES_ENV, "").split(","):
        name, _, value = entry.partition("=")
        if name == pod:
            try:
                score = float(value)
            except ValueError:
                return 0.0
            return score if math.isfinite(score) and score > 0 else 0.0
    return 0.0


def _exception_line(evidence: ports.Evidence, name: str) -> str:
    """The traceback's last line for ``name`` ("RuntimeError: what it said"), at most 200
    characters, so two faults are the same only if they said the same; else the name."""
    for line in reversed(evidence.last_lines):
        text = _RANK_PREFIX.sub("", line.strip())  # torch.distributed's "[rank1]: "
        if text == name or text.startswith(f"{name}: "):
            return text[:200]
    return name


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
