"""Naming the pod a hang is about from the stacks its pods sent (``core.suspects``), on dumps
in py-spy's own format (taken from real gloo jobs: a rank asleep at a step while the others
wait for it in ``all_reduce``; DDP's backward; a torchrun launcher beside its worker)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from aegis.core.suspects import Suspect, frame_of, name_suspect, state_line, view

WAITING = """--- pid 101 (python train.py) ---
Process 101: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 101 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    main (train.py:56)
    <module> (train.py:68)
Thread 130 (idle): "Thread-1 (_pin_memory_loop)"
    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:59)
"""

ASLEEP = """--- pid 202 (python train.py) ---
Process 202: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 202 (idle): "MainThread"
    stuck_forever (train.py:25)
    main (train.py:54)
    <module> (train.py:68)
"""

BACKWARD = """--- pid 303 (python ddp.py) ---
Thread 303 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:829)
    backward (torch/autograd/__init__.py:353)
    backward (torch/_tensor.py:647)
    main (ddp.py:104)
"""

LAUNCHER = """--- pid 400 (/usr/bin/python /usr/bin/torchrun --nproc-per-node 2 train.py) ---
Thread 400 (idle): "MainThread"
    _invoke_run (torch/distributed/elastic/agent/server/api.py:900)
    run (torch/distributed/elastic/agent/server/api.py:700)
"""

NO_PYSPY = "--- pid 500 (python train.py) ---\npy-spy not found"


def test_one_pod_elsewhere_while_the_others_wait_in_all_reduce_is_named() -> None:
    reports = {"j-0": WAITING, "j-1": ASLEEP, "j-2": WAITING, "j-3": WAITING}
    found = name_suspect(reports, ["j-0", "j-1", "j-2", "j-3"])
    assert found == Suspect(
        "j-1",
        "in stuck_forever (train.py) while 3 other pods wait in all_reduce (distributed_c10d.py)",
    )


def test_the_first_reporter_is_not_blamed_for_anothers_hang() -> None:
    """The probe of issue 18: the watchdog that fired first was a healthy pod's."""
    reports = {"h-2": WAITING, "h-0": WAITING, "h-1": ASLEEP}  # h-2 reported first
    assert name_suspect(reports, ["h-0", "h-1", "h-2", "h-3"]) == Suspect(
        "h-1", "in stuck_forever (train.py) while 2 other pods wait in all_reduce "
        "(distributed_c10d.py)"
    )  # fmt: skip


def test_ddp_backward_counts_as_waiting_for_the_gradients_all_reduce() -> None:
    assert view(BACKWARD).waiting
    reports = {"d-0": BACKWARD, "d-1": ASLEEP}
    assert name_suspect(reports, ["d-0", "d-1"]) == Suspect(
        "d-1", "in stuck_forever (train.py) while 1 other pod waits in _engine_run_backward "
        "(graph.py)"
    )  # fmt: skip


def test_the_one_pod_that_reported_no_hang_while_all_others_wait_is_named() -> None:
    """A rank busy in a loop keeps its CPU and so its watchdog quiet; the others wait for it."""
    reports = {"j-0": WAITING, "j-2": WAITING}
    found = name_suspect(reports, ["j-0", "j-1", "j-2"])
    assert found is not None and found.pod == "j-1"
    assert found.why.startswith("reported no hang while 2 other pods wait in all_reduce")


def test_a_torchrun_launcher_is_no_evidence() -> None:
    reports = {"t-0": LAUNCHER + WAITING, "t-1": LAUNCHER + ASLEEP}
    assert view(LAUNCHER).known is False
    found = name_suspect(reports, ["t-0", "t-1"])
    assert found is not None and found.pod == "t-1"


def test_the_odd_stack_out_of_three_is_named_when_none_waits() -> None:
    other = ASLEEP.replace("stuck_forever (train.py:25)", "load_batch (data.py:12)")
    reports = {"a-0": ASLEEP, "a-1": other, "a-2": ASLEEP}
    found = name_suspect(reports, ["a-0", "a-1", "a-2"])
    assert found is not None and found.pod == "a-1"
    assert "load_batch (data.py)" in found.why


STOPPED = (  # py-spy cannot read a stopped process: what the agent sent from a real one
    "--- pid 600 (python train.py) ---\nprocess state: T, stopped (a stop signal or a freezer)\n"
    "py-spy exited 1: Error: Failed to find python version from target process"
)


def test_the_one_pod_whose_process_is_stopped_is_named_though_its_stack_is_unread() -> None:
    reports = {"j-0": BACKWARD, "j-1": STOPPED, "j-2": BACKWARD}
    found = name_suspect(reports, ["j-0", "j-1", "j-2"])
    assert found == Suspect(
        "j-1",
        "process 600 is stopped (a stop signal or a freezer) while 2 other pods wait in "
        "_engine_run_backward (graph.py)",
    )  # before: no suspect (two wait, the third is unknown)
    held = "--- pid 700 (python train.py) ---\nprocess state: D, in uninterruptible sleep\n"
    found = name_suspect({"j-0": held + ASLEEP.split("\n", 1)[1], "j-1": WAITING}, ["j-0", "j-1"])
    assert found is not None and found.pod == "j-0"
    assert found.why.startswith("process 700 is in uninterruptible sleep (held in the kernel")


