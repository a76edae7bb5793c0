"""TLS from files, named as a Kubernetes TLS Secret holds them (what cert-manager's
``Certificate`` writes): ``tls.crt`` (the certificate chain), ``tls.key`` (its key), ``ca.crt``
(the CA that signed the peers' certificates).

A server (the master's credentials server, nats-server) proves itself with ``tls.crt`` and
``tls.key``; a client (the master's and the agent's NATS connections, the agent's credentials
call) trusts ``ca.crt`` only. Clients prove nothing by TLS: they authenticate with the job's
bootstrap token and their NATS credentials.

``diagnose`` turns a failed handshake into one line that says what is wrong (the peer speaks
TLS but no CA was given; its certificate is not signed by the given CA; it does not speak TLS).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from aegis.core.errors import AegisError

CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"


class TlsConfigError(AegisError, ValueError):
    """A TLS directory or CA file that cannot be used (a file missing or unreadable)."""


@dataclass(frozen=True, slots=True)
class TlsDir:
    """A directory holding ``tls.crt``, ``tls.key`` and (optionally) ``ca.crt``."""

    path: Path

    @property
    def cert(self) -> Path:
        return self.path / CERT

    @property
    def key(self) -> Path:
        return self.path / KEY

    @property
    def ca(self) -> Path | None:
        """The CA that clients of this side trust (None: not in the directory)."""
        ca = self.path / CA
        return ca if ca.is_file() else None

    def check(self) -> TlsDir:
        """Itself; raises ``TlsConfigError`` naming the files that are missing."""
        missing = [p.name for p in (self.cert, self.key) if not p.is_file()]
        if missing:
            raise TlsConfigError(f"{self.path}: no {' or '.join(missing)}")
        return self

    def key_pair(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain) in PEM, as gRPC wants them."""
        return self.key.read_bytes(), self.cert.read_bytes()


def check_ca(path: Path) -> Path:
    """``path`` when it is a readable PEM file; ``TlsConfigError`` otherwise."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise TlsConfigError(f"{path}: {exc.strerror or exc}") from None
    if "BEGIN CERTIFICATE" not in text:
        raise TlsConfigError(f"{path}: not a PEM certificate")
    return path


def client_context(ca: Path) -> ssl.SSLContext:
    """A client context that trusts ``ca`` only (and checks the peer's host name)."""
    return ssl.create_default_context(cafile=str(ca))


def _handshake(host: str, port: int, context: ssl.SSLContext, timeout_s: float) -> None:
    with (
        socket.create_connection((host, port), timeout=timeout_s) as sock,
        context.wrap_socket(sock, server_hostname=host),
    ):
        pass


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port)."""
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def diagnose(target: str, ca: Path | None, timeout_s: float = 5.0) -> str | None:
    """Why a TLS (or plain) connection to ``target`` fails at the TLS layer, in one line;
    None when TLS is not the trouble (the peer is down, or the handshake works)."""
    host, port = split_target(target)
    anything = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anything.check_hostname, anything.verify_mode = False, ssl.CERT_NONE
    try:
        _handshake(host, port, anything, timeout_s)
    except ssl.SSLError:
        speaks_tls = False
    except OSError:
        return None  # not reachable at all: not a TLS problem
    else:
        speaks_tls = True
    if ca is None:
        return f"{target} speaks TLS: give its CA certificate (--tls-ca)" if speaks_tls else None
    if not speaks_tls:
        return f"{target} does not speak TLS (--tls-ca {ca} was given)"
    with contextlib.suppress(OSError):
        try:
            _handshake(host, port, client_context(ca), timeout_s)
        except ssl.SSLCertVerificationError as exc:
            return f"{target}: its certificate is not trusted by {ca} ({exc.verify_message})"
        except ssl.SSLError as exc:
            return f"{target}: TLS handshake failed ({exc.reason or exc})"
    return None
