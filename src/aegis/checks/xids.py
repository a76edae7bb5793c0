"""Xid events heard all the time (the health watch's), and which Xids are the program's.

NVML tells a critical Xid event only to the event sets registered for its GPU when it happens: a
look that listens 100 ms every 30 s hears almost none. :class:`XidListener` keeps one event set
registered in a daemon thread of its own, ``wait_ms`` at a time, and remembers each GPU's codes
for the agent's lifetime (a GPU that had a hardware Xid wants a reset and a look, whatever it
does next). It starts at the health watch's first look (``RealNvml(listener=...)``, in the
look's thread: an NVML call may hang); one that stops on an error starts again at a look at least
``retry_s`` after it last started. A GPU that takes no event registration (some boards and vGPUs)
is left out; the others are heard.

Some Xids are the program's doing, not the GPU's (:data:`APPLICATION_XIDS`, from NVIDIA's Xid
catalog): a training script's illegal address or a process killed mid-kernel. They are heard
and kept, but they are no warning sign: a node is never drained for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

# 13: graphics engine exception, 31: GPU memory page fault, 43: GPU stopped processing,
# 45: preemptive cleanup (a channel of a killed or failed process), 68: video processor
# exception, 109: context switch timeout: NVIDIA lists the user's application among their
# causes, and its device plugin does not mark a GPU unhealthy for them.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def hardware(codes: Iterable[int]) -> list[int]:
    """The codes that are warning signs of the GPU itself (not the program's), in order."""
    return [code for code in codes if code not in APPLICATION_XIDS]


class XidListener:
    """Every GPU's critical Xid codes since the first look (see the module)."""

    def __init__(self, wait_ms: int = 1000, retry_s: float = 60.0) -> None:
        self.wait_ms = wait_ms  # how long one wait for an event blocks (and a stop waits)
        self.retry_s = retry_s  # a listener that stopped starts again this long after it started
        self._lock = threading.Lock()
        self._heard: dict[int, set[int]] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self._failed_before = False

    def heard(self, nvml: Any) -> dict[int, list[int]]:
        """Each GPU's codes heard so far (GPU index -> codes, sorted; -1: a GPU NVML did not
        name). Starts listening through ``nvml`` (the ``pynvml`` module) when not listening."""
        with self._lock:
            if self._may_start():
                self._started_at = time.monotonic()
                self._thread = threading.Thread(
                    target=self._listen, args=(nvml,), name="gpu-xids", daemon=True
                )
                self._thread.start()
            return {index: sorted(codes) for index, codes in self._heard.items()}

    def _may_start(self) -> bool:
        if self._stopped.is_set() or (self._thread is not None and self._thread.is_alive()):
            return False
        return self._started_at is None or time.monotonic() - self._started_at >= self.retry_s

    def stop(self, wait_s: float = 0.0) -> None:
        """Listen no more: the thread frees its event set within ``wait_ms``; waits for that
        up to ``wait_s``."""
        with self._lock:
            self._stopped.set()
            thread = self._thread
        if thread is not None and wait_s > 0:
            thread.join(wait_s)

    def listening(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _listen(self, nvml: Any) -> None:
        try:
            nvml.nvmlInit()
        except Exception as exc:  # no driver: the look says so
            log.debug("Xid events: no NVML: %r", exc)
            return
        event_set = None
        try:
            event_set = nvml.nvmlEventSetCreate()
            if not _register(nvml, event_set):
                raise RuntimeError("no GPU takes Xid events")
            while not self._stopped.is_set():
                self._wait_once(nvml, event_set)
        except Exception as exc:
            level = logging.DEBUG if self._failed_before else logging.WARNING
            log.log(level, "Xid events: listening stopped (%r); again at a later look", exc)
            self._failed_before = True
        finally:
            if event_set is not None:
                _quietly(nvml.nvmlEventSetFree, event_set)
            _quietly(nvml.nvmlShutdown)

    def _wait_once(self, nvml: Any, event_set: Any) -> None:
        try:
            data = nvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
        except Exception as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_TIMEOUT", object()):
                return  # nothing happened meanwhile
            raise
        try:  # NVML hands back a new handle object: ask NVML which GPU it is
            index = int(nvml.nvmlDeviceGetIndex(data.device))
        except Exception:
            index = -1
        with self._lock:
            self._heard.setdefault(index, set()).add(int(data.eventData))
        log.warning("Xid %d on GPU %d", int(data.eventData), index)


def _register(nvml: Any, event_set: Any) -> int:
    """Every GPU that takes Xid events registered in ``event_set``; how many did."""
    registered = 0
    for index in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            registered += 1
        except Exception as exc:  # NOT_SUPPORTED on some boards: the others are heard
            log.info("Xid events: GPU %d not heard: %r", index, exc)
    return registered


def _quietly(call: Any, *args: Any) -> None:
    """A last call to a driver that may be going: what fails is logged, nothing more."""
    try:
        call(*args)
    except Exception as exc:
        log.debug("Xid events: %r failed: %r", call, exc)
