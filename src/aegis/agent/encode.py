"""The agent's reports as wire messages, built from facts: pure (no I/O, no clock, no state).

The link calls these with what the supervisor reported (an exit, a dying process, a hang), with
a look at the training's progress (a heartbeat), and with the time and the message's number it
keeps itself. Which exit is reported, and with which fault class, is :mod:`exit_rule`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aegis import training as progress
from aegis.agent import exit_rule, ports
from aegis.core.phases import Phase
from aegis.wire import messages as m

WATCHDOG_EVERY_BEATS = 30  # a heartbeat repeats the watchdog's choice this often
EVIDENCE_MATCHES = 5  # the last signature matches an Error carries
EVIDENCE_LINES = 20  # and the last lines of output
EXCEPTION_CHARS = 200

_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
_EXCEPTION = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*: \S.*")  # "RuntimeError: what it said"


@dataclass(frozen=True, slots=True)
class Sender:
    """Who the messages are from: the job, the pod, this agent's incarnation."""

    job: str
    namespace: str
    pod: str
    incarnation: str


def message(
    sender: Sender, number: int, kind: m.MessageType, round_: tuple[Phase, int],
    data: m.Payload, ts: float,
) -> m.Message:  # fmt: skip
    """The ``number``-th message of this incarnation, of round ``round_`` (phase, seq)."""
    phase, seq = round_
    s = sender
    return m.Message(job=s.job, namespace=s.namespace, pod=s.pod, type=kind, phase=phase,
                     seq=seq, ts=ts, data=data,
                     id=f"{s.pod}/{s.incarnation}/{number}")  # fmt: skip


def resent(kind: m.MessageType) -> bool:
    """Whether a report goes again until a newer round shows it was heard (a heartbeat or a
    checkpoint report is not: the next one says as much)."""
    return kind not in (m.MessageType.HEARTBEAT, m.MessageType.CHECKPOINT)


def without_hangs(pending: list[m.Message]) -> list[m.Message]:
    """The reports still to resend once the hang reported is over (withdrawn)."""
    return [r for r in pending if r.type is not m.MessageType.HANG]


def unanswered(pending: list[m.Message], seq: int) -> list[m.Message]:
    """The reports still to resend once an order of round ``seq`` came: one of an older round
    was heard (the master moved on), and so was an ACK (the master sends orders)."""
    return [r for r in pending if r.seq >= seq and r.type is not m.MessageType.ACK]


def exited(
    report: ports.ExitReport, dying_reported: bool
) -> tuple[m.MessageType, m.ExitData | m.ErrorData] | None:
    """An ended incarnation's Finish or Error; None when it gets none (``exit_rule``)."""
    match exit_rule.on_exit(report, dying_reported):
        case exit_rule.Finished():
            return m.MessageType.FINISH, m.ExitData(0)
        case exit_rule.Failed(reason=reason, fault_class=cls):
            data = error(reason, report.exit_status, report.evidence, cls, report.step)
            return m.MessageType.ERROR, data
        case None:
            return None


def dying(report: ports.DyingReport) -> m.ErrorData:
    """The Error of a process exiting on an uncaught exception, sent before it is gone."""
    said = exception_line(report.evidence, report.exception)
    reason = f"uncaught {said} (reported as the process exits)"
    cls = report.evidence.fault_class or ""
    return error(reason, 1, report.evidence, cls, report.step)


def error(
    reason: str, exit_code: int, evidence: ports.Evidence, fault_class: str, step: int | None
) -> m.ErrorData:
    """An Error: the evidence's last matches and lines of output travel with it."""
    lines = [f"{x.fault_class}: {x.line}" for x in evidence.matches[-EVIDENCE_MATCHES:]]
    lines += list(evidence.last_lines[-EVIDENCE_LINES:])
    return m.ErrorData(reason=reason, fault_class=fault_class, exit_code=exit_code, lines=lines,
                       step=step)  # fmt: skip


def hang(report: ports.HangReport) -> m.HangData:
    stacks = "\n".join(s.section() for s in report.stacks)
    return m.HangData(report.idle_s, stacks, report.timeout_s, report.why, report.no_step_signal)


def heartbeat(progress: ports.Progress, said: str, beats: int, now: float) -> m.HeartbeatData:
    """The ``beats``-th heartbeat (from 0), ``said``: the watchdog's choice the last one told.
    The choice goes when it changes, and now and then (a new leader learns it); when the step
    ended and when this beat left (``now``), on this host's monotonic clock, go with a step:
    the master's straggler scores (``core/stragglers.py``)."""
    again = progress.hang_timeout != said or beats % WATCHDOG_EVERY_BEATS == 0
    sent = now if progress.step is not None else None
    return m.HeartbeatData(progress.step, progress.hang_timeout if again else "",
                           progress.step_ts, sent, progress.input_s, progress.hung)  # fmt: skip


def script_saved(
    progress: ports.Progress, said: int | None, beats: int
) -> m.ScriptSavedData | None:
    """What goes with the ``beats``-th heartbeat about the script's own saves: a save the last
    one did not tell (``said``), and the last one again now and then (NATS may lose one)."""
    saved = progress.saved_step
    if saved is None or (saved == said and beats % WATCHDOG_EVERY_BEATS != 0):
        return None
    return m.ScriptSavedData(saved)


def exception_line(evidence: ports.Evidence, name: str) -> str:
    """The traceback's last line for ``name``, at most 200 characters, so two faults are the
    same only if they said the same; else the name. The line as Python printed it: "RuntimeError:
    what it said", with its module for an exception from elsewhere than the builtins
    ("torch.OutOfMemoryError: CUDA out of memory ..."). When its message begins on a later line
    and the output's last line is another exception's (``mp.spawn``'s ProcessRaisedException
    carries its failed child's traceback), that line is added: the child's own error."""
    header = re.compile(rf"(?:[\w.]+\.)?{re.escape(name)}(?::(.*))?")
    tail = None  # the output's last line (the dying report's own line aside)
    for line in reversed(evidence.last_lines):
        text = _RANK_PREFIX.sub("", line.strip())  # torch.distributed's "[rank1]: "
        found = header.fullmatch(text)
        if found is not None:
            if (found[1] or "").strip():
                return text[:EXCEPTION_CHARS]
            said = text.rstrip(":")
            if tail is not None and _EXCEPTION.fullmatch(tail):
                said = f"{said}: {tail}"
            return said[:EXCEPTION_CHARS]
        if text and tail is None and progress.dying_pid(text) is None:
            tail = text
    return name
