"""The JSON-lines files the tests read (the probes' records of each incarnation, the event
log): one reader for all of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Each complete line of ``path`` as JSON; none while ``path`` does not exist. A line being
    written (no closing brace yet) is left out: runs are read while they write."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]
