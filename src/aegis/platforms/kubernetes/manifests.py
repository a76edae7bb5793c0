"""The pods of an ``AegisJob``, as plain dicts (no I/O).

One pod per worker, named ``<job>-<rank>`` (the master's pod names), whose entrypoint is the
agent. Two ways to get the agent into the pod (``spec.agent.mode``):

- ``initContainer`` (default): an init container from ``spec.agent.image`` copies a
  self-contained agent (``/opt/aegis``: a venv with ``aegis``) into an ``emptyDir`` mounted at
  ``/aegis``; the training container runs ``/aegis/bin/aegis agent ... -- CMD`` (the training
  image needs a compatible glibc, nothing else);
- ``image``: the training image already has ``aegis`` on its PATH (``pip install aegis-ft``).

Pods get torchrun's and Kubeflow's environment, node affinity that keeps them off the job's
ErrorNodes, ``restartPolicy: Never`` (the operator, not the kubelet, decides what comes back),
and an owner reference to the AegisJob (deleting the job deletes its pods).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aegis.agent import hang_policy
from aegis.checks import config as checks_config
from aegis.core.rendezvous import TORCH_PORT, RendezvousRule

GROUP = "aegis.dev"
VERSION = "v1"
PLURAL = "aegisjobs"
KIND = "AegisJob"
LABEL_JOB = "aegis.dev/job"
LABEL_RANK = "aegis.dev/rank"
AGENT_VOLUME = "aegis-agent"
TOKEN_VOLUME = "aegis-token"
TOKEN_DIR = "/var/run/aegis"
CA_VOLUME = "aegis-ca"
CA_DIR = "/var/run/aegis-ca"  # spec.tls.caConfigMap's ca.crt: the CA the agent trusts
DEFAULT_MASTER = "aegis-master.aegis-system.svc:50051"
DEFAULT_AGENT_IMAGE = "ghcr.io/aegis-ft/aegis:0.1.0"
RENDEZVOUS_PORT = TORCH_PORT
# The master's rule for the operator's pods (core/rendezvous.py): rank 0's pod IP once the
# platform reported it, its headless-service name before; ports from a range every pod owns
# (a pod has its own network namespace), a fresh pair each round.
RENDEZVOUS_RULE = RendezvousRule(
    fallback_host="{job}-0.{job}.{namespace}.svc", port_base=RENDEZVOUS_PORT
)
TERMINAL = ("Succeed", "Failed")

Body = dict[str, Any]


@dataclass(frozen=True, slots=True)
class JobView:
    """The fields of an AegisJob the operator reads (``spec`` and ``status``)."""

    name: str
    namespace: str
    uid: str
    replicas: int
    max_retry: int
    template: Mapping[str, Any]
    agent_mode: str
    agent_image: str
    master: str
    hang_timeout_s: float | None  # None: each agent calibrates its own
    checks: Mapping[str, Any]
    tls_ca_configmap: str  # "" : the master speaks plain gRPC (and NATS) to the agents
    phase: str
    should_quit: bool
    error_nodes: tuple[str, ...]
    drained_nodes: tuple[str, ...]  # taken out of service by ``aegis ctl drain``
    replacing: Mapping[str, str]  # pods the master waits to see replaced -> uid to replace

    @property
    def over(self) -> bool:
        """The pods must go: the job failed, was stopped, or succeeded."""
        return self.should_quit or self.phase in TERMINAL

    @property
    def failed_or_stopped(self) -> bool:
        return self.should_quit or self.phase == "Failed"

    @property
    def started(self) -> bool:
        return started(self.phase)


def started(phase: str) -> bool:
    """The master has taken the job past Pending (``phase``, as its status says): a pod created
    now is placed again in a running job, and its agent rejoins (``aegis agent --rejoin``: it
    never runs the command on its own, it tries again until its master answers)."""
    return phase not in ("", "Pending")


def view(body: Mapping[str, Any]) -> JobView:
    meta = body.get("metadata", {})
    spec = body.get("spec", {})
    status = body.get("status") or {}
    agent = spec.get("agent", {})
    return JobView(
        name=meta["name"],
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        replicas=int(spec.get("replicas", 1)),
        max_retry=int(spec.get("max_retry", 3)),
        template=spec.get("template", {}),
        agent_mode=agent.get("mode", "initContainer"),
        agent_image=agent.get("image", DEFAULT_AGENT_IMAGE),
        master=spec.get("master", DEFAULT_MASTER),
        hang_timeout_s=_optional_float(spec.get("hang_timeout_s")),
        checks=spec.get("checks", {}),
        tls_ca_configmap=str((spec.get("tls") or {}).get("caConfigMap", "")),
        phase=str(status.get("phase", "")),
        should_quit=bool(status.get("should_quit", False)),
        error_nodes=_nodes(status.get("error_nodes")),
        drained_nodes=_nodes(status.get("drained_nodes")),
        replacing={str(k): str(v) for k, v in (status.get("replacing") or {}).items() if v},
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _nodes(entries: Any) -> tuple[str, ...]:
    return tuple(str(e["node"]) for e in entries or [] if isinstance(e, Mapping) and "node" in e)


def pod_token_secret_name(pod: str) -> str:
    """The Secret holding only this pod's bootstrap secret (the one it mounts)."""
    return f"{pod}-aegis-pod-token"


