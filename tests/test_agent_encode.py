"""The agent's reports as wire messages: the pure encoders the link sends with."""

from __future__ import annotations

import msgspec

from aegis.agent import encode
from aegis.agent.ports import (
    DyingReport,
    Evidence,
    ExitReason,
    ExitReport,
    FaultClass,
    HangReport,
    Progress,
    SignatureMatch,
    StackDump,
)
from aegis.core.phases import Phase
from aegis.wire import codec
from aegis.wire import messages as m

SENDER = encode.Sender("job", "ns", "job-0", "abcd")
TRACEBACK = FaultClass.PYTHON_TRACEBACK


def _evidence(*lines: str, matches: int = 0) -> Evidence:
    found = tuple(
        SignatureMatch(TRACEBACK, TRACEBACK, "stderr", f"match {i}") for i in range(matches)
    )
    return Evidence(TRACEBACK if matches else None, found, lines)


def test_a_message_names_its_sender_round_and_number_and_travels() -> None:
    msg = encode.message(SENDER, 7, m.MessageType.FINISH, (Phase.RUN_COMMAND, 3),
                         m.ExitData(0), 12.5)  # fmt: skip
    assert (msg.job, msg.namespace, msg.pod, msg.phase, msg.seq) == (
        "job", "ns", "job-0", Phase.RUN_COMMAND, 3,
    )  # fmt: skip
    assert msg.id == "job-0/abcd/7" and msg.ts == 12.5
    assert codec.decode(codec.encode(msg)) == msg


def test_heartbeats_and_checkpoint_reports_are_not_resent_other_reports_are() -> None:
    assert not encode.resent(m.MessageType.HEARTBEAT)
    assert not encode.resent(m.MessageType.CHECKPOINT)
    for kind in (m.MessageType.ACK, m.MessageType.ERROR, m.MessageType.HANG, m.MessageType.FINISH):
        assert encode.resent(kind)


def test_an_order_of_a_round_answers_the_reports_of_older_rounds_and_the_ack() -> None:
    def sent(kind: m.MessageType, seq: int) -> m.Message:
        return encode.message(SENDER, seq, kind, (Phase.RUN_COMMAND, seq), m.ExitData(0), 1.0)

    pending = [sent(m.MessageType.ACK, 5), sent(m.MessageType.ERROR, 4),
               sent(m.MessageType.FINISH, 5), sent(m.MessageType.HANG, 6)]  # fmt: skip
    assert encode.unanswered(pending, 5) == pending[2:]


def test_an_exit_becomes_a_finish_an_error_with_its_step_or_nothing() -> None:
    clean = ExitReport(5, 0, 0, None, ExitReason.EXITED, _evidence())
    assert encode.exited(clean, dying_reported=False) == (m.MessageType.FINISH, m.ExitData(0))
    failed = ExitReport(5, 0, 1, None, ExitReason.EXITED, _evidence("boom", matches=1), 41)
    kind, data = encode.exited(failed, dying_reported=False) or (None, None)
    assert kind is m.MessageType.ERROR and isinstance(data, m.ErrorData)
    assert (data.reason, data.fault_class, data.exit_code, data.step) == (
        "exit status 1", TRACEBACK, 1, 41,
    )  # fmt: skip
    assert encode.exited(failed, dying_reported=True) is None
    stopped = ExitReport(5, 0, 143, 15, ExitReason.STOPPED, _evidence())
    assert encode.exited(stopped, dying_reported=False) is None


def test_an_error_carries_the_last_5_matches_and_the_last_20_lines() -> None:
    lines = tuple(f"line {i}" for i in range(30))
    data = encode.error("why", 1, _evidence(*lines, matches=8), "cls", None)
    assert data.lines == [f"{TRACEBACK}: match {i}" for i in range(3, 8)] + list(lines[10:])


def test_a_dying_report_names_the_exception_as_the_traceback_said_it() -> None:
    said_by_rank = "[rank1]: RuntimeError: " + "x" * 300
    evidence = _evidence("Traceback (most recent call last):", said_by_rank, matches=1)
    data = encode.dying(DyingReport(5, 0, "RuntimeError", evidence, 12))
    said = "RuntimeError: " + "x" * 186  # at most 200 characters
    assert data.reason == f"uncaught {said} (reported as the process exits)"
    assert (data.fault_class, data.exit_code, data.step) == (TRACEBACK, 1, 12)
    unseen = encode.dying(DyingReport(5, 0, "KeyError", _evidence("nothing said"), None))
    assert unseen.reason.startswith("uncaught KeyError (") and unseen.fault_class == ""