def test_a_held_process_names_nobody_when_two_pods_have_one_or_alone() -> None:
    assert name_suspect({"j-0": STOPPED, "j-1": STOPPED, "j-2": WAITING}, ["j-0", "j-1"]) is None
    assert name_suspect({"j-0": STOPPED}, ["j-0", "j-1"]) is None
    launcher = LAUNCHER.replace("---\n", "---\nprocess state: T, stopped\n", 1)
    assert not view(launcher).held  # a stopped torchrun is not its workers' stall


def test_the_flight_recorder_outranks_a_held_process() -> None:
    # a pod whose DataLoader worker sits in D on a slow disk is not the one the flight
    # recorder says is behind
    def flown(text: str, enqueued: int) -> str:
        return f"{text}\nflight recorder: collective #{enqueued} enqueued, #{enqueued} completed"

    reports = {"j-0": flown(BACKWARD, 7), "j-1": flown(STOPPED, 9), "j-2": flown(BACKWARD, 9)}
    found = name_suspect(reports, ["j-0", "j-1", "j-2"])
    assert found is not None and found.pod == "j-0" and "(flight recorder)" in found.why


def test_a_flight_count_no_int64_holds_is_not_read() -> None:
    """A peer's 5,000-digit count made ``int`` raise (and the master lost the round's hang
    reports): such a line is not a flight record; the others still name the pod behind."""
    absurd = f"{BACKWARD}\nflight recorder: collective #{'9' * 5000} enqueued, #0 completed"
    flown = "\nflight recorder: collective #{0} enqueued, #{0} completed"
    reports = {"j-0": absurd, "j-1": BACKWARD + flown.format(7), "j-2": BACKWARD + flown.format(9)}
    found = name_suspect(reports, ["j-0", "j-1", "j-2"])
    assert found is not None and found.pod == "j-1" and "(flight recorder)" in found.why


def test_the_state_line_says_stopped_at_once_and_uninterruptible_only_when_it_lasts() -> None:
    assert state_line("T", "T") == "process state: T, stopped (a stop signal or a freezer)"
    assert state_line("t", "") == "process state: t, stopped by a debugger"
    assert state_line("D", "D").startswith("process state: D, in uninterruptible sleep")
    assert [state_line(*pair) for pair in (("D", "S"), ("S", "D"), ("R", "R"), ("", ""))] == [
        "",
        "",
        "",
        "",
    ]


def test_nobody_is_named_when_the_stacks_do_not_single_one_out() -> None:
    pods = ["n-0", "n-1", "n-2", "n-3"]
    assert name_suspect({"n-0": WAITING, "n-1": WAITING}, pods) is None  # two silent pods
    assert name_suspect({p: WAITING for p in pods}, pods) is None  # everyone waits
    assert name_suspect({"n-0": ASLEEP, "n-1": ASLEEP}, pods[:2]) is None  # two alike
    assert name_suspect({"n-0": NO_PYSPY, "n-1": NO_PYSPY}, pods[:2]) is None  # no stacks
    two_elsewhere = {"n-0": WAITING, "n-1": ASLEEP, "n-2": ASLEEP}
    assert name_suspect(two_elsewhere, pods[:3]) is None
    assert name_suspect({}, pods) is None


# The expression the frame reader replaced, kept here as the reference for what a frame line is.
_OLD_FRAME = re.compile(r"^\s+(\S.*?) \((.+?)(?::\d+)?\)\s*$")


@given(st.text(alphabet=" \t()::.1a/_<>", max_size=40))
def test_a_frame_line_is_read_as_the_old_expression_read_it(line: str) -> None:
    old = _OLD_FRAME.match(line)
    assert frame_of(line) == (None if old is None else (old.group(1), old.group(2)))


def test_a_peers_long_line_is_read_in_one_pass() -> None:
    """A pod's hang report is a peer's text: a line the old expression backtracked over with
    time growing as its length squared (0.9 s at 12,000 characters, so about 40 minutes at
    these 600,000) is passed over, and the frames after it count. Run with the old expression,
    this test ends by the suite's timeout."""
    hostile = "  " + " (b" * 200_000
    stacks = WAITING.replace('"MainThread"\n', f'"MainThread"\n{hostile}\n', 1)
    assert view(stacks).waiting
    named = name_suspect({"p-0": stacks, "p-1": ASLEEP}, ["p-0", "p-1"])
    assert named is not None and named.pod == "p-1"
