"""Rendering of statuses and reports for people (rich tables) and machines (JSON lines)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.model import JobSpec, JobStatus, pods_by_rank, retries_of
from aegis.wire import logsafe


def pod_table(spec: JobSpec, status: JobStatus, title: str = "") -> Table:
    table = Table(title=title or None, title_justify="left", expand=False)
    for column in ("pod", "node", "inner phase", "finished", "retries", "last failure"):
        table.add_column(column)
    for pod, info in pods_by_rank(status):
        table.add_row(
            pod,
            info.node or "-",
            info.inner_phase.value,
            "yes" if info.finished else "no",
            str(info.retries),
            info.last_failed_reason or "-",
        )
    return table


def summary_line(spec: JobSpec, status: JobStatus) -> str:
    retries = ",".join(str(r) for r in retries_of(status))
    quit_flag = " should_quit" if status.should_quit else ""
    return (
        f"phase={status.phase.value} recover_count={status.recover_count} "
        f"retries=({retries}) seq={status.seq}{quit_flag}"
    )


def describe_event(event: ev.Event) -> str:
    fields = ", ".join(
        f"{name}={getattr(event, name)!s}" for name in event.__slots__ if getattr(event, name, "")
    )
    return f"{type(event).__name__}({fields})"


def describe_actions(actions: tuple[act.Action, ...], event: ev.Event | None = None) -> str:
    """The core's actions for one event, ``-`` when there are none. Only a real rejection
    (stale, duplicate, wrong phase, unknown pod, job over) reads "rejected"; a valid event that
    changes nothing (``IGNORED``) reads "no change (why)", and not even that for a checkpoint
    commit with nobody to evict: every commit but an eviction's is one."""
    parts: list[str] = []
    for action in actions:
        match action:
            case act.SendOrder(order=order, seq=seq, pods=pods):
                target = ",".join(pods) if pods else "all"
                parts.append(f"order {order.value}#{seq} -> {target}")
            case act.EvictPod(pod=pod, level=level, reason=reason):
                parts.append(f"evict {pod} (level {int(level)}: {reason})")
            case act.ReplacePod(pod=pod):
                parts.append(f"replace {pod}")
            case act.BlacklistNode(node=node):
                parts.append(f"blacklist {node}")
            case act.RecordFault(pod=pod, counted=counted):
                parts.append(f"fault of {pod} {'counted' if counted else 'not counted'}")
            case act.EndJob(phase=phase, reason=reason):
                parts.append(f"job {phase.value}: {reason}")
            case act.Rejected(reason=act.RejectReason.IGNORED, detail=detail):
                if not isinstance(event, ev.CheckpointCommitted):
                    parts.append(f"no change ({detail})")
            case act.Rejected(reason=reason, detail=detail):
                parts.append(f"rejected ({reason.value}: {detail})")
    return "; ".join(parts) if parts else "-"


class PeerSafeConsole(Console):
    """A console whose strings (printed, or cells of a table) are escaped for the terminal
    (:func:`logsafe.terminal_safe`): reasons and names come from peers and tracebacks."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(logsafe.terminal_safe(text), **kwargs)


def make_console(stderr: bool = False) -> Console:
    """A console that prints text as it is, but escaped for the terminal: reasons and names
    come from peers and tracebacks (gloo's ``[/path/pair.cc:537]`` is no markup tag), so no
    markup is read in them and no control character reaches the terminal."""
    return PeerSafeConsole(stderr=stderr, highlight=False, soft_wrap=True, markup=False)
