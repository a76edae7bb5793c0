"""How the agent reaches its master and who it is there (``LinkSettings``), and what the
training command learns of its place in the job (:func:`training_env`)."""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aegis.checks import config as checks_config
from aegis.spawn import owners

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LinkSettings:
    grpc_target: str
    namespace: str
    job: str
    pod: str
    token: str
    node: str = ""
    heartbeat_s: float = 1.0
    health_s: float = 30.0  # between looks at the node's GPUs (0: none; agent.health)
    resend_s: float = 2.0
    connect_timeout_s: float = 10.0
    scratch_dir: Path = Path("/tmp")
    inject: frozenset[str] = frozenset()
    checks: checks_config.ChecksConfig = field(default_factory=checks_config.ChecksConfig)
    ckpt_dir: Path | None = None  # where this pod's saver daemon persists (None: no saver)
    decline_after_s: float = 5.0  # a script silent this long after a checkpoint request
    tls_ca: Path | None = None  # TLS to the master and NATS, trusting this CA only
    rejoin: bool = False  # a pod placed again in a running job: never run independently
    # the process that started this agent and leads its job (``aegis run``; None: another
    # platform's): once it is gone nothing is sent, as another run may lead a job of the name
    parent: int | None = None


def training_env(settings: LinkSettings, rank: int, world_size: int) -> dict[str, str]:
    """The environment of the training command: torchrun's and Kubeflow's variables."""
    s = settings
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "PET_NNODES": str(world_size),
        "PET_NODE_RANK": str(rank),
        "AEGIS_JOB": s.job,
        "AEGIS_NAMESPACE": s.namespace,
        "AEGIS_POD": s.pod,
        "AEGIS_NODE": s.node,
    }


def inject_from_env(env: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The chaos switch set by ``aegis run --inject-fault NODE:CHECK`` for this node."""
    raw = env.get("AEGIS_INJECT_FAULT", "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def memory_prefix(namespace: str, job: str, pod: str, node: str) -> str:
    """The start of the name of a pod's checkpoint memory under ``/dev/shm`` (keyed by node, so
    a replacement elsewhere reads the disk copy; a submission's digest follows)."""
    return re.sub(
        r"[^A-Za-z0-9_.-]", "_", f"aegis-{job}-{pod}-{digest(f'{namespace}/{job}/{pod}/{node}')}-"
    )


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def forget_memory(
    shm_root: Path, prefix: str, whose: str, keep: Path | None = None, level: int = logging.INFO
) -> None:
    """Remove the checkpoint memory named ``<shm_root>/<prefix>*`` but ``keep``: what a killed
    agent left (one that exits removes its own); ``whose`` says which, in the log. Memory held
    by a live agent (:func:`aegis.spawn.owners.held`) stays: on a shared host another run's
    pod of the same job, pod and node names has that prefix too."""
    for path in shm_root.glob(glob.escape(prefix) + "*"):
        if path != keep and not owners.held(path):
            log.log(level, "removing the checkpoint memory %s left: %s", whose, path)
            shutil.rmtree(path, ignore_errors=True)
