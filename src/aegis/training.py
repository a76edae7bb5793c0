"""Training side of the agent channel: ``aegis.progress(step)`` (no network, well under 1 µs) and
checkpoint requests.

The agent creates a small file (in ``/dev/shm`` where it exists) and names it in the
environment variable ``AEGIS_PROGRESS_FILE``. The first call maps it; every call writes the
step and ``time.monotonic()`` into it with one ``struct.pack_into``. Without the variable (not
under an agent), or when the file cannot be mapped, a call does nothing. Keep this module free of
heavy imports: it is loaded inside training processes.

A script that never calls ``aegis.progress`` has its optimizer steps reported all the same
(:func:`report_step`, from :mod:`aegis.autoprogress`'s step hook); the first ``report`` of a
script that does call it silences the hook for good: an explicit step takes precedence.

The same file carries checkpoint requests the other way (the master asks for a checkpoint
before a drain or an eviction): the agent writes a request (id, the step to save at, how long
to hold after saving) and ``report`` answers whether one is due, with one more unpack; the
training side (``aegis.checkpoint.save_if_requested``) marks it answered and says once that it
takes requests at all, so the agent can tell a script that never will.

Layout (64 bytes): step q @0, time d @8 (training); request id q @16, target step q @24,
hold-until d @32 (agent, ``time.monotonic()`` clock); answered id q @40, opted-in q @48
(training); input time d @56 (training: the seconds from the end of the last reported step to
the first forward after it, :mod:`aegis.autoprogress`; 0.0: not measured); the script's own saves
(training, :func:`report_saved`): the step of the last q @64, how many so far q @72. A file of an
older agent (64 bytes) carries no saves.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from types import TracebackType

ENV_VAR = "AEGIS_PROGRESS_FILE"
LAYOUT = struct.Struct("<qd")  # step (int64), time.monotonic() of the call (float64)
REQUEST = struct.Struct("<qqdq")  # request id, target step, hold until, answered id @16
REQUEST_AT = 16
REQUEST_ONLY = struct.Struct("<qqd")  # what the agent writes @16
ANSWERED = struct.Struct("<q")
ANSWERED_AT = 40
OPTED_IN = struct.Struct("<q")
OPTED_IN_AT = 48
INPUT = struct.Struct("<d")
INPUT_AT = 56
SAVED = struct.Struct("<qq")  # the step of the script's last own save, how many saves so far
SAVED_AT = 64
SIZE = 80


class _Writer:
    """The mapping, opened on first use; ``disabled`` once known to be unavailable."""

    __slots__ = ("buffer", "disabled", "explicit", "opted_in")

    def __init__(self) -> None:
        self.buffer: mmap.mmap | None = None
        self.disabled = False
        self.explicit = False  # the script reports its steps itself (``report``)
        self.opted_in = False  # this process told the agent that it takes requests

    def open(self) -> mmap.mmap | None:
        path = os.environ.get(ENV_VAR)
        try:
            if not path:
                raise FileNotFoundError(ENV_VAR)
            fd = os.open(path, os.O_RDWR)
            try:
                buffer = mmap.mmap(fd, 0)  # the whole file: an older agent's is shorter
            finally:
                os.close(fd)
            if len(buffer) < SAVED_AT:
                buffer.close()
                raise ValueError(f"{path}: {len(buffer)} bytes")
            self.buffer = buffer
        except (OSError, ValueError):
            self.disabled = True
        else:
            say_when_dying()
        return self.buffer


# An uncaught exception ends the interpreter, but a torch process then takes 0.5-1 s to finish
# here (much longer when NCCL's teardown hangs). Under an agent the hook says so at once, after
# the traceback (any hook installed before runs first, unchanged): the agent reports the fault
# then, not when the process is finally gone. ``sys.excepthook`` runs only for the main
# thread's uncaught exception, never for ``SystemExit``; a ``KeyboardInterrupt`` (a SIGINT,
# maybe the agent's forwarded one) is no fault of the script's: its exit by the signal tells.
# Installed at start-up in every process of a job (:mod:`aegis.autoprogress`) and again at the
# first mapping unless still in place (the script may have replaced ``sys.excepthook``
# meanwhile).
DYING_MARKER = "[aegis] exiting on an uncaught "


def say_when_dying() -> None:
    """Wrap ``sys.excepthook`` with the dying report, unless it is ours already."""
    previous = sys.excepthook
    if getattr(previous, "aegis_dying", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        try:
            previous(kind, value, tb)
        finally:
            if not issubclass(kind, KeyboardInterrupt):
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"{DYING_MARKER}{kind.__name__} (pid {os.getpid()})\n")
                    sys.stderr.flush()

    hook.aegis_dying = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_DYING_LINE = re.compile(
    r"(?:\[rank\d+\]: )?" + re.escape(DYING_MARKER) + r"([\w.]+) \(pid (\d+)\)"
)


def dying_pid(line: str) -> tuple[str, int] | None:
    """(exception name, pid) of a line the hook wrote (torch.distributed may have prefixed it
    with ``[rankN]: ``), else None."""
    found = _DYING_LINE.fullmatch(line)
    return (found[1], int(found[2])) if found else None


# The one piece of module state: a per-process cache of the mapping (forked children share it).
_writer = _Writer()
_pack_into = LAYOUT.pack_into
_monotonic = time.monotonic


_unpack_request = REQUEST.unpack_from


def report(step: int) -> bool:
    """Tell the agent that training reached ``step``; a no-op when not under an agent.
    True when the master asked for a checkpoint that is due at this step. From the first call
    on, the optimizer step hook (:mod:`aegis.autoprogress`) stops reporting."""
    _writer.explicit = True
    buffer = _write_step(step)
    if buffer is None:
        return False
    request: int
    target: int
    answered: int
    request, target, _, answered = _unpack_request(buffer, REQUEST_AT)
    return request > answered and step >= target


def report_step(step: int) -> bool:
    """What the optimizer step hook (:mod:`aegis.autoprogress`) reports: ``step``, unless the
    script reports its own steps. False when it does, or when there is no agent (the hook can
    go then)."""
    if _writer.explicit:
        return False
    return _write_step(step) is not None


def _write_step(step: int) -> mmap.mmap | None:
    """``step`` into the progress file (opened at the first call); the buffer, or None when
    there is no agent."""
    buffer = _writer.buffer
    if buffer is None:
        if _writer.disabled:
            return None
        buffer = _writer.open()
        if buffer is None:
            return None
    _pack_into(buffer, 0, step, _monotonic())
    return buffer


def report_input(seconds: float) -> None:
    """The input time of the step in progress (from the end of the last reported step to its
    first forward) into the progress file, when it is mapped; else nothing."""
    buffer = _writer.buffer
    if buffer is not None:
        _pack_input(buffer, INPUT_AT, seconds)


_pack_input = INPUT.pack_into


def report_saved() -> None:
    """The script saved a checkpoint of its own (``torch.save`` to a file, a distributed
    checkpoint: :mod:`aegis.autoprogress`) after the last reported step: that step, and one more
    save, into the progress file when it is mapped (and long enough); else nothing."""
    buffer = _writer.buffer
    if buffer is None or len(buffer) < SIZE:
        return
    step = LAYOUT.unpack_from(buffer, 0)[0]
    saves = SAVED.unpack_from(buffer, SAVED_AT)[1]
    SAVED.pack_into(buffer, SAVED_AT, step, saves + 1)


@dataclass(frozen=True, slots=True)
class Request:
    """A checkpoint request as the training side sees it."""

    id: int
    target_step: int
    hold_until: float  # time.monotonic(); 0.0: do not hold after saving


def pending_request(step: int | None, *, opt_in: bool = True) -> Request | None:
    """The request due at ``step`` (any unanswered one for None) that is not answered yet,
    None if none (or no agent). With ``opt_in`` also tells the agent, once, that this process
    takes requests."""
    buffer = _writer.buffer
    if buffer is None and not _writer.disabled:
        buffer = _writer.open()
    if buffer is None:
        return None
    if opt_in and not _writer.opted_in:
        OPTED_IN.pack_into(buffer, OPTED_IN_AT, 1)
        _writer.opted_in = True
    request, target, hold_until, answered = _unpack_request(buffer, REQUEST_AT)
    if request > answered and (step is None or step >= target):
        return Request(request, target, hold_until)
    return None


def takes_requests() -> bool:
    """Whether this process has said it takes checkpoint requests."""
    return _writer.opted_in


def answer(request: Request) -> None:
    """Mark ``request`` answered (saved): ``report`` stops saying it is due."""
    buffer = _writer.buffer
    if buffer is not None:
        ANSWERED.pack_into(buffer, ANSWERED_AT, request.id)


def last_step() -> int | None:
    """The step last reported into the file this process's environment names, None if none."""
    buffer = _writer.buffer
    if buffer is None and not _writer.disabled:
        buffer = _writer.open()
    if buffer is None:
        return None
    step, ts = LAYOUT.unpack_from(buffer, 0)
    return None if ts == 0.0 else int(step)
