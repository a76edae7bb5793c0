"""Appends every event the master feeds the core to ``events.jsonl`` (flushed per line)."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from aegis.wire import eventlog
from aegis.wire import messages as m


class EventLogWriter:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: BinaryIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")

    def write(self, record: eventlog.PlatformRecord | m.Message) -> None:
        if self._file is not None:
            self._file.write(eventlog.encode(record))
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
