"""The user's traceback in an incident is the user's: a training process forked warm from a
zygote prints the traceback a cold ``python train.py`` prints, with no frame of Aegis's
launcher (``agent/zygote.py``: ``<module>``, ``run_script``) in front of the user's code."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aegis.agent import ports, reaper, supervisor, warm

pytestmark = pytest.mark.timing

TRAIN = """
def step(n):
    raise RuntimeError(f"bad batch at step {n}")


def main():
    step(3)


main()
"""


@pytest.fixture
async def the_reaper() -> AsyncIterator[reaper.Reaper]:
    async with reaper.Reaper() as r:
        yield r


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_WRONLY)
    yield fd
    os.close(fd)


async def cold_and_warm_reports(
    argv: list[str], the_reaper: reaper.Reaper, devnull: int, caplog: pytest.LogCaptureFixture
) -> list[ports.ExitReport]:
    """The command cold (no zygote), then warm twice (first start and a restart, forked)."""
    caplog.set_level(logging.INFO, logger=supervisor.__name__)
    reports: list[ports.ExitReport] = []
    for prewarm in (None, warm.PrewarmSettings(modules=("json",), prepare_after_s=0.0,
                                               settle_s=0.0)):  # fmt: skip
        settings = supervisor.SupervisorSettings(
            grace_s=5.0, hang_timeout_s=0.0, stdout_fd=devnull, stderr_fd=devnull,
            prewarm=prewarm,
        )  # fmt: skip
        sup = supervisor.Supervisor(argv, settings, the_reaper, ports.RecordingReports())
        async with sup:
            await sup.start()
            reports.append(await sup.wait())
            if prewarm is not None:
                assert sup.zygotes is not None
                await sup.restart()
                reports.append(await sup.wait())
    starts = [r.args for r in caplog.records if r.msg == "started %s as pid %s (restart %s, %s)"]
    assert [(s[2], s[3]) for s in starts] == [(0, "cold"), (0, "warm"), (1, "warm")]  # type: ignore[index]
    return reports


HEAD = "Traceback (most recent call last):"


def traceback_of(report: ports.ExitReport) -> list[str]:
    """The report's last lines from the traceback's head on (all of them without one), pids
    left out."""
    assert report.evidence is not None
    lines = list(report.evidence.last_lines)
    lines = lines[lines.index(HEAD) :] if HEAD in lines else lines
    return [re.sub(r"\(pid \d+\)", "(pid N)", line) for line in lines]


async def test_warm_child_traceback_starts_at_the_users_code_like_a_cold_one(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cold, *warms = await cold_and_warm_reports(
        [sys.executable, str(script)], the_reaper, devnull, caplog
    )
    assert [r.exit_status for r in (cold, *warms)] == [1, 1, 1]
    expected = traceback_of(cold)
    assert expected[:2] == [
        HEAD,
        f'  File "{script}", line 10, in <module>',
    ]
    assert "RuntimeError: bad batch at step 3" in expected
    for report in warms:
        assert traceback_of(report) == expected


async def test_warm_child_syntax_error_shows_no_launcher_frame_like_a_cold_one(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "train.py"
    script.write_text("def main(:\n    pass\n")
    cold, *warms = await cold_and_warm_reports(
        [sys.executable, str(script)], the_reaper, devnull, caplog
    )
    assert [r.exit_status for r in (cold, *warms)] == [1, 1, 1]
    expected = traceback_of(cold)
    assert f'  File "{script}", line 1' in expected and HEAD not in expected
    assert expected[-1] == "[aegis] exiting on an uncaught SyntaxError (pid N)"
    for report in warms:
        assert traceback_of(report) == expected
