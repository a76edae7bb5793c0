"""Shared fixtures: a real nats-server per test (free ports, operator-mode auth, JetStream)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_server import EmbeddedNats


@pytest.fixture
def authority() -> Authority:
    return Authority()


@pytest.fixture
def nats_server(authority: Authority) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(authority)
    server.start()
    try:
        yield server
    finally:
        server.stop()
