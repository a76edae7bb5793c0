"""A second implementation of the part of ``pynvml`` (nvidia-ml-py) that ``RealNvml`` calls,
answering from a recorded snapshot: every reading the GPU did not report (``null``: e.g. remapped
rows on Volta, retired pages on Ampere) raises NVML's "Not Supported", as the real library does.
Arguments are checked against the constants the real calls need, so a wrong sensor, counter or
error type is an error here as it would be a wrong number there.

Xid events, as NVML's: an event reaches only the event sets registered for its GPU when it
happens (``xid(index, code)``: one happening now), and ``nvmlEventSetWait_v2`` blocks up to its
timeout for one. The event sets are the process's (as the driver's are), shared by every module
made here: the end-to-end stand-in makes a new module at each ``nvmlInit``."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import types
from dataclasses import dataclass
from typing import Any

NOT_SUPPORTED = "Not Supported"
TIMEOUT = "Timeout"


class NVMLError(Exception):
    """``value``: what went wrong, as pynvml's ``NVMLError.value`` (a code there, a word here)."""

    def __init__(self, value: str) -> None:
        super().__init__(value)
        self.value = value


class _Handle:
    """Like pynvml's handles (ctypes pointers): equal only to itself, so code that looks a
    handle up by equality finds nothing, as it would on a real GPU."""

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True)
class _EventData:
    device: _Handle
    eventData: int  # pynvml's name


@dataclass
class _EventSet:
    gpus: set[int] = dataclasses.field(default_factory=set)
    events: list[_EventData] = dataclasses.field(default_factory=list)


_SETS: dict[str, _EventSet] = {}  # the process's event sets, by handle
_CHANGED = threading.Condition()  # an event delivered, a set made or freed
_IDS = itertools.count(1)


def xid(index: int, code: int) -> int:
    """Xid ``code`` happens on GPU ``index`` now; how many event sets heard it."""
    with _CHANGED:
        heard = [s for s in _SETS.values() if index in s.gpus]
        for event_set in heard:  # each event carries a new handle object, as NVML's do
            event_set.events.append(_EventData(_Handle(index), code))
        _CHANGED.notify_all()
    return len(heard)


def _event_set_create() -> str:
    with _CHANGED:
        handle = f"event-set-{next(_IDS)}"
        _SETS[handle] = _EventSet()
    return handle


def _registered(event_set: str) -> _EventSet:
    if event_set not in _SETS:
        raise NVMLError("Invalid Argument (no such event set)")
    return _SETS[event_set]


def _wait(event_set: str, timeout_ms: int) -> _EventData:
    with _CHANGED:
        if not _CHANGED.wait_for(lambda: _registered(event_set).events, timeout_ms / 1000):
            raise NVMLError(TIMEOUT)
        return _registered(event_set).events.pop(0)


def _free(event_set: str) -> None:
    with _CHANGED:
        _registered(event_set)
        del _SETS[event_set]
        _CHANGED.notify_all()


def listening_to(index: int) -> int:
    """How many event sets are registered for GPU ``index`` now."""
    with _CHANGED:
        return sum(index in s.gpus for s in _SETS.values())


def open_event_sets() -> int:
    """Event sets made and not yet freed (a listener that stopped frees its own)."""
    with _CHANGED:
        return len(_SETS)


def module(snapshot: dict[str, Any], *, driver_as_bytes: bool = False) -> types.ModuleType:
    """A module object to put in ``sys.modules["pynvml"]``; ``calls`` records init/shutdown."""
    devices = snapshot["devices"]
    nvml = types.ModuleType("pynvml")
    state: dict[str, Any] = {"calls": []}
    nvml.calls = state["calls"]  # type: ignore[attr-defined]
    consts = {
        "NVML_TEMPERATURE_GPU": 0, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1, "NVML_VOLATILE_ECC": 0,
        "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1, "nvmlEventTypeXidCriticalError": 8,
        "NVML_ERROR_TIMEOUT": TIMEOUT,
    }  # fmt: skip
    for name, value in consts.items():
        setattr(nvml, name, value)
    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]

    def field(h: _Handle, name: str) -> Any:
        value = devices[h.index].get(name)
        if value is None:
            raise NVMLError(NOT_SUPPORTED)
        return value

    def expect(got: int, constant: str) -> None:
        if got != consts[constant]:
            raise NVMLError(f"Invalid Argument (expected {constant})")

    def init() -> None:
        state["calls"].append("init")

    def shutdown() -> None:
        state["calls"].append("shutdown")

    def driver() -> str | bytes:
        text: str = snapshot["driver_version"]
        return text.encode() if driver_as_bytes else text

    def temperature(h: _Handle, sensor: int) -> int:
        expect(sensor, "NVML_TEMPERATURE_GPU")
        return int(field(h, "temperature_c"))

    def threshold(h: _Handle, kind: int) -> int:
        expect(kind, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN")
        return int(field(h, "slowdown_temp_c"))

    def ecc(h: _Handle, error_type: int, counter: int) -> int:
        expect(error_type, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")
        expect(counter, "NVML_VOLATILE_ECC")
        return int(field(h, "ecc_volatile_uncorrected"))

    def retired(h: _Handle, cause: int) -> list[int]:
        expect(cause, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")
        return [0x1000 * (i + 1) for i in range(int(field(h, "retired_pages_dbe")))]

    def pending(h: _Handle) -> int:
        return int(field(h, "retired_pages_pending"))  # NVML_FEATURE_ENABLED = 1

    def remapped(h: _Handle) -> tuple[int, int, int, int]:
        unc = field(h, "remapped_rows_uncorrectable")
        pend, failed = field(h, "remapped_rows_pending"), field(h, "remapping_failed")
        return (0, int(unc), int(pend), int(failed))

    def register(h: _Handle, types_: int, event_set: str) -> None:
        expect(types_, "nvmlEventTypeXidCriticalError")
        with _CHANGED:
            _registered(event_set).gpus.add(h.index)
        for code in devices[h.index].get("xid_events", []):  # the recording's: heard now
            xid(h.index, code)

    table = {
        "nvmlInit": init, "nvmlShutdown": shutdown, "nvmlSystemGetDriverVersion": driver,
        "nvmlDeviceGetCount": lambda: len(devices),
        "nvmlDeviceGetHandleByIndex": _Handle,
        "nvmlDeviceGetName": lambda h: devices[h.index]["name"],
        "nvmlDeviceGetTemperature": temperature, "nvmlDeviceGetTemperatureThreshold": threshold,
        "nvmlDeviceGetTotalEccErrors": ecc, "nvmlDeviceGetRetiredPages": retired,
        "nvmlDeviceGetRetiredPagesPendingStatus": pending,
        "nvmlDeviceGetRemappedRows": remapped, "nvmlEventSetCreate": _event_set_create,
        "nvmlDeviceRegisterEvents": register, "nvmlEventSetWait_v2": _wait,
        "nvmlEventSetFree": _free,
        "nvmlDeviceGetIndex": lambda h: h.index,
    }  # fmt: skip
    for name, fn in table.items():
        setattr(nvml, name, fn)
    return nvml


def failing_init() -> types.ModuleType:
    """pynvml installed on a node without the NVIDIA driver: nvmlInit raises."""
    nvml = types.ModuleType("pynvml")

    def init() -> None:
        raise NVMLError("Driver Not Loaded")

    nvml.nvmlInit = init  # type: ignore[attr-defined]
    return nvml
