"""The admission webhook's decision for a pod: wrap it by the agent or leave it (no I/O).

A pod opts in with the label (or annotation) ``aegis.dev/inject: "true"``, which a
``PyTorchJob``'s or ``TrainJob``'s pod template passes down to its pods. Wrapping it (one
JSONPatch) does what the operator does for an ``AegisJob``'s pods (``manifests.pod_manifest``):

- an init container of the Aegis image copies Aegis into an ``emptyDir`` at ``/aegis``;
- the training container (``pytorch``, ``node``, else the first) runs
  ``/aegis/bin/aegis agent --master M --namespace NS --job J --pod P --token-file ... -- CMD``
  where CMD is its ``command`` + ``args``. A container with ``args`` only relies on its image's
  ENTRYPOINT, which an admission webhook cannot see: the annotation ``aegis.dev/entrypoint``
  (a JSON list, e.g. ``["python"]``) names it; without it the pod is refused with that hint;
- the pod mounts its own bootstrap secret, the Secret ``<P>-aegis-pod-token`` (the webhook server
  provisions it before answering, derived from the job's secret as the operator does);
- the controller's environment (``MASTER_ADDR``, ``PET_*``, ``RANK``...) stays as it is; any
  ``AEGIS_*`` variable the pod's author wrote is dropped and replaced by the webhook's.

P (``<job>-<rank>``, the master's name), J and the rank come from ``webhook_identity`` (the
controller's labels and job object); the pod is labelled ``aegis.dev/wrapped-job`` and
``aegis.dev/wrapped-rank``, and annotated ``aegis.dev/injected: P``. A pod already
wrapped for that identity (the webhook runs again on reinvocation) is left as it is.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aegis.agent import hang_policy
from aegis.platforms.kubernetes import manifests, webhook_identity

INJECT = "aegis.dev/inject"
ENTRYPOINT = "aegis.dev/entrypoint"
INJECTED = "aegis.dev/injected"  # set by the webhook: the identity the pod was wrapped for
LABEL_JOB = "aegis.dev/wrapped-job"
LABEL_RANK = "aegis.dev/wrapped-rank"
INIT_NAME = "aegis-agent"
AGENT = "/aegis/bin/aegis"
MAIN_NAMES = ("pytorch", "node")  # PyTorchJob's required container name; the Trainer's
OURS_VOLUMES = (manifests.AGENT_VOLUME, manifests.TOKEN_VOLUME, manifests.CA_VOLUME)

Body = dict[str, Any]


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """What every wrapped pod gets (``aegis webhook``'s options)."""

    master: str = manifests.DEFAULT_MASTER
    agent_image: str = manifests.DEFAULT_AGENT_IMAGE
    tls_ca_configmap: str = ""  # "": the master speaks plain gRPC to the agents
    hang_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class MutationResult:
    """``allowed`` with ``patch`` (JSONPatch ops, empty: unchanged), or refused by ``message``.
    ``identity`` is set when the pod is wrapped: its Secret must exist before it starts."""

    allowed: bool
    patch: list[Body] = field(default_factory=list)
    message: str = ""
    warnings: tuple[str, ...] = ()
    identity: webhook_identity.Identity | None = None


def opted_in(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    return "true" in {
        str((meta.get("labels") or {}).get(INJECT, "")).lower(),
        str((meta.get("annotations") or {}).get(INJECT, "")).lower(),
    }


def mutate(
    pod: Mapping[str, Any],
    namespace: str,
    settings: WebhookSettings,
    *,
    job: Mapping[str, Any] | None = None,
    rejoin: bool = False,
) -> MutationResult:
    """The decision for a pod being created in ``namespace`` (``job``: the PyTorchJob named by
    ``webhook_identity.pytorchjob_of(pod)``, as read from the API, when there is one;
    ``rejoin``: the job has started, the pod is placed again in it)."""
    if not opted_in(pod):
        return MutationResult(allowed=True)
    try:
        who = webhook_identity.of_pod(pod, namespace, job=job)
        main_at = _main_container(pod)
        if _wrapped_for(pod, who, main_at):
            return MutationResult(allowed=True)
        command = _command(pod, main_at)
        _check_free(pod)
    except webhook_identity.IdentityError as exc:
        return MutationResult(allowed=False, message=f"aegis: cannot wrap this pod: {exc}")
    except webhook_identity.NotTrainingError as exc:
        return MutationResult(allowed=True, warnings=(f"aegis: not wrapped: {exc}",))
    wrapped = wrap(pod, who, main_at, command, settings, rejoin=rejoin)
    patch = [{"op": "add", "path": path, "value": wrapped[top][key]}
             for path, (top, key) in _PATCHED.items() if key in wrapped[top]]  # fmt: skip
    return MutationResult(allowed=True, patch=patch, identity=who)


_PATCHED = {
    "/metadata/labels": ("metadata", "labels"),
    "/metadata/annotations": ("metadata", "annotations"),
    "/spec/initContainers": ("spec", "initContainers"),
    "/spec/containers": ("spec", "containers"),
    "/spec/volumes": ("spec", "volumes"),
}  # each an "add" of the whole field: JSONPatch's add replaces a member that exists


def wrap(
    pod: Mapping[str, Any],
    who: webhook_identity.Identity,
    main_at: int,
    command: list[str],
    settings: WebhookSettings,
    *,
    rejoin: bool = False,
) -> Body:
    """The pod wrapped by the agent (a copy)."""
    out: Body = copy.deepcopy(dict(pod))
    meta, spec = out.setdefault("metadata", {}), out.setdefault("spec", {})
    main = spec["containers"][main_at]
    main["command"] = [*agent_argv(who, settings, rejoin=rejoin), *command]
    main.pop("args", None)
    kept = [e for e in main.get("env") or [] if not str(e.get("name", "")).startswith("AEGIS_")]
    main["env"] = [*kept, *_aegis_env(who)]
    mounts = main.setdefault("volumeMounts", [])
    mounts.append({"name": manifests.TOKEN_VOLUME, "mountPath": manifests.TOKEN_DIR,
                   "readOnly": True})  # fmt: skip
    mounts.append({"name": manifests.AGENT_VOLUME, "mountPath": "/aegis"})
    volumes = spec.setdefault("volumes", [])
    secret = manifests.pod_token_secret_name(who.pod)
    volumes.append({"name": manifests.TOKEN_VOLUME,
                    "secret": {"secretName": secret, "defaultMode": 0o400}})  # fmt: skip
    volumes.append({"name": manifests.AGENT_VOLUME, "emptyDir": {}})
    if settings.tls_ca_configmap:
        mounts.append({"name": manifests.CA_VOLUME, "mountPath": manifests.CA_DIR,
                       "readOnly": True})  # fmt: skip
        volumes.append({"name": manifests.CA_VOLUME,
                        "configMap": {"name": settings.tls_ca_configmap}})  # fmt: skip
    spec["initContainers"] = [*(spec.get("initContainers") or []), {
        "name": INIT_NAME, "image": settings.agent_image,
        "command": ["cp", "-a", "/opt/aegis/.", "/aegis/"],
        "volumeMounts": [{"name": manifests.AGENT_VOLUME, "mountPath": "/aegis"}],
    }]  # fmt: skip
    meta["labels"] = {**(meta.get("labels") or {}), LABEL_JOB: who.job, LABEL_RANK: str(who.rank)}
    meta["annotations"] = {**(meta.get("annotations") or {}), INJECTED: who.pod}
    return out


def agent_argv(
    who: webhook_identity.Identity, settings: WebhookSettings, *, rejoin: bool = False
) -> list[str]:
    return [
        AGENT, "agent", "--master", settings.master, "--namespace", who.namespace,
        "--job", who.job, "--pod", who.pod,
        "--token-file", f"{manifests.TOKEN_DIR}/token", *hang_policy.flag(settings.hang_timeout_s),
        *(("--tls-ca", f"{manifests.CA_DIR}/ca.crt") if settings.tls_ca_configmap else ()),
        *(("--rejoin",) if rejoin else ()),
        "--",
    ]  # fmt: skip


def _aegis_env(who: webhook_identity.Identity) -> list[Body]:
    return [
        {"name": "AEGIS_JOB", "value": who.job},
        {"name": "AEGIS_POD", "value": who.pod},
        {"name": "AEGIS_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "AEGIS_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def _main_container(pod: Mapping[str, Any]) -> int:
    containers = (pod.get("spec") or {}).get("containers")
    if not isinstance(containers, list) or not containers:
        raise webhook_identity.IdentityError("the pod has no containers")
    if not all(isinstance(c, Mapping) for c in containers):
        raise webhook_identity.IdentityError("spec.containers holds something not a container")
    names = [c.get("name") for c in containers]
    return next((names.index(n) for n in MAIN_NAMES if n in names), 0)


def _command(pod: Mapping[str, Any], main_at: int) -> list[str]:
    main = pod["spec"]["containers"][main_at]
    command, args = main.get("command") or [], main.get("args") or []
    if not command:
        raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ENTRYPOINT)
        if raw is None:
            raise webhook_identity.IdentityError(
                f"container {main.get('name')!r} has no command (its image's ENTRYPOINT is "
                f"unknown to the webhook): set its command, or the annotation {ENTRYPOINT} "
                'to the ENTRYPOINT as a JSON list, e.g. ["python"]'
            )
        command = _entrypoint(raw)
    argv = [*command, *args]
    if not all(isinstance(a, str) for a in argv):
        raise webhook_identity.IdentityError("the command and args must be strings")
    return argv


def _entrypoint(raw: Any) -> list[str]:
    try:
        value = json.loads(str(raw))
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise webhook_identity.IdentityError(
            f'annotation {ENTRYPOINT} must be a non-empty JSON list of strings, e.g. ["python"]'
        )
    return value


def _wrapped_for(pod: Mapping[str, Any], who: webhook_identity.Identity, main_at: int) -> bool:
    """Already wrapped by this webhook for this very identity (reinvocation)."""
    meta = pod.get("metadata") or {}
    if (meta.get("annotations") or {}).get(INJECTED) != who.pod:
        return False
    main = pod["spec"]["containers"][main_at]
    expected = {"secretName": manifests.pod_token_secret_name(who.pod), "defaultMode": 0o400}
    token = [v.get("secret") for v in pod["spec"].get("volumes") or []
             if isinstance(v, Mapping) and v.get("name") == manifests.TOKEN_VOLUME]  # fmt: skip
    command = [str(a) for a in main.get("command") or []]
    inits = [c.get("name") for c in pod["spec"].get("initContainers") or []]
    if token != [expected] or INIT_NAME not in inits or command[:2] != [AGENT, "agent"]:
        return False
    at = command.index("--pod") + 1 if "--pod" in command else len(command)
    return command[at : at + 1] == [who.pod]


def _check_free(pod: Mapping[str, Any]) -> None:
    """Refuse a pod that already has Aegis's names (e.g. a token volume of its own choosing)."""
    spec = pod.get("spec") or {}
    taken = {v.get("name") for v in spec.get("volumes") or [] if isinstance(v, Mapping)}
    taken &= set(OURS_VOLUMES)
    inits = {c.get("name") for c in spec.get("initContainers") or [] if isinstance(c, Mapping)}
    if INIT_NAME in inits:
        taken.add(f"init container {INIT_NAME}")
    if taken:
        raise webhook_identity.IdentityError(
            f"the pod already has {', '.join(sorted(str(t) for t in taken))}, which the webhook "
            "adds itself (a pod cannot choose its own Aegis volumes)"
        )
