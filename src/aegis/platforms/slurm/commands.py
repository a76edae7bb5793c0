"""Slurm command lines and the batch script, as pure functions (no I/O), plus the one port that
runs them (``SlurmCommands``) and its real adapter (``subprocess``)."""

from __future__ import annotations

import asyncio
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aegis.agent import hang_policy

DRAIN_PREFIX = "aegis: "


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class SlurmCommands(Protocol):
    """Runs a Slurm client command (``scontrol``, ``sbatch``) to completion."""

    async def __call__(self, argv: Sequence[str]) -> CommandResult: ...


class SubprocessCommands:
    async def __call__(self, argv: Sequence[str]) -> CommandResult:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode is not None
        return CommandResult(
            proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
        )


def drain_argv(node: str, reason: str) -> list[str]:
    """``scontrol update`` that drains ``node``; the reason says it was Aegis and why."""
    text = " ".join(f"{DRAIN_PREFIX}{reason}".split())[:200]
    return ["scontrol", "update", f"nodename={node}", "state=drain", f"reason={text}"]


def resume_argv(node: str) -> list[str]:
    """``scontrol update`` that makes a drained ``node`` schedulable again (``aegis ctl
    undrain``)."""
    return ["scontrol", "update", f"nodename={node}", "state=resume"]


def hostnames_argv(nodelist: str) -> list[str]:
    return ["scontrol", "show", "hostnames", nodelist]


def holder_options(env: Mapping[str, str]) -> tuple[str, ...]:
    """The allocation's per-node resources, as sbatch options for a requested node: its
    account, QoS, memory, GPUs and CPUs (from the batch step's environment)."""
    out = []
    for var, option in (("SLURM_JOB_ACCOUNT", "--account"), ("SLURM_JOB_QOS", "--qos"),
                        ("SLURM_GPUS_PER_NODE", "--gpus-per-node"),
                        ("SLURM_CPUS_ON_NODE", "--cpus-per-task")):  # fmt: skip
        if env.get(var):
            out.append(f"{option}={env[var]}")
    if env.get("SLURM_MEM_PER_NODE"):
        out.append(f"--mem={env['SLURM_MEM_PER_NODE']}M")
    if not env.get("SLURM_GPUS_PER_NODE") and env.get("SLURM_JOB_GPUS"):
        out.append(f"--gpus-per-node={len(env['SLURM_JOB_GPUS'].split(','))}")
    return tuple(out)


def request_node_argv(
    name: str,
    exclude: Iterable[str],
    output: Path,
    partition: str | None = None,
    resources: Sequence[str] = (),
) -> list[str]:
    """A one-node job that only holds its node (``sleep infinity``), so that a pod with no
    healthy spare left in the allocation gets an ``srun --jobid`` step there."""
    argv = ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", f"--job-name={name}",
            f"--output={output}", "--no-requeue"]  # fmt: skip
    excluded = sorted(exclude)
    if excluded:
        argv.append(f"--exclude={','.join(excluded)}")
    if partition:
        argv.append(f"--partition={partition}")
    return [*argv, *resources, "--wrap=exec sleep infinity"]


def job_state_argv(job_id: str) -> list[str]:
    """``STATE NODE`` of one job (empty once it left the queue)."""
    return ["squeue", "-h", "-j", job_id, "-o", "%T %N"]


def cancel_argv(job_id: str) -> list[str]:
    return ["scancel", job_id]


@dataclass(frozen=True, slots=True)
class AgentStep:
    """One pod's agent as an ``srun`` step pinned to one node of the allocation."""

    job: str
    namespace: str
    pod: str
    node: str
    master: str  # HOST:PORT of the credentials server
    token_file: Path
    command: tuple[str, ...]
    grace_s: float = 5.0
    hang_timeout_s: float | None = None  # None: each agent calibrates; 0: off
    heartbeat_s: float = 1.0
    health_s: float = 30.0  # between the agent's looks at its GPUs (0: none)
    python: str = field(default=sys.executable)
    job_id: str | None = None  # a step of this Slurm job (a requested node), not the allocation's
    rejoin: bool = False  # the pod placed again in a running job (``aegis agent --rejoin``)


