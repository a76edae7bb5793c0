"""The gpu check: NVML readings behind a small port, and a pure verdict over them.

The reading (:class:`NvmlReader`) is the only part that talks to the driver; :func:`judge` decides
from a :class:`GpuSnapshot`, so the verdict is tested on recorded outputs of real GPUs. Field
names follow ``nvidia-smi -q`` (in brackets) and the NVML calls that fill them:

- ``ecc_volatile_uncorrected``: [ECC Errors > Volatile > DRAM Uncorrectable] (older drivers:
  [Double Bit > Device Memory]); ``nvmlDeviceGetTotalEccErrors(h, UNCORRECTED, VOLATILE_ECC)``
- ``retired_pages_dbe`` / ``retired_pages_pending``: [Retired Pages > Double Bit ECC] and
  [Pending Page Blacklist]; ``nvmlDeviceGetRetiredPages``, ``...RetiredPagesPendingStatus``
  (Kepler..Volta; "N/A" on Ampere+, where rows are remapped instead)
- ``remapped_rows_uncorrectable`` / ``remapped_rows_pending`` / ``remapping_failed``:
  [Remapped Rows > Uncorrectable Error / Pending / Remapping Failure Occurred];
  ``nvmlDeviceGetRemappedRows`` (Ampere+)
- ``temperature_c`` / ``slowdown_temp_c``: [Temperature > GPU Current Temp / GPU Slowdown Temp];
  ``nvmlDeviceGetTemperature``, ``nvmlDeviceGetTemperatureThreshold(h, SLOWDOWN)``
- ``xid_events``: critical Xid errors seen while the check listened
  (``nvmlDeviceRegisterEvents(h, nvmlEventTypeXidCriticalError)``), or, for the agent's health
  watch, since its first look (``checks.xids.XidListener``). The program's own Xids
  (``checks.xids.APPLICATION_XIDS``: an illegal address, a killed process) are no warning sign.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import msgspec

from aegis.checks import xids as xid_codes
from aegis.checks.base import CheckSettings, Outcome

log = logging.getLogger(__name__)


class GpuReading(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    index: int
    name: str
    temperature_c: int | None = None
    slowdown_temp_c: int | None = None
    ecc_volatile_uncorrected: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapping_failed: bool | None = None
    xid_events: list[int] = []
    unreachable: str | None = None  # why NVML could not reach it (its handle or name failed)


class GpuSnapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    driver_version: str
    devices: list[GpuReading]


class NvmlReader(Protocol):
    def read(self) -> GpuSnapshot | None:
        """Every visible GPU, or None when there is no NVML (no driver) on this node."""
        ...


def judge(snapshot: GpuSnapshot | None, require_gpu: bool, expected: int | None) -> Outcome:
    if snapshot is None or not snapshot.devices:
        what = "no NVML (no NVIDIA driver)" if snapshot is None else "no GPU"
        if require_gpu or expected:
            return Outcome(False, f"{what} on a node that must have GPUs")
        return Outcome(True, f"not_applicable: {what}", not_applicable=True)
    problems = health_warnings(snapshot)
    count = len(snapshot.devices)
    if expected is not None and count != expected:
        problems.insert(0, f"{count} GPU(s) visible, {expected} expected")
    names = sorted({d.name for d in snapshot.devices})
    summary = f"{count} GPU(s) {', '.join(names)}, driver {snapshot.driver_version}"
    if problems:
        return Outcome(False, f"{summary}: " + "; ".join(problems))
    hottest = max((d.temperature_c or 0) for d in snapshot.devices)
    return Outcome(True, f"{summary}, no ECC/Xid/remap trouble, hottest {hottest} C")


def health_warnings(snapshot: GpuSnapshot | None) -> list[str]:
    """The warning signs of every GPU (none without NVML): what fails the gpu check, and what
    makes the agent's health watch (``agent.health``) ask for its node to be drained."""
    return [p for device in (snapshot.devices if snapshot else ()) for p in _problems(device)]


def _problems(d: GpuReading) -> list[str]:
    out = []
    at = f"GPU {d.index}"
    if d.unreachable is not None:  # (GPU_IS_LOST: fallen off the bus)
        out.append(f"{at}: unreachable ({d.unreachable})")
    if d.ecc_volatile_uncorrected:
        out.append(f"{at}: {d.ecc_volatile_uncorrected} volatile uncorrected ECC error(s)")
    if d.retired_pages_pending:
        out.append(f"{at}: page retirement pending ({d.retired_pages_dbe or 0} DBE page(s))")
    if d.remapping_failed:
        out.append(f"{at}: row remapping failed")
    elif d.remapped_rows_pending:
        out.append(f"{at}: row remapping pending ({d.remapped_rows_uncorrectable} uncorrectable)")
    if hardware := xid_codes.hardware(d.xid_events):
        out.append(f"{at}: critical Xid {', '.join(str(x) for x in hardware)}")
    if d.temperature_c is not None and d.slowdown_temp_c and d.temperature_c >= d.slowdown_temp_c:
        out.append(f"{at}: {d.temperature_c} C at/above slowdown {d.slowdown_temp_c} C")
    return out


