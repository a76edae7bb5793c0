"""Network namespaces held by processes (never by files under ``/run/netns``).

Python 3.11 has no ``os.setns``, and a namespace change made with ``setns(2)`` moves only the
calling thread. So: whole processes are started inside a namespace through util-linux's
``unshare``/``nsenter``; a short-lived single-threaded tool (``aegis ctl``) may enter one with
:func:`enter` before it starts any thread; and :class:`Connector` dials into a namespace from a
thread of its own (a socket belongs to the namespace it was created in, and can then be used
from any thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

from aegis.core.errors import AegisError

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
# Set in an emulated cluster's own network namespace (``aegis run --isolate-nodes``): the path
# of that namespace, so that a tool on the host (``aegis ctl``) can enter it.
CLUSTER_ENV = "AEGIS_CLUSTER_NETNS"
TOOLS = ("unshare", "nsenter", "ip", "setpriv")


class NamespaceError(AegisError, OSError):
    """A namespace could not be made or entered."""


def missing_prerequisite() -> str | None:
    """Why namespaces cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "needs root (network, mount and UTS namespaces)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux and iproute2)"
    return None


def cluster_netns() -> str:
    """The emulated cluster's namespace this process runs in ("" when on a plain host)."""
    path = os.environ.get(CLUSTER_ENV, "")
    return path if path.startswith("/proc/") else ""


def netns_path(pid: int) -> str:
    return f"/proc/{pid}/ns/net"


def enter(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NamespaceError(exc.errno, f"cannot open {path}: {exc.strerror}") from None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NamespaceError(errno, f"cannot enter {path}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class Connector:
    """Opens TCP connections inside another network namespace (from one thread kept there)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pool = ThreadPoolExecutor(1, "netns", initializer=enter, initargs=(path,))

    async def open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if os.stat(self.path).st_ino == os.stat(netns_path(os.getpid())).st_ino:
            raise NamespaceError(0, f"{self.path} is this process's own namespace (not yet made)")
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(self._pool, _dial, host, port)
        return await asyncio.open_connection(sock=sock)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _dial(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=5.0)
    sock.setblocking(False)
    return sock


async def forward(
    connector: Connector, listen: tuple[str, int], target: tuple[str, int]
) -> asyncio.Server:
    """A TCP forwarder: ``listen`` here (this process's namespace) to ``target`` in the
    connector's namespace, one connection for each accepted one."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            far_reader, far_writer = await connector.open(*target)
        except OSError as exc:
            log.debug("forward %s -> %s: %s", listen, target, exc)
            writer.close()
            return
        await asyncio.gather(_pump(reader, far_writer), _pump(far_reader, writer))

    return await asyncio.start_server(serve, *listen)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()
