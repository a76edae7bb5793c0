"""The control file of a master (``control.json``, 0600): where ``aegis ctl`` finds it (the
NATS URL, the master's credentials, its own control subject, the emulated cluster's network
namespace), written by ``aegis run``, a Slurm coordinator and the leader of replicas, and
removed by whoever wrote it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from aegis.adapters import netns
from aegis.adapters.nats_auth import UserCreds
from aegis.adapters.ports import Bus

CONTROL_SUBJECT = "aegisctl.request"
CONTROL_FILE = "control.json"
CTL_FILE_ENV = "AEGIS_CTL_FILE"


@dataclass(frozen=True, slots=True)
class ControlTarget:
    """What ``aegis ctl`` needs to reach one master: its NATS server, the credentials to connect
    with (None: a server without auth), the run's namespace and job, and its own subject."""

    nats_url: str
    creds: UserCreds | None
    namespace: str
    job: str
    netns: str = ""  # the emulated cluster's network namespace, entered to reach nats_url
    subject: str = CONTROL_SUBJECT  # the master's own (``Serving.subject``)


def write_control_file(path: Path, target: ControlTarget, *, writer: str = "") -> None:
    """Owner-only (0600) from the first byte: it holds the master's credentials. ``writer``
    names who wrote it (:func:`remove_control_file`)."""
    body = {"nats_url": target.nats_url, "namespace": target.namespace, "job": target.job,
            "jwt": target.creds.jwt if target.creds else "",
            "seed": target.creds.seed.decode() if target.creds else "",
            "inbox_prefix": target.creds.inbox_prefix if target.creds else "_INBOX",
            "netns": target.netns, "subject": target.subject, "writer": writer}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # (replicas write into one directory)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(body, out)
    os.replace(tmp, path)


def remove_control_file(path: Path, writer: str) -> None:
    """Remove the control file at ``path`` if ``writer`` wrote it; one another wrote since (a
    successor leading by now), or one that cannot be read, stays."""
    try:
        there = msgspec.json.decode(path.read_bytes(), type=_ControlFile)
    except (OSError, ValueError):
        return
    if writer and there.writer == writer:
        path.unlink(missing_ok=True)


class _ControlFile(msgspec.Struct):
    nats_url: str
    namespace: str = "default"
    job: str = ""
    jwt: str = ""
    seed: str = ""
    inbox_prefix: str = "_INBOX"
    netns: str = ""
    subject: str = CONTROL_SUBJECT  # the master's own; an older version's file: the shared one
    writer: str = ""  # who wrote it: a leader's lead (none: aegis run, a Slurm coordinator)


def read_control_file(path: Path) -> ControlTarget:
    """``ValueError`` (msgspec's, saying where) for a file ``write_control_file`` did not write."""
    body = msgspec.json.decode(path.read_bytes(), type=_ControlFile)
    creds = UserCreds(body.jwt, body.seed.encode(), body.inbox_prefix, None) if body.jwt else None
    return ControlTarget(body.nats_url, creds, body.namespace, body.job, body.netns, body.subject)


def unreadable(path: Path, exc: Exception) -> str:
    """One line on a control file that could not be read: one that is not there means no run
    is live there (a run removes its own as it ends)."""
    if isinstance(exc, FileNotFoundError):
        return (f"no live run at {path.parent}: no {path.name} there (the run has ended, or "
                "this is no run's log directory)")  # fmt: skip
    return f"cannot read control file {path}: {exc}"


def bus_target(bus: Bus, namespace: str, job: str, subject: str) -> ControlTarget | None:
    """The URL and credentials a connected ``NatsBus`` uses (for ``aegis run``'s control
    file), and the master's own control ``subject``. None for a bus that does not say (the
    in-memory one)."""
    url = getattr(bus, "url", "")
    if not url:
        return None
    creds = getattr(bus, "creds", None)
    return ControlTarget(url, creds if isinstance(creds, UserCreds) else None, namespace, job,
                         netns.cluster_netns(), subject)  # fmt: skip
