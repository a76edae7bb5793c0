"""The pure rules of a failing checkpoint store, the io check's probe of the checkpoint
directory, and how the master words and counts the pods' reports."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from aegis.checkpoint import outage
from aegis.checks import base, local
from aegis.cli import incidents_cmd
from aegis.core.phases import Phase
from aegis.master import faultlog
from aegis.tools import incidents as incidents_tool
from aegis.wire import codec, eventlog
from aegis.wire import messages as m


def test_failed_opens_an_outage_only_on_the_first_failure_in_a_row() -> None:
    first = outage.failed(outage.StoreState(), now=100.0)
    assert first.opened and first.state == outage.StoreState(1, 100.0)
    second = outage.failed(first.state, now=101.0)
    assert not second.opened and second.state == outage.StoreState(2, 100.0)


def test_succeeded_closes_an_outage_with_its_length_and_is_silent_when_none() -> None:
    down = outage.failed(outage.failed(outage.StoreState(), 10.0).state, 12.0).state
    back = outage.succeeded(down, now=25.5)
    assert back.closed_after_s == 15.5 and back.state == outage.StoreState()
    assert outage.succeeded(outage.StoreState(), now=30.0).closed_after_s is None
    again = outage.failed(back.state, now=40.0)
    assert again.opened  # a new outage after the store came back


def test_backoff_doubles_from_the_base_and_stops_at_the_cap() -> None:
    waits = [outage.backoff_s(n, base_s=0.25, cap_s=5.0) for n in range(0, 9)]
    assert waits == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert outage.backoff_s(10_000) == outage.BACKOFF_CAP_S
    assert outage.failed(outage.StoreState(3, 0.0), 1.0).retry_in_s == outage.backoff_s(4)


def test_save_may_proceed_when_store_down_waits_while_persisting_gives_up_after_timeout() -> None:
    assert outage.save_may_proceed(store_down=True, waited_s=0.0, timeout_s=600.0) is True
    assert outage.save_may_proceed(store_down=True, waited_s=900.0, timeout_s=600.0) is True
    assert outage.save_may_proceed(store_down=False, waited_s=1.0, timeout_s=600.0) is None
    assert outage.save_may_proceed(store_down=False, waited_s=601.0, timeout_s=600.0) is False


def test_failure_of_names_errno_strerror_and_directory() -> None:
    failure = outage.Failure.of(OSError(errno.ENOSPC, "No space left on device"), 30, "/ck/p0")
    assert failure == outage.Failure(30, errno.ENOSPC, "No space left on device", "/ck/p0")
    assert failure.describe() == "[Errno 28] No space left on device: /ck/p0"


def _failed(step: int, opened: bool, code: int = errno.ENOSPC) -> dict[str, object]:
    return {"event": "failed", "step": step, "errno": code, "strerror": "x", "dir": "/d",
            "opened": opened, "failures": 1, "since": 1.0, "ts": 2.0}  # fmt: skip


def test_reports_of_batches_consecutive_failures_and_keeps_a_recovery_apart() -> None:
    records = [
        _failed(30, True),
        _failed(30, False),
        _failed(40, False, errno.EROFS),
        {"event": "resumed", "step": 50, "dir": "/d", "down_s": 4.5, "failures": 3, "ts": 3.0},
        _failed(60, True),
    ]
    reports = outage.reports_of(records)
    assert reports == [
        outage.StoreReport("/d", 40, False, errno.EROFS, "x", failures=3, opened=True),
        outage.StoreReport("/d", 50, ok=True, failures=3, down_s=4.5),
        outage.StoreReport("/d", 60, False, errno.ENOSPC, "x", failures=1, opened=True),
    ]


def test_reports_of_skips_records_that_are_not_the_daemons() -> None:
    records: list[dict[str, object]] = [{"event": "other", "step": 1, "dir": "/d"}, {"step": 2},
                                        {"event": "failed", "step": "x", "dir": "/d"}]  # fmt: skip
    assert outage.reports_of(records) == []  # type: ignore[arg-type]


def test_store_report_travels_on_the_wire_and_old_kinds_still_decode() -> None:
    data = m.CheckpointStoreData("/ck/p0", 30, errno=28, strerror="No space left on device",
                                 failures=2, opened=True)  # fmt: skip
    msg = m.Message(job="j", namespace="ns", pod="p0", type=m.MessageType.CHECKPOINT,
                    phase=m.Phase.RUN_COMMAND, seq=3, ts=1.0, data=data)  # fmt: skip
    assert codec.decode(codec.encode(msg)) == msg
    old = m.Message(job="j", namespace="ns", pod="p0", type=m.MessageType.CHECKPOINT,
                    phase=m.Phase.RUN_COMMAND, seq=3, ts=1.0, data=m.CheckpointData(7))  # fmt: skip
    assert codec.decode(codec.encode(old)) == old
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"kind":"checkpoint_store","directory":"/d","step":1,"x":1}',
                            type=m.CheckpointStoreData)  # fmt: skip


def test_fault_log_words_an_outage_once_and_the_recovery() -> None:
    def text(data: m.CheckpointStoreData) -> str | None:
        msg = m.Message(job="j", namespace="ns", pod="p0", type=m.MessageType.CHECKPOINT,
                        phase=m.Phase.RUN_COMMAND, seq=3, ts=1.0, data=data)  # fmt: skip
        return faultlog.report_text(msg)

    opened = m.CheckpointStoreData("/ck/p0", 30, errno=28, strerror="No space left on device",
                                   failures=1, opened=True)  # fmt: skip
    assert text(opened) == ("checkpoint store down: [Errno 28] No space left on device: /ck/p0; "
                            "step 30 kept in memory, training goes on")  # fmt: skip
    assert text(m.CheckpointStoreData("/ck/p0", 31, errno=28, failures=4)) is None
    back = m.CheckpointStoreData("/ck/p0", 50, ok=True, down_s=4.25)
    assert text(back) == "checkpoint store back: /ck/p0 after 4.2 s; step 50 committed"


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "full"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                          check=False, capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    try:
        (where / "pod-0").mkdir()
        with (where / "filler").open("wb") as out, pytest.raises(OSError):
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


async def test_io_check_fails_naming_the_checkpoint_directory_when_it_is_full(
    full_fs: Path, tmp_path: Path
) -> None:
    ckpt = full_fs / "pod-0"
    settings = base.CheckSettings(scratch_dir=tmp_path / "scratch", io_size_mb=1, ckpt_dir=ckpt)
    outcome = await local.io_check(settings)
    assert not outcome.passed
    assert outcome.result == f"checkpoint directory {ckpt}: no space left ([Errno 28] ENOSPC)"
    (full_fs / "filler").unlink()
    outcome = await local.io_check(settings)
    assert outcome.passed, outcome.result
    assert not list(ckpt.iterdir())  # the probe is removed


async def test_io_check_fails_naming_the_checkpoint_directory_when_it_is_read_only(
    full_fs: Path, tmp_path: Path
) -> None:
    (full_fs / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(full_fs)], check=True)
    ckpt = full_fs / "pod-0"
    settings = base.CheckSettings(scratch_dir=tmp_path / "scratch", io_size_mb=1, ckpt_dir=ckpt)
    outcome = await local.io_check(settings)
    assert not outcome.passed
    expected = f"checkpoint directory {ckpt}: read-only file system ([Errno 30] EROFS)"
    assert outcome.result == expected


def _store_line(pod: str, ts: float, data: m.CheckpointStoreData) -> str:
    msg = m.Message(job="j", namespace="default", pod=pod, type=m.MessageType.CHECKPOINT,
                    phase=Phase.RUN_COMMAND, seq=3, ts=ts, data=data)  # fmt: skip
    return eventlog.encode(msg).decode()


def test_aegis_incidents_lists_each_store_outage_from_the_event_log() -> None:
    """The master records every store report in events.jsonl; ``aegis incidents`` shows an
    outage per pod: when it went down, why, where, and when it came back (or still down)."""
    full = m.CheckpointStoreData("/ckpt/j-0", 30, errno=28, strerror="No space left on device",
                                 failures=1, opened=True)  # fmt: skip
    lines = [
        "not json at all",
        _store_line("j-0", 100.0, full),
        _store_line(
            "j-0", 101.0, m.CheckpointStoreData("/ckpt/j-0", 30, errno=28, strerror="x", failures=3)
        ),
        _store_line(
            "j-1",
            102.0,
            m.CheckpointStoreData(
                "/ckpt/j-1", 35, errno=30, strerror="Read-only file system", failures=1, opened=True
            ),
        ),
        _store_line("j-0", 110.0, m.CheckpointStoreData("/ckpt/j-0", 60, ok=True, down_s=10.0)),
    ]
    first, second = incidents_tool.store_outages(lines)
    assert (first.pod, first.errno, first.directory, first.step) == ("j-0", 28, "/ckpt/j-0", 30)
    assert (first.failures, first.ended_ts, first.down_s) == (4, 110.0, 10.0)
    assert (second.pod, second.errno, second.ended_ts) == ("j-1", 30, None)
    text = incidents_cmd.describe_outage(first)
    assert "[Errno 28] No space left on device: /ckpt/j-0" in text and "back after 10.0 s" in text
    assert "still down" in incidents_cmd.describe_outage(second)


def test_a_report_is_the_wire_message_and_carries_at_most_200_characters_of_the_error() -> None:
    record = {**_failed(30, True), "strerror": "y" * 300}
    [report] = outage.reports_of([record])
    assert isinstance(report, m.CheckpointStoreData) and report.strerror == "y" * 200
