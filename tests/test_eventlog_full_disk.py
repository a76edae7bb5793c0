"""The master's event log on a disk that cannot take it: a line not written is lost and
counted, never fatal, and never left torn. Before, the first write that failed (a full log
disk) raised out of the job's loop and ended the job, whose training was fine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aegis.adapters import memory
from aegis.core import events as ev
from aegis.core.phases import Phase
from tests.runner_harness import Harness, RecordingPlatform, make_runner, to_running

pytestmark = pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")


WRITER = """
import logging, resource, signal, sys
from pathlib import Path
from aegis.master.eventlog_writer import EventLogWriter
from aegis.wire import eventlog

logging.basicConfig(level=logging.INFO, format="%(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, not a signal
path = Path(sys.argv[1])
writer = EventLogWriter(path)
line = lambda reason: eventlog.QuitRequestedRecord(ts=1.0, reason=reason)
writer.write(line("first"))
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 20, hard))  # the disk fills
writer.write(line("lost"))  # 20 bytes of it fit, then EFBIG
writer.write(line("lost too"))
print(writer.lost, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space again
writer.write(line("back"))
writer.close()
"""


def test_a_line_the_disk_cannot_take_is_counted_and_the_file_keeps_whole_lines(
    tmp_path: Path,
) -> None:
    """A real short write: the file size limit (RLIMIT_FSIZE) lets 20 bytes of a line in, then
    refuses the rest, as a disk that fills up mid-line."""
    path = tmp_path / "events.jsonl"
    done = subprocess.run([sys.executable, "-c", WRITER, str(path)], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    assert done.stdout.split() == ["2"], done  # two lines lost
    reasons = [json.loads(line)["reason"] for line in path.read_text().splitlines()]
    assert reasons == ["first", "back"]  # cut back each time: no torn line
    assert done.stderr.count("could not be written") == 1, done.stderr  # once per outage
    assert "written again (2 lines lost so far)" in done.stderr, done.stderr


async def test_a_job_goes_on_when_its_event_log_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    bus, store, platform = memory.MemoryBus(), memory.MemoryStore(), RecordingPlatform()
    runner = make_runner(tmp_path, bus, store, platform, heartbeat_timeout_s=30.0)
    h = Harness(runner, bus, store, platform)
    await bus.subscribe(runner.master_subject, h.on_order)
    await runner.start(["node-0", "node-1"])
    h.task = h.runner.task = asyncio.create_task(runner.run())
    try:
        await to_running(h)  # every event of the way was fed to the core, none logged
        assert runner.status.phase is Phase.RUN_COMMAND
        assert runner.events.lost >= 4 and not h.task.done()
        runner.platform_event(ev.QuitRequested("the operator says stop"))
        await asyncio.wait_for(runner.wait_done(), 10)
        assert runner.status.phase.value == "Failed"
    finally:
        runner.close()
        await asyncio.wait_for(h.task, 10)