def srun_argv(step: AgentStep) -> list[str]:
    """``--overlap`` lets the step share the batch step's CPUs (the coordinator is tiny)."""
    exports = ["ALL", f"AEGIS_NODE={step.node}"]
    elsewhere = [f"--jobid={step.job_id}"] if step.job_id else []
    return [
        "srun", *elsewhere, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={step.node}",
        f"--job-name={step.pod}", "--kill-on-bad-exit=0", f"--export={','.join(exports)}",
        step.python, "-m", "aegis", "agent",
        "--master", step.master, "--namespace", step.namespace, "--job", step.job,
        "--pod", step.pod, "--node", step.node, "--token-file", str(step.token_file),
        "--grace-s", str(step.grace_s), *hang_policy.flag(step.hang_timeout_s),
        "--heartbeat-s", str(step.heartbeat_s), "--health-s", str(step.health_s),
        *(["--rejoin"] if step.rejoin else []),
        "--", *step.command,
    ]  # fmt: skip


def step_env(base: Mapping[str, str], inject: frozenset[str]) -> dict[str, str]:
    """The environment of an ``srun`` (``--export=ALL`` passes it on to the agent):
    ``AEGIS_INJECT_FAULT`` only on the node where it was asked for."""
    env = {k: v for k, v in base.items() if k != "AEGIS_INJECT_FAULT"}
    if inject:
        env["AEGIS_INJECT_FAULT"] = ",".join(sorted(inject))
    return env


@dataclass(frozen=True, slots=True)
class SubmitSpec:
    job: str
    nodes: int
    spare_nodes: int
    max_retry: int
    state_dir: Path
    command: tuple[str, ...]
    sbatch_options: tuple[str, ...] = ()
    inject: tuple[str, ...] = ()  # NODE:CHECK
    hang_timeout_s: float | None = None  # None: each agent calibrates; 0: off
    health_s: float = 30.0  # between the agents' looks at their GPUs (0: none)
    python: str = field(default=sys.executable)
    nats_url: str | None = None  # a NATS server the nodes reach (default: one in the batch step)
    advertise: str | None = None  # how the agents reach the batch step's master
    master: str | None = None  # an existing aegis master (HOST:PORT,...): none in the batch step
    auth_file: Path | None = None  # that master's keys


def batch_script(spec: SubmitSpec) -> str:
    """The sbatch script: one task per node, requeue on a lost allocation, the coordinator."""
    coordinator = [
        spec.python, "-m", "aegis", "slurm", "coordinator",
        "--job", spec.job, "--nodes", str(spec.nodes), "--max-retry", str(spec.max_retry),
        "--state-dir", str(spec.state_dir), *hang_policy.flag(spec.hang_timeout_s),
        "--health-s", str(spec.health_s), "--status-file", str(spec.state_dir / "status.json"),
    ]  # fmt: skip
    for item in spec.inject:
        coordinator += ["--inject-fault", item]
    for option, given in (("--nats", spec.nats_url), ("--advertise", spec.advertise),
                          ("--master", spec.master), ("--auth-file", spec.auth_file)):  # fmt: skip
        if given is not None:
            coordinator += [option, str(given)]
    coordinator += ["--", *spec.command]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job}",
        f"#SBATCH --nodes={spec.nodes + spec.spare_nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        f"#SBATCH --output={spec.state_dir}/slurm-%j.out",
        *(f"#SBATCH {option}" for option in spec.sbatch_options),
        "# Written by 'aegis slurm submit'. The coordinator runs the Aegis master (or hands the",
        "# job to an existing one: --master) and one srun step per pod; the fault budget lives in",
        "# the store, so a requeued allocation resumes with what is left of it.",
        f"exec {shlex.join(coordinator)}",
        "",
    ]
    return "\n".join(lines)
