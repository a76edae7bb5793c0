"""What the agent reports when its command ends: the pure rule the link sends."""

from __future__ import annotations

from aegis.agent import exit_rule
from aegis.agent.ports import Evidence, ExitReason, ExitReport, FaultClass


def _exit(status: int, *, signal: int | None = None, cls: str | None = None,
          reason: ExitReason = ExitReason.EXITED) -> ExitReport:  # fmt: skip
    return ExitReport(7, 0, status, signal, reason, Evidence(cls, (), ()))


def test_a_clean_exit_finishes_and_an_ordered_stop_says_nothing() -> None:
    assert exit_rule.on_exit(_exit(0), dying_reported=False) == exit_rule.Finished()
    assert exit_rule.on_exit(_exit(0), dying_reported=True) == exit_rule.Finished()
    for reason in (ExitReason.STOPPED, ExitReason.RESTARTED):
        assert exit_rule.on_exit(_exit(143, signal=15, reason=reason), False) is None


def test_an_exit_reported_as_it_began_is_not_reported_twice() -> None:
    assert exit_rule.on_exit(_exit(1, cls=FaultClass.PYTHON_TRACEBACK), True) is None


def test_the_fault_class_is_the_outputs_unless_the_output_did_not_end_it() -> None:
    traceback = FaultClass.PYTHON_TRACEBACK
    assert exit_rule.on_exit(_exit(1, cls=traceback), False) == exit_rule.Failed(
        "exit status 1", traceback
    )
    killed = exit_rule.on_exit(_exit(137, signal=9, cls=traceback), False)
    assert killed == exit_rule.Failed("exit status 137", FaultClass.KILLED)  # the OOM killer
    own = exit_rule.on_exit(_exit(13, cls=traceback), False)
    assert own == exit_rule.Failed("exit status 13", "")  # its own status, not the traceback
    cuda = exit_rule.on_exit(_exit(134, signal=6, cls="cuda"), False)
    assert cuda == exit_rule.Failed("exit status 134", "cuda")
    assert exit_rule.on_exit(_exit(127, reason=ExitReason.SPAWN_FAILED), False) == (
        exit_rule.Failed("exit status 127", "")
    )


def test_a_command_that_could_not_start_says_why_in_the_reason() -> None:
    """It was "exit status 127" alone: where no pre-flight runs (a Slurm step, a Kubernetes pod),
    a mistyped command spent the fault budget on faults that did not say what was wrong."""
    said = "bash: line 1: nonexistent-cmd: command not found"
    report = ExitReport(7, 0, 127, None, ExitReason.EXITED, Evidence(None, (), ("", said, "")))
    assert exit_rule.on_exit(report, False) == exit_rule.Failed(f"exit status 127: {said}", "")
    other = ExitReport(7, 0, 2, None, ExitReason.EXITED, Evidence(None, (), ("usage: x",)))
    assert exit_rule.on_exit(other, False) == exit_rule.Failed("exit status 2", "")
