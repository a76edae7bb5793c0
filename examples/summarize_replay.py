"""One line per event from ``aegis replay --json``: phase, recover count, retries, decision."""

from __future__ import annotations

import json
import sys

for line in sys.stdin:
    record = json.loads(line)
    status = record["status"]
    retries = ",".join(str(pod["retries"]) for pod in status["pod_infos"].values())
    print(
        f"line {record['line']:>3}: {status['phase']:<15} rc={status['recover_count']} "
        f"retries=({retries})  {record['event'][:58]:<58} -> {record['actions'][:80]}"
    )