# The end of a real run's output: the DDP tutorial's mp.spawn, rank 1 raised.
MP_SPAWN = (
    '  File "/venv/lib/python3.11/site-packages/torch/multiprocessing/spawn.py", line 211, in join',
    "    raise ProcessRaisedException(msg, error_index, failed_process.pid)",
    "torch.multiprocessing.spawn.ProcessRaisedException: ",
    "",
    "-- Process 1 terminated with the following error:",
    "Traceback (most recent call last):",
    '  File "/venv/lib/python3.11/site-packages/torch/multiprocessing/spawn.py", line 87, in _wrap',
    "    fn(i, *args)",
    '  File "/tmp/mp/mp_train.py", line 27, in train',
    '    raise RuntimeError("injected crash in rank 1")',
    "RuntimeError: injected crash in rank 1",
    "",
    "[aegis] exiting on an uncaught ProcessRaisedException (pid 8001)",
)
# torchrun's own end when a worker failed: its report, not an exception, comes last.
TORCHRUN = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "train.py FAILED",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  error_file: <N/A>",
    "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    "============================================================",
    "[aegis] exiting on an uncaught ChildFailedError (pid 77)",
)


def test_a_dying_report_names_an_exception_of_another_module_and_a_wrapped_one() -> None:
    """As Python prints them: with their module (not builtins); one whose message begins on a
    later line gets the output's last exception line (mp.spawn: the failed rank's error)."""
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    plain = ("KeyError", "[aegis] exiting on an uncaught KeyError (pid 3)")
    cases = [
        (("Traceback (most recent call last):", oom), "OutOfMemoryError", oom),
        (MP_SPAWN, "ProcessRaisedException",
         "torch.multiprocessing.spawn.ProcessRaisedException: RuntimeError: injected crash in "
         "rank 1"),
        (TORCHRUN, "ChildFailedError",
         "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"),
        (plain, "KeyError", "KeyError"),
    ]  # fmt: skip
    for lines, name, said in cases:
        assert encode.exception_line(_evidence(*lines), name) == said


def test_a_hang_carries_every_process_stack() -> None:
    dumps = (StackDump(5, "python a", "frame a", None), StackDump(6, "python b", "", "no ptrace"))
    report = HangReport(0, 30.0, 31.5, 7, 1.0, 2.0, dumps, why="p99 x 3")
    data = encode.hang(report)
    assert (data.idle_s, data.timeout_s, data.why) == (31.5, 30.0, "p99 x 3")
    assert data.stacks == "--- pid 5 (python a) ---\nframe a\n--- pid 6 (python b) ---\nno ptrace"


def test_a_heartbeat_repeats_the_watchdogs_choice_only_when_it_changes_or_now_and_then() -> None:
    seen = Progress(step=9, step_ts=100.0, input_s=0.25, hang_timeout="30 s (fixed)")
    first = encode.heartbeat(seen, said="", beats=0, now=101.0)
    assert first == m.HeartbeatData(9, "30 s (fixed)", 100.0, 101.0, 0.25)
    assert encode.heartbeat(seen, "30 s (fixed)", 1, 102.0).hang_timeout == ""
    again = encode.heartbeat(seen, "30 s (fixed)", encode.WATCHDOG_EVERY_BEATS, 103.0)
    assert again.hang_timeout == "30 s (fixed)"
    no_step = encode.heartbeat(Progress(), "", 1, 104.0)
    assert no_step.step is None and no_step.sent_mono is None  # no step: no straggler timing


def test_a_heartbeat_tells_a_standing_hang_and_leaves_out_what_is_at_its_default() -> None:
    """``hung``: the watchdog's reported hang stands (the master withdraws the report when it
    no longer does). Fields at their default are left out, so a master of an earlier version
    (which refuses unknown fields) reads an ordinary beat and hang report."""
    hung = encode.heartbeat(Progress(hung=True), "", 1, 104.0)
    assert hung.hung and b'"hung":true' in msgspec.json.encode(hung)
    plain = msgspec.json.encode(encode.heartbeat(Progress(step=3), "", 1, 104.0))
    assert b"hung" not in plain and b"input_s" not in plain
    report = HangReport(
        0, 60.0, 61.0, None, 1.0, 2.0, (), why="no step signal", no_step_signal=True
    )
    assert encode.hang(report).no_step_signal
    stepped = msgspec.json.encode(encode.hang(HangReport(0, 30.0, 31.5, 7, 1.0, 2.0, ())))
    assert b"no_step_signal" not in stepped
