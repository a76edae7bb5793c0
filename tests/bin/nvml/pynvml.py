"""A stand-in for ``pynvml`` (nvidia-ml-py) in end-to-end runs on machines without a GPU: with
this directory on ``PYTHONPATH``, each node's processes read the recording
``$AEGIS_TEST_NVML/<hostname>.json`` (the node's name on the emulated cluster), read again at
each ``nvmlInit``, so a test changes a node's GPUs while the job runs; a node without one has
the healthy A100 recording. The answers come from ``tests.fake_pynvml``: the calls
``checks.gpu.RealNvml`` makes, their arguments checked as the real library would. Xid events
happen when a test adds lines ``INDEX CODE`` to ``$AEGIS_TEST_NVML/<hostname>.xids``: each new
line is one event, at the next ``nvmlInit`` of the node's agent (a look), heard by the event sets
registered then (the agent's listener's), as NVML's."""

from __future__ import annotations

import json
import os
import socket
import sys
import types
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(_ROOT))

from tests import fake_pynvml  # noqa: E402

HEALTHY = _ROOT / "tests" / "data" / "nvml_a100_healthy.json"
_current: list[types.ModuleType] = []


def _load() -> types.ModuleType:
    path = Path(os.environ["AEGIS_TEST_NVML"]) / f"{socket.gethostname()}.json"
    raw = json.loads((path if path.exists() else HEALTHY).read_text())
    _current[:] = [fake_pynvml.module(raw["snapshot"])]
    return _current[0]


_happened: list[int] = [0]  # lines of the node's .xids file already turned into events


def _xids() -> None:
    path = Path(os.environ["AEGIS_TEST_NVML"]) / f"{socket.gethostname()}.xids"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines[_happened[0] :]:
        index, code = line.split()
        fake_pynvml.xid(int(index), int(code))
    _happened[0] = len(lines)


def nvmlInit() -> None:
    _load().nvmlInit()
    _xids()


def __getattr__(name: str) -> Any:
    return getattr(_current[0] if _current else _load(), name)
