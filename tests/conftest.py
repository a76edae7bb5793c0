"""Shared fixtures: a real nats-server per test (free ports, operator-mode auth, JetStream;
``open_nats``: one with no auth, as a team's own server and ``aegis run --nats`` are), and
``harness``: the master's job runner under test (``tests.runner_harness``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_server import EmbeddedNats
from tests.runner_harness import harness  # noqa: F401 (a fixture, for every test module)

# Hypothesis' defaults depend on the machine's speed (a 200 ms deadline per example, a health
# check that fails when generating data is slow): on a loaded 2-core machine they fail by
# chance. Every property test runs under settings that do not.
settings.register_profile(
    "aegis",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)
settings.load_profile("aegis")


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


@pytest.fixture
def open_nats() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(None)
    server.start()
    try:
        yield server
    finally:
        server.stop()
