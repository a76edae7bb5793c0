"""``aegis ctl stop JOB | taint NODE.. --reason R | untaint NODE.. | hang POD |
drain NODE.. [--reason R] [--deadline-s T] | undrain NODE..``: operator controls (the seed's
atlctl), sent to the master over NATS with the credentials of its control file (``--ctl-file``,
``$AEGIS_CTL_FILE``, or ``control.json`` in ``--log-dir``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from nats import errors as nats_errors

from aegis.adapters import nats_bus, netns
from aegis.adapters.nats_bus import NatsBus
from aegis.core.errors import AegisError
from aegis.master import control, control_file

ctl_app = typer.Typer(help="Operator controls of a running master.", no_args_is_help=True)

LogDir = Annotated[Path | None, typer.Option(help="Log directory of an aegis run.")]
CtlFile = Annotated[Path | None, typer.Option(help="The control file (default $AEGIS_CTL_FILE).")]
Timeout = Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the master.")]
Namespace = Annotated[str | None, typer.Option(help="Default: the control file's.")]
Nodes = Annotated[list[str], typer.Argument(help="One or more nodes.")]
Request = Callable[[control_file.ControlTarget, str], control.ControlRequest]  # (target, inbox)


def register(app: typer.Typer) -> None:
    app.add_typer(ctl_app, name="ctl")


def _target(log_dir: Path | None, ctl_file: Path | None) -> control_file.ControlTarget:
    env = os.environ.get(control_file.CTL_FILE_ENV)
    path = ctl_file or (log_dir / control_file.CONTROL_FILE if log_dir else None)
    path = path or (Path(env) if env else None)
    if path is None:
        print("aegis: error: no control file: pass --log-dir, --ctl-file or set "
              f"{control_file.CTL_FILE_ENV}", file=sys.stderr)  # fmt: skip
        raise typer.Exit(2)
    try:
        return control_file.read_control_file(path)
    except (OSError, ValueError, KeyError) as exc:
        print(f"aegis: error: {control_file.unreadable(path, exc)}", file=sys.stderr)
        raise typer.Exit(2) from None


CLOSE_S = 2.0  # at most this long to close the connection after the reply


class NotPermittedError(AegisError):
    """The server refused what the control file's credentials tried (a permissions
    violation): no master will ever answer."""


async def _send(
    target: control_file.ControlTarget,
    build: Callable[[str], control.ControlRequest],
    timeout_s: float,
) -> control.ControlReply:
    denied: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_error(exc: Exception) -> None:
        text = nats_bus.error_text(exc)
        if "permissions violation" in text.lower() and not denied.done():
            denied.set_result(text)

    bus = await NatsBus.connect(target.nats_url, target.creds, name="aegis-ctl",
                                on_error=on_error, max_reconnect_attempts=0)  # fmt: skip
    prefix = target.creds.inbox_prefix if target.creds else "_INBOX"
    asking = asyncio.ensure_future(
        control.request(
            bus, build, inbox_prefix=prefix, timeout_s=timeout_s, subject=target.subject
        )
    )
    try:
        async with asyncio.timeout(timeout_s):  # the whole exchange, not only the wait
            either: set[asyncio.Future[Any]] = {asking, denied}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not asking.done():
            raise NotPermittedError(denied.result())
        return asking.result()
    finally:
        asking.cancel()
        try:
            await asyncio.wait({asking})  # however it ended; a cancel of this task goes on
        finally:
            # A server that went away meanwhile can leave nats-py's close waiting for ever (an
            # `aegis ctl drain` was seen idle an hour after its master's run had ended).
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_S):
                    await bus.close()
        if not asking.cancelled():
            asking.exception()  # retrieved: its error was raised above, or the answer came first


def _run(
    log_dir: Path | None,
    ctl_file: Path | None,
    timeout_s: float,
    build: Request,
) -> None:
    target = _target(log_dir, ctl_file)
    if target.netns:  # a run's emulated cluster: its NATS listens in its namespace
        try:
            netns.enter(target.netns)
        except OSError as exc:
            print(f"aegis: error: cannot reach the run's cluster: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None
    try:
        with nats_bus.errors_unlogged():  # a refusal is reported once, below
            reply = asyncio.run(_send(target, lambda inbox: build(target, inbox), timeout_s))
    except NotPermittedError as exc:
        print(f"aegis: error: not permitted: the control file's credentials may not send "
              f"control requests ({exc})", file=sys.stderr)  # fmt: skip
        raise typer.Exit(1) from None
    except TimeoutError:
        print(f"aegis: error: no answer from the master within {timeout_s} s", file=sys.stderr)
        raise typer.Exit(1) from None
    except OSError as exc:
        print(f"aegis: error: cannot reach {target.nats_url}: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    except nats_errors.Error as exc:  # the server refused (credentials, permissions)
        reason = nats_bus.error_text(exc)
        print(f"aegis: error: {target.nats_url} refused: {reason}", file=sys.stderr)
        raise typer.Exit(1) from None
    print(f"aegis ctl: {reply.message}", file=sys.stdout if reply.ok else sys.stderr)
    raise typer.Exit(0 if reply.ok else 1)


_KEYWORD = inspect.Parameter.KEYWORD_ONLY
_SHARED = (  # every command's last options, in this order
    inspect.Parameter("log_dir", _KEYWORD, default=None, annotation=LogDir),
    inspect.Parameter("ctl_file", _KEYWORD, default=None, annotation=CtlFile),
    inspect.Parameter("timeout_s", _KEYWORD, default=10.0, annotation=Timeout),
)


def _control(name: str) -> Callable[[Callable[..., Request]], Callable[..., None]]:
    """``aegis ctl NAME``: the decorated function takes the command's own arguments and options
    and says what to send; the command takes ``--log-dir``, ``--ctl-file`` and ``--timeout-s``
    after them, and sends it with :func:`_run`."""

    def register(request: Callable[..., Request]) -> Callable[..., None]:
        @functools.wraps(request)
        def command(
            *, log_dir: Path | None, ctl_file: Path | None, timeout_s: float, **options: Any
        ) -> None:
            _run(log_dir, ctl_file, timeout_s, request(**options))

        own = inspect.signature(request, eval_str=True).parameters.values()
        command.__signature__ = inspect.Signature([*own, *_SHARED])  # type: ignore[attr-defined]
        ctl_app.command(name)(command)
        return command

    return register


@_control("stop")
def stop(
    job: Annotated[str, typer.Argument(help="Job name.")],
    reason: Annotated[str, typer.Option(help="Recorded as the quit reason.")] = "stopped by user",
    namespace: Namespace = None,
) -> Request:
    """Stop a job: should_quit, phase Failed, every pod deleted."""
    return lambda t, inbox: control.ControlRequest(
        "stop", inbox, namespace or t.namespace, job=job, reason=reason
    )


@_control("taint")
def taint(
    nodes: Nodes, reason: Annotated[str, typer.Option(help="Why (kept with the blacklist entry).")]
) -> Request:
    """Keep pods off these nodes from now on (running pods stay)."""
    return lambda t, inbox: control.ControlRequest(
        "taint", inbox, t.namespace, nodes=nodes, reason=reason
    )


@_control("untaint")
def untaint(nodes: Nodes) -> Request:
    """Allow pods on these nodes again."""
    return lambda t, inbox: control.ControlRequest("untaint", inbox, t.namespace, nodes=nodes)


@_control("hang")
def hang(
    pod: Annotated[str, typer.Argument(help="Pod name (<job>-<rank>).")],
    namespace: Namespace = None,
) -> Request:
    """Report POD as hung, as its agent would: marked slow, evicted at the next checkpoint."""
    return lambda t, inbox: control.ControlRequest("hang", inbox, namespace or t.namespace, pod=pod)


def _check_nodes(nodes: list[str]) -> None:
    for node in nodes:
        if not control.NODE_NAME.fullmatch(node):
            print(f"aegis: error: bad node name {node!r} (letters, digits, '.', '_', '-')",
                  file=sys.stderr)  # fmt: skip
            raise typer.Exit(2)


@_control("drain")
def drain(
    nodes: Nodes,
    reason: Annotated[str, typer.Option(help="Why (kept with the node).")] = "maintenance",
    deadline_s: Annotated[
        float, typer.Option(min=0.0, help="Seconds to wait for the checkpoint's commit.")
    ] = 60.0,
) -> Request:
    """Planned maintenance: checkpoint the jobs with a pod there, move those pods off at the
    commit (or after the deadline), keep the nodes out until undrain. No fault is counted."""
    _check_nodes(nodes)
    return lambda t, inbox: control.ControlRequest(
        "drain", inbox, t.namespace, nodes=nodes, reason=reason, deadline_s=deadline_s
    )


@_control("undrain")
def undrain(nodes: Nodes) -> Request:
    """Make drained nodes schedulable again."""
    _check_nodes(nodes)
    return lambda t, inbox: control.ControlRequest("undrain", inbox, t.namespace, nodes=nodes)
