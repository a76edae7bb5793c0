"""``aegis run [options] -- CMD...``: the local platform with embedded NATS and master."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import typer
from rich.console import Console

from aegis.adapters import netns
from aegis.cli import live_view, options, paths, preflight, render, run_view
from aegis.core.phases import Phase
from aegis.master import faultlog, metrics
from aegis.master.job_runner import JobRunner
from aegis.platforms import emulated, job_files, local_run, replicated_run, run_settings
from aegis.platforms.follow import FollowedJob
from aegis.platforms.local import LocalPlatform
from aegis.wire.logsafe import one_line

log = logging.getLogger(__name__)


def register(app: typer.Typer) -> None:
    app.command(
        "run", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True}
    )(run)


def parse_injections(values: list[str]) -> dict[str, frozenset[str]]:
    """``NODE:CHECK`` pairs into node -> checks; a malformed one is a usage error."""
    from aegis.core.recovery import CheckType

    known = {c.value for c in CheckType} | {"slow"}
    table: dict[str, set[str]] = {}
    for value in values:
        node, sep, check = value.partition(":")
        if not sep or not node or check not in known:
            raise typer.BadParameter(
                f"expected NODE:CHECK with CHECK one of {', '.join(sorted(known))}, got {value!r}",
                param_hint="--inject-fault",
            )
        table.setdefault(node, set()).add(check)
    return {node: frozenset(checks) for node, checks in table.items()}


class RunObservers:
    """What ``aegis run`` hangs on the job's runner: a view, the fault log, metrics, and the
    control channel (``control.json`` in the log directory, removed when the run ends)."""

    def __init__(
        self,
        view: run_view.PlainView | live_view.LiveView | None,
        *,
        metrics_hub: metrics.MasterMetrics | None = None,
        fault_log: faultlog.FaultLogSettings | None = None,
        serve_control: bool = True,
    ) -> None:
        self.view, self.metrics, self.fault_log_settings = view, metrics_hub, fault_log
        self.serve_control = serve_control
        self.fault_log: faultlog.FaultLog | None = None
        self.control_file: Path | None = None
        self.control_ready: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def follow(self, job: FollowedJob, platform: LocalPlatform) -> None:
        """A job led by master processes (``--masters N``): only the view is this process's;
        the masters write the fault log and the control file and serve ``/metrics``."""
        if self.view is not None:
            self.view.attach(job, platform)

    def attach(self, runner: JobRunner, platform: LocalPlatform) -> None:
        log_dir = platform.settings.log_dir
        if self.view is not None:
            self.view.attach(runner, platform)
        settings = self.fault_log_settings or faultlog.FaultLogSettings(
            node_ip=platform.hosts.address  # the node's own (bridge) address when isolated
        )
        self.fault_log = faultlog.FaultLog(log_dir / "faults.jsonl", settings)
        self.fault_log.attach(runner)
        if self.metrics is not None:
            self.metrics.attach(runner, gpu_type=metrics.host_gpu_type())
        if self.serve_control:
            self.control_ready = asyncio.Event()
            task = asyncio.get_running_loop().create_task(
                self._control(runner, platform, log_dir), name="aegis-run-control"
            )
            self._tasks.add(task)
            task.add_done_callback(self._control_done)

    async def _control(self, runner: JobRunner, platform: LocalPlatform, log_dir: Path) -> None:
        self.control_file = await job_files.serve_control(runner, platform, log_dir)
        assert self.control_ready is not None
        self.control_ready.set()

    def _control_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("control channel failed", exc_info=task.exception())

    def close(self) -> None:
        if isinstance(self.view, live_view.LiveView):
            self.view.stop()
        if self.control_file is not None:
            self.control_file.unlink(missing_ok=True)


def _isolated(nats: str | None, metrics_addr: str, metrics_ports: list[int]) -> NoReturn:
    """``--isolate-nodes`` on the host: the same run again, inside a namespace of its own."""
    problem = netns.missing_prerequisite()
    if problem is not None:
        print(f"aegis: error: --isolate-nodes {problem}", file=sys.stderr)
        raise typer.Exit(2)
    if nats is not None:
        raise typer.BadParameter("the emulated cluster runs its own NATS", param_hint="--nats")
    raise typer.Exit(emulated.run_again_inside([(metrics_addr, p) for p in metrics_ports]))


def choose_view(
    mode: Literal["auto", "live", "plain"], console: Console, total_steps: int | None
) -> run_view.PlainView | live_view.LiveView:
    """The live table on a terminal, plain timestamped lines otherwise (CI, pipes)."""
    if mode == "live" or (mode == "auto" and console.is_terminal):
        return live_view.LiveView(console, total_steps=total_steps)
    return run_view.PlainView(sys.stdout)


LOG_FORMAT = "%(asctime)s.%(msecs)03d aegis: %(levelname)s %(message)s"
LOG_FORMAT_VERBOSE = "%(asctime)s.%(msecs)03d aegis: %(levelname)s %(name)s: %(message)s"


def log_handler(view: run_view.PlainView | live_view.LiveView, *, verbose: bool) -> logging.Handler:
    """Where this process's log lines go: through the live view's console while it is shown
    (above the table), else to stderr; without ``--verbose``, not those that say again what the
    view says."""
    handler = (
        view.log_handler()
        if isinstance(view, live_view.LiveView)
        else logging.StreamHandler(run_view.TerminalSafeStream(sys.stderr))
    )
    if not verbose:
        handler.addFilter(run_view.NotShownByTheView())
    # the view's own lines' shape ("10:05:47.407 aegis: ..."), the logger's name if verbose
    handler.setFormatter(
        logging.Formatter(LOG_FORMAT_VERBOSE if verbose else LOG_FORMAT, "%H:%M:%S")
    )
    return handler


# The options of ``aegis run``, one alias each, so the command's function stays short.
Cmd = Annotated[list[str], typer.Argument(help="The training command (after --).")]
Nodes = Annotated[int, typer.Option(min=1, max=64, help="Pods (one per node).")]
MaxRetry = Annotated[int, typer.Option(min=0, help="Fault budget.")]
SpareNodes = Annotated[int, typer.Option(min=0, help="Spare nodes for replacements.")]
HangTimeout = Annotated[
    float | None,
    typer.Option(min=0, help="0: no hang watchdog; default: calibrated by each agent."),
]
RepeatLimit = Annotated[
    int,
    typer.Option(
        min=0,
        help="Stop the job when the same error comes back at the same step this many "
        "times in a row (a deterministic bug: no restart fixes it); 0: never.",
    ),
]
ChecksOnEveryFault = Annotated[
    bool,
    typer.Option(
        "--checks-on-every-fault",
        help="Run the checks after every fault, a plain Python exception too (by default "
        "that restarts every pod in place at once).",
    ),
]
Grace = Annotated[
    float,
    typer.Option(min=0, help="Seconds a stopped pod gets between SIGTERM and SIGKILL."),
]
Job = Annotated[str, typer.Option(help="Job name (a DNS label).", callback=options.job_name)]
StatusFile = Annotated[
    Path | None,
    typer.Option(help="Write the final status here.", callback=paths.writable_file),
]
LogDir = Annotated[
    Path | None, typer.Option(help="events.jsonl, pod logs.", callback=paths.made_dir)
]
Nats = Annotated[
    str | None, typer.Option(help="Use this NATS server (no auth).", callback=options.nats_url)
]
InjectFault = Annotated[
    list[str] | None,
    typer.Option(
        help="NODE:CHECK, e.g. node-1:gpu (repeatable; runtime: a new container heals it; "
        "slow: the node turns slow at the first committed checkpoint)."
    ),
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v")]
Masters = Annotated[
    int, typer.Option(min=1, max=5, help="Master replicas (own processes, leader election).")
]
Prewarm = Annotated[
    str,
    typer.Option(
        help="Warm restarts: auto, 0 (cold) or modules, e.g. torch,numpy.",
        callback=options.prewarm,
    ),
]
MetricsAddr = Annotated[str, typer.Option(help="Address of /metrics.")]
View = Annotated[str, typer.Option(help="auto (live table on a terminal), live or plain.")]
TotalSteps = Annotated[
    int | None, typer.Option(min=1, help="Training steps, for the live progress bar.")
]
IsolateNodes = Annotated[
    bool,
    typer.Option(
        "--isolate-nodes",
        help="An emulated cluster: each node its own network (an address on a bridge), "
        "mount (/dev/shm) and UTS namespace, all in a network namespace made for the run "
        "(needs root, util-linux and iproute2).",
    ),
]


def run(  # noqa: PLR0913 (a typer command: one parameter per option)
    cmd: Cmd,
    nodes: Nodes = 3,
    max_retry: MaxRetry = 3,
    spare_nodes: SpareNodes = 2,
    hang_timeout_s: HangTimeout = None,
    heartbeat_timeout_s: options.HeartbeatTimeout = 5.0,
    join_timeout_s: options.JoinTimeout = 60.0,
    health_s: options.HealthEvery = 30.0,
    repeat_limit: RepeatLimit = 3,
    checks_on_every_fault: ChecksOnEveryFault = False,
    pace_window_s: options.PaceWindow = options.WINDOW_DEFAULT,
    pace_drop: options.PaceDrop = options.DROP_DEFAULT,
    grace_s: Grace = 5.0,
    job: Job = "job",
    status_file: StatusFile = None,
    log_dir: LogDir = None,
    nats: Nats = None,
    inject_fault: InjectFault = None,
    verbose: Verbose = False,
    masters: Masters = 1,
    prewarm: Prewarm = "auto",
    metrics_port: options.MetricsPort = 0,
    metrics_addr: MetricsAddr = "127.0.0.1",
    view: View = "auto",
    total_steps: TotalSteps = None,
    isolate_nodes: IsolateNodes = False,
) -> None:
    """Run CMD on --nodes local pods under Aegis; exit 0 when the job Succeeds, 1 when it Fails,
    128 + the signal when Ctrl-C, SIGTERM or SIGHUP stopped it (130, 143, 129), 2 for a bad
    option or a command not on this machine (before anything starts)."""
    preflight.exit_without_torch(tuple(["bash", "-c", cmd[0]] if len(cmd) == 1 else cmd))
    if isolate_nodes:
        metrics_addr = _enter_cluster(nats, metrics_addr, metrics_port, masters)
    settings = run_settings.RunSettings(
        command=tuple(["bash", "-c", cmd[0]] if len(cmd) == 1 else cmd),
        nodes=nodes, spare_nodes=spare_nodes, max_retry=max_retry, job=job,
        hang_timeout_s=hang_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
        join_timeout_s=join_timeout_s, health_s=health_s, repeat_limit=repeat_limit,
        software_restart=not checks_on_every_fault,
        pace_window_s=pace_window_s, pace_drop=pace_drop, grace_s=grace_s,
        log_dir=log_dir, status_file=status_file, nats_url=nats,
        inject=parse_injections(inject_fault or []), masters=masters, prewarm=prewarm,
        metrics_port=metrics_port if masters > 1 else 0, metrics_addr=metrics_addr,
        isolate_nodes=isolate_nodes,
    )  # fmt: skip
    if (unknown := run_settings.unknown_injected(settings)) is not None:
        raise typer.BadParameter(unknown, param_hint="--inject-fault")
    the_view = _view_and_logging(view, total_steps, verbose=verbose)
    preflight.exit_unless_found(settings.command)
    raise typer.Exit(_run_and_report(settings, the_view, metrics_port))


def _enter_cluster(nats: str | None, metrics_addr: str, metrics_port: int, masters: int) -> str:
    """``--isolate-nodes``: on the host, the same run again inside a namespace of its own (this
    never returns); inside it, the emulated cluster entered. Returns where /metrics binds."""
    if not emulated.inside():
        _isolated(
            nats, metrics_addr, [metrics_port + i for i in range(masters)] if metrics_port else []
        )
    emulated.enter_cluster()
    return "127.0.0.1"  # in the cluster's namespace; the host's side forwards


def _view_and_logging(
    view: str, total_steps: int | None, *, verbose: bool
) -> run_view.PlainView | live_view.LiveView:
    if view not in ("auto", "live", "plain"):
        raise typer.BadParameter("one of auto, live, plain", param_hint="--view")
    console = render.PeerSafeConsole(markup=False, highlight=False)
    the_view = choose_view(view, console, total_steps)  # type: ignore[arg-type]
    logging.basicConfig(
        handlers=[log_handler(the_view, verbose=verbose)],
        level=logging.INFO if verbose else logging.WARNING,
    )
    return the_view


def _run_and_report(
    settings: run_settings.RunSettings,
    view: run_view.PlainView | live_view.LiveView,
    metrics_port: int,
) -> int:
    """Run the job, in this process (one master) or under master processes (``--masters``);
    print its outcome; returns the exit status."""
    masters, metrics_addr = settings.masters, settings.metrics_addr
    if metrics_port and metrics_port + masters - 1 > 65535:
        raise typer.BadParameter(
            f"master {masters - 1} would serve on {metrics_port + masters - 1}",
            param_hint="--metrics-port",
        )
    hub = metrics.MasterMetrics() if metrics_port and masters == 1 else None
    server = options.serve_metrics(hub, metrics_port, metrics_addr) if hub is not None else None
    if metrics_port and masters > 1:
        where = ", ".join(f"master-{i} :{metrics_port + i}" for i in range(masters))
        print(f"aegis run: /metrics on {metrics_addr} ({where})", file=sys.stderr)
    observers = RunObservers(view, metrics_hub=hub)
    try:
        result = asyncio.run(
            local_run.run_local(settings, observe=observers.attach)
            if masters == 1
            else replicated_run.run_replicated(settings, follow=observers.follow)
        )
    except run_settings.RunStoppedError as exc:
        print(f"aegis run: {exc}; nothing of it is left", file=sys.stderr)
        return 128 + exc.signo
    finally:
        observers.close()
        if server is not None:
            with contextlib.suppress(Exception):
                server.close()
    status = result.status
    retries = ",".join(str(i.retries) for _, i in sorted(status.pod_infos.items()))
    # (the master's words may quote a pod's error: one line, escaped)
    why = f" ({one_line(result.ended)})" if result.ended and status.phase is Phase.FAILED else ""
    print(
        f"aegis run: job {result.spec.job} {status.phase.value}{why}; recover_count "
        f"{status.recover_count}/{result.spec.max_retry}, retries ({retries}); "
        f"error nodes: {', '.join(e.node for e in status.error_nodes) or 'none'}; "
        f"logs in {result.log_dir}"
    )
    return result.exit_code
