"""The rdma check: device and port states read from sysfs (``/sys/class/infiniband``).

Each port directory ``<root>/<device>/ports/<n>/`` holds one-line files written by the kernel's
ib_core, e.g. ``state`` = ``4: ACTIVE``, ``phys_state`` = ``5: LinkUp``, ``rate`` =
``200 Gb/sec (4X HDR)``, ``link_layer`` = ``InfiniBand`` (or ``Ethernet`` for RoCE).
A port is healthy when it is ``ACTIVE`` and ``LinkUp``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from aegis.checks.base import CheckSettings, Outcome


@dataclass(frozen=True, slots=True)
class PortState:
    device: str
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED, ... ("" when unreadable)
    phys_state: str  # LinkUp, Disabled, Polling, ...
    rate: str = ""
    link_layer: str = ""

    @property
    def healthy(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"


def state_name(text: str) -> str:
    """``'4: ACTIVE\\n'`` -> ``'ACTIVE'`` (the name after the numeric code)."""
    _, _, name = text.strip().partition(":")
    return name.strip() if name else text.strip()


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def read_ports(root: Path) -> list[PortState]:
    ports: list[PortState] = []
    if not root.is_dir():
        return ports
    for device in sorted(root.iterdir()):
        port_root = device / "ports"
        if not port_root.is_dir():
            continue
        for port in sorted(
            port_root.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0
        ):
            ports.append(
                PortState(
                    device=device.name,
                    port=int(port.name) if port.name.isdigit() else 0,
                    state=state_name(_read(port / "state")),
                    phys_state=state_name(_read(port / "phys_state")),
                    rate=_read(port / "rate"),
                    link_layer=_read(port / "link_layer"),
                )
            )
    return ports


def judge(ports: list[PortState], expect_rdma: bool) -> Outcome:
    if not ports:
        if expect_rdma:
            return Outcome(False, "no RDMA device/port found, RDMA expected")
        return Outcome(True, "not_applicable: no RDMA device", not_applicable=True)
    bad = [p for p in ports if not p.healthy]
    devices = len({p.device for p in ports})
    if bad:
        detail = ", ".join(
            f"{p.device}/{p.port} {p.state or '?'}/{p.phys_state or '?'}" for p in bad
        )
        return Outcome(False, f"{len(bad)} of {len(ports)} RDMA port(s) not active: {detail}")
    rates = sorted({p.rate for p in ports if p.rate})
    return Outcome(
        True, f"{devices} RDMA device(s), {len(ports)} port(s) ACTIVE/LinkUp {', '.join(rates)}"
    )


async def rdma_check(settings: CheckSettings) -> Outcome:
    ports = await asyncio.to_thread(read_ports, settings.rdma_root)
    return judge(ports, settings.expect_rdma)
