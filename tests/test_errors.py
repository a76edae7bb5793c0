"""Every error Aegis raises on purpose has one root (issue 17): ``except AegisError`` catches
each of them, and each is named ``*Error``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import aegis
from aegis.core.errors import AegisError

SKIP = ("aegis._site", "aegis.adapters.grpc._generated", "aegis.__main__")


def test_every_exception_aegis_defines_is_an_aegis_error_named_error() -> None:
    found = []
    for info in pkgutil.walk_packages(aegis.__path__, "aegis."):
        if info.name.startswith(SKIP):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            defined_here = inspect.isclass(value) and value.__module__ == info.name
            if defined_here and issubclass(value, BaseException):
                found.append((info.name, name, value))
    assert len(found) >= 15
    outside = [f"{mod}.{name}" for mod, name, cls in found if not issubclass(cls, AegisError)]
    assert outside == []
    misnamed = [f"{mod}.{name}" for mod, name, _ in found if not name.endswith("Error")]
    assert misnamed == []