class RealNvml:
    """Reads NVML through ``pynvml`` (nvidia-ml-py); listens ``xid_wait_ms`` for Xid events, or,
    with a ``listener``, takes the Xids it heard since the first read (the health watch)."""

    def __init__(
        self, xid_wait_ms: int = 100, listener: xid_codes.XidListener | None = None
    ) -> None:
        self._xid_wait_ms = xid_wait_ms
        self._listener = listener

    def read(self) -> GpuSnapshot | None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # no library, no driver: not a GPU node
            log.debug("NVML unavailable: %s", exc)
            return None
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            found = [_device(pynvml, i) for i in range(_count(pynvml))]
            if self._listener is not None:
                xids = self._listener.heard(pynvml)
            else:
                xids = self._xids(pynvml, [h for h, _name, _why in found if h is not None])
            unnamed = xids.get(-1, [])  # an Xid of a GPU NVML could not name: every GPU's
            devices = [_reading(pynvml, i, device, sorted({*xids.get(i, []), *unnamed}))
                       for i, device in enumerate(found)]  # fmt: skip
            return GpuSnapshot(driver_version=driver, devices=devices)
        finally:
            pynvml.nvmlShutdown()

    def _xids(self, nvml: Any, handles: list[Any]) -> dict[int, list[int]]:
        if not handles or self._xid_wait_ms <= 0:
            return {}
        found: dict[int, list[int]] = {}
        event_set = _optional(nvml.nvmlEventSetCreate)
        if event_set is None:
            return {}
        try:
            for h in handles:
                _optional(
                    nvml.nvmlDeviceRegisterEvents, h, nvml.nvmlEventTypeXidCriticalError, event_set
                )
            while data := _optional(nvml.nvmlEventSetWait_v2, event_set, self._xid_wait_ms):
                # NVML hands back a new handle object (a ctypes pointer, equal to ours only
                # by address): ask NVML which GPU it is.
                index = _optional(nvml.nvmlDeviceGetIndex, data.device)
                found.setdefault(-1 if index is None else int(index), []).append(
                    int(data.eventData)
                )
        finally:
            _optional(nvml.nvmlEventSetFree, event_set)
        return found


def _count(nvml: Any) -> int:
    return int(nvml.nvmlDeviceGetCount())


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(fn: Any, *args: Any) -> Any:
    """An NVML call that some GPUs/drivers do not support: None when it is not available."""
    try:
        return fn(*args)
    except Exception:
        return None


def _device(nvml: Any, index: int) -> tuple[Any, str, str]:
    """GPU ``index``'s handle and name; or None, and why NVML could not reach it."""
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        return h, _text(nvml.nvmlDeviceGetName(h)), ""
    except Exception as exc:  # GPU_IS_LOST and the like: the look goes on with the others
        return None, "?", f"{type(exc).__name__}: {exc}"[:200]


def _reading(nvml: Any, index: int, device: tuple[Any, str, str], xids: list[int]) -> GpuReading:
    h, name, why = device
    if h is None:
        return GpuReading(index=index, name=name, xid_events=xids, unreachable=why)
    remapped = _optional(nvml.nvmlDeviceGetRemappedRows, h)  # (corr, unc, pending, failed)
    retired = _optional(
        nvml.nvmlDeviceGetRetiredPages, h, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    )
    pending = _optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    return GpuReading(
        index=index,
        name=name,
        temperature_c=_optional(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
        slowdown_temp_c=_optional(
            nvml.nvmlDeviceGetTemperatureThreshold, h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        ),
        ecc_volatile_uncorrected=_optional(
            nvml.nvmlDeviceGetTotalEccErrors,
            h,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        ),
        retired_pages_dbe=None if retired is None else len(retired),
        retired_pages_pending=None if pending is None else bool(pending),
        remapped_rows_uncorrectable=None if remapped is None else int(remapped[1]),
        remapped_rows_pending=None if remapped is None else bool(remapped[2]),
        remapping_failed=None if remapped is None else bool(remapped[3]),
        xid_events=xids,
    )


async def gpu_check(settings: CheckSettings) -> Outcome:
    return await gpu_check_with(RealNvml(), settings)


async def gpu_check_with(reader: NvmlReader, settings: CheckSettings) -> Outcome:
    snapshot = await asyncio.to_thread(reader.read)
    return judge(snapshot, settings.require_gpu, settings.gpu_count)
