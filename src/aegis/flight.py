"""torch's flight recorder, dumped on the agent's request from inside a training process.

Where the job turned torch's flight recorder on (``TORCH_FR_BUFFER_SIZE`` or, for NCCL,
``TORCH_NCCL_TRACE_BUFFER_SIZE`` above 0), every collective a process group runs is recorded in
the process. On a hang the agent wants each rank's record: which collective it enqueued last and
which one completed (the rank that is not where the others are is the culprit). A rank that
hangs is blocked in C++ or asleep, so its main thread cannot answer; :func:`install` starts a
daemon thread that looks every :data:`POLL_S` for the agent's request (the file named by
``AEGIS_FR_REQUEST``, touched anew for each request) and answers it with
``torch._C._distributed_c10d._dump_fr_trace_json()`` written to ``<request>.<pid>.json``
(atomically). Nothing happens where the recorder is off, outside an agent, or before the
process has imported ``torch.distributed``. Keep this module free of heavy imports: it loads in
every process of the job (:mod:`aegis.autoprogress`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping

REQUEST_VAR = "AEGIS_FR_REQUEST"
SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
POLL_S = 0.5
C10D = "torch._C._distributed_c10d"
_started_in: list[int] = []  # the pid the thread was started in (a forked child starts its own)


def recording(env: Mapping[str, str]) -> bool:
    """Whether torch's flight recorder is on in this environment (as torch reads it: the first
    of the two variables that is set)."""
    for name in SIZE_VARS:
        text = env.get(name, "").strip()
        if text:
            return text.isdigit() and int(text) > 0
    return False


def dump_path(request: str, pid: int) -> str:
    return f"{request}.{pid}.json"


def install() -> bool:
    """Start the answering thread in this process (once per process); True when started."""
    request = os.environ.get(REQUEST_VAR, "")
    if not request or not recording(os.environ) or os.getpid() in _started_in:
        return False
    _started_in[:] = [os.getpid()]
    threading.Thread(target=_answer, args=(request,), name="aegis-flight", daemon=True).start()
    return True


def _answer(request: str) -> None:
    answered: int | None = None
    while True:
        time.sleep(POLL_S)
        try:
            asked = os.stat(request).st_mtime_ns
        except OSError:
            continue
        if asked == answered:
            continue
        c10d = sys.modules.get(C10D)
        dump = getattr(c10d, "_dump_fr_trace_json", None)
        if dump is None:
            continue  # no torch.distributed in this process (yet): nothing recorded
        answered = asked
        try:
            raw = dump()
            path = dump_path(request, os.getpid())
            with open(f"{path}.tmp", "wb") as out:
                out.write(raw if isinstance(raw, bytes) else str(raw).encode())
            os.replace(f"{path}.tmp", path)
        except Exception:
            continue  # never break a process of the job
