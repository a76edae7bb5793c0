"""A free TCP port for a child process to listen on (a nats-server, a check's rendezvous)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port no socket on ``host`` holds now (the kernel's pick). Another process may take it
    before the child binds it: callers that cannot retry keep to a port range of their own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