def pod_name(job: str, rank: int) -> str:
    return f"{job}-{rank}"


def worker_env(job: JobView, rank: int) -> list[Body]:
    """torchrun's and Kubeflow's variables; rank 0's pod hosts the rendezvous (a headless
    service named after the job resolves ``<job>-0.<job>``)."""
    addr = f"{pod_name(job.name, 0)}.{job.name}.{job.namespace}.svc"
    plain = {
        "RANK": str(rank), "WORLD_SIZE": str(job.replicas), "LOCAL_RANK": "0",
        "MASTER_ADDR": addr, "MASTER_PORT": str(RENDEZVOUS_PORT),
        "PET_NNODES": str(job.replicas), "PET_NODE_RANK": str(rank),
        "PET_MASTER_ADDR": addr, "PET_MASTER_PORT": str(RENDEZVOUS_PORT),
        "AEGIS_JOB": job.name, "AEGIS_POD": pod_name(job.name, rank),
    }  # fmt: skip
    if job.checks:  # spec.checks, read by the agent (aegis.checks.config)
        plain[checks_config.ENV] = json.dumps(dict(job.checks), sort_keys=True)
    env: list[Body] = [{"name": k, "value": v} for k, v in plain.items()]
    env.append({"name": "AEGIS_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    # the agent's ACK says where the pod is (the rendezvous follows rank 0's pod IP)
    env.append({"name": "AEGIS_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return env


def agent_argv(job: JobView, rank: int, agent: str) -> list[str]:
    return [
        agent, "agent", "--master", job.master, "--namespace", job.namespace,
        "--job", job.name, "--pod", pod_name(job.name, rank),
        "--token-file", f"{TOKEN_DIR}/token", *hang_policy.flag(job.hang_timeout_s),
        *(("--tls-ca", f"{CA_DIR}/ca.crt") if job.tls_ca_configmap else ()),
        *(("--rejoin",) if job.started else ()),
        "--",
    ]  # fmt: skip


def avoid_nodes(nodes: Sequence[str]) -> Body:
    """Node affinity that keeps a pod off these nodes (the ErrorNodes and the drained)."""
    if not nodes:
        return {}
    term = {
        "matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": sorted(set(nodes))}
        ]
    }
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}  # fmt: skip


def pod_manifest(job: JobView, rank: int) -> Body:
    """The pod of ``rank``: the template's first container wrapped by the agent."""
    template = copy.deepcopy(dict(job.template))
    meta = template.get("metadata", {})
    spec = template.setdefault("spec", {})
    containers = spec.setdefault("containers", [{"name": "worker", "image": "python:3.11"}])
    main = containers[0]
    command = [*main.get("command", []), *main.get("args", [])] or ["python", "train.py"]
    binary = "/aegis/bin/aegis" if job.agent_mode == "initContainer" else "aegis"
    main["command"] = [*agent_argv(job, rank, binary), *command]
    main.pop("args", None)
    main["env"] = [*main.get("env", []), *worker_env(job, rank)]
    mounts = main.setdefault("volumeMounts", [])
    mounts.append({"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True})
    volumes = spec.setdefault("volumes", [])
    secret = {"secretName": pod_token_secret_name(pod_name(job.name, rank)), "defaultMode": 0o400}
    volumes.append({"name": TOKEN_VOLUME, "secret": secret})
    if job.tls_ca_configmap:  # the CA that signed the master's and NATS's certificates
        mounts.append({"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True})
        volumes.append({"name": CA_VOLUME, "configMap": {"name": job.tls_ca_configmap}})
    if job.agent_mode == "initContainer":
        mounts.append({"name": AGENT_VOLUME, "mountPath": "/aegis"})
        volumes.append({"name": AGENT_VOLUME, "emptyDir": {}})
        spec["initContainers"] = [*spec.get("initContainers", []), {
            "name": "aegis-agent", "image": job.agent_image,
            "command": ["cp", "-a", "/opt/aegis/.", "/aegis/"],
            "volumeMounts": [{"name": AGENT_VOLUME, "mountPath": "/aegis"}],
        }]  # fmt: skip
    spec["restartPolicy"] = "Never"
    spec["hostname"] = pod_name(job.name, rank)
    spec["subdomain"] = job.name
    affinity = avoid_nodes((*job.error_nodes, *job.drained_nodes))
    if affinity:
        spec["affinity"] = {**spec.get("affinity", {}), **affinity}
    labels = {**meta.get("labels", {}), LABEL_JOB: job.name, LABEL_RANK: str(rank)}
    owner = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": job.name, "uid": job.uid,
        "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(job.name, rank),
            "namespace": job.namespace,
            "labels": labels,
            "annotations": dict(meta.get("annotations", {})),
            "ownerReferences": [owner],
        },
        "spec": spec,
    }


def exit_code(pod: Mapping[str, Any]) -> int | None:
    """The main container's exit code once the pod has terminated, else None."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated is not None:
            return int(terminated.get("exitCode", 0))
    if status.get("phase") == "Failed":
        return 1
    return None
