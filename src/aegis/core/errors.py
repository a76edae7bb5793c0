"""The error hierarchy: one root, remote (bad input from a peer) vs local (our invariant broke)."""

from __future__ import annotations


class AegisError(Exception):
    """Root of every error Aegis raises on purpose."""


class RemoteError(AegisError):
    """Bad input from a peer or a user: drop it, log it, count it, carry on."""

    def __init__(self, reason: str, *, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class LocalError(AegisError):
    """One of our own invariants broke: crash loudly and let the supervisor restart us."""


class SetupError(AegisError):
    """What a command needs from where it runs is not there (no cluster credentials, say): the
    command says what, in one line, and exits 1; nothing has started."""
