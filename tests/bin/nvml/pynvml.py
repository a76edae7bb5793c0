"""A stand-in for ``pynvml`` (nvidia-ml-py) in end-to-end runs on machines without a GPU: with
this directory on ``PYTHONPATH``, each node's processes read the recording
``$AEGIS_TEST_NVML/<hostname>.json`` (the node's name on the emulated cluster), read again at
each ``nvmlInit``, so a test changes a node's GPUs while the job runs; a node without one has
the healthy A100 recording. The answers come from ``tests.fake_pynvml``: the calls
``checks.gpu.RealNvml`` makes, their arguments checked as the real library would."""

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


def nvmlInit() -> None:
    _load().nvmlInit()


def __getattr__(name: str) -> Any:
    return getattr(_current[0] if _current else _load(), name)
