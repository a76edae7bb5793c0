"""A second implementation of the part of ``pynvml`` (nvidia-ml-py) that ``RealNvml`` calls,
answering from a recorded snapshot: every reading the GPU did not report (``null``: e.g. remapped
rows on Volta, retired pages on Ampere) raises NVML's "Not Supported", as the real library does.
Arguments are checked against the constants the real calls need, so a wrong sensor, counter or
error type is an error here as it would be a wrong number there."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any


class NVMLError(Exception):
    pass


NOT_SUPPORTED = "Not Supported"
TIMEOUT = "Timeout"


class _Handle:
    """Like pynvml's handles (ctypes pointers): equal only to itself, so code that looks a
    handle up by equality finds nothing, as it would on a real GPU."""

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True)
class _EventData:
    device: _Handle
    eventData: int  # pynvml's name


def module(snapshot: dict[str, Any], *, driver_as_bytes: bool = False) -> types.ModuleType:
    """A module object to put in ``sys.modules["pynvml"]``; ``calls`` records init/shutdown."""
    devices = snapshot["devices"]
    nvml = types.ModuleType("pynvml")
    state: dict[str, Any] = {"calls": [], "events": []}
    nvml.calls = state["calls"]  # type: ignore[attr-defined]
    consts = {
        "NVML_TEMPERATURE_GPU": 0, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1, "NVML_VOLATILE_ECC": 0,
        "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1, "nvmlEventTypeXidCriticalError": 8,
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

    def event_set_create() -> str:
        return "event-set"

    def register(h: _Handle, types_: int, event_set: str) -> None:
        expect(types_, "nvmlEventTypeXidCriticalError")
        # each event carries a new handle object for its GPU, as NVML's do
        events = devices[h.index].get("xid_events", [])
        state["events"].extend(_EventData(_Handle(h.index), x) for x in events)

    def wait(event_set: str, timeout_ms: int) -> _EventData:
        if not state["events"]:
            raise NVMLError(TIMEOUT)
        event: _EventData = state["events"].pop(0)
        return event

    table = {
        "nvmlInit": init, "nvmlShutdown": shutdown, "nvmlSystemGetDriverVersion": driver,
        "nvmlDeviceGetCount": lambda: len(devices),
        "nvmlDeviceGetHandleByIndex": _Handle,
        "nvmlDeviceGetName": lambda h: devices[h.index]["name"],
        "nvmlDeviceGetTemperature": temperature, "nvmlDeviceGetTemperatureThreshold": threshold,
        "nvmlDeviceGetTotalEccErrors": ecc, "nvmlDeviceGetRetiredPages": retired,
        "nvmlDeviceGetRetiredPagesPendingStatus": pending,
        "nvmlDeviceGetRemappedRows": remapped, "nvmlEventSetCreate": event_set_create,
        "nvmlDeviceRegisterEvents": register, "nvmlEventSetWait_v2": wait,
        "nvmlEventSetFree": lambda event_set: None,
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
