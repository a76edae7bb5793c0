"""``aegis slurm submit`` (write and submit the sbatch script) and ``aegis slurm coordinator``
(the master and the agents' steps inside the allocation)."""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from aegis.cli import options, paths, run_cmd
from aegis.platforms.slurm import commands, coordinator

_PASS_THROUGH = {"allow_interspersed_args": False, "ignore_unknown_options": True}


def register(app: typer.Typer) -> None:
    slurm = typer.Typer(name="slurm", help="Run a job under Aegis on Slurm.", no_args_is_help=True)
    slurm.command("submit", context_settings=_PASS_THROUGH)(submit)
    slurm.command("coordinator", context_settings=_PASS_THROUGH)(run_coordinator)
    app.add_typer(slurm)


# sbatch's short options that take a value (``-p gpu`` or ``-pgpu``), and its long options that
# take none (every other long option takes one: ``--time 10`` or ``--time=10``; those whose
# value is optional, such as --exclusive, take it only as ``--opt=value``).
_SHORT_WITH_VALUE = frozenset("AaBbCcDdeFGiJLMmNnopqStwx")
_LONG_FLAGS = frozenset({
    "--contiguous", "--exclusive", "--get-user-env", "--hold", "--ignore-pbs", "--no-kill",
    "--no-requeue", "--overcommit", "--oversubscribe", "--parsable", "--quiet", "--reboot",
    "--requeue", "--spread-job", "--test-only", "--use-min-nodes", "--verbose", "--wait",
    "--exact", "--help", "--usage", "--version", "--nice", "--propagate",
})  # fmt: skip


def split_sbatch_options(args: list[str]) -> tuple[list[str], list[str]]:
    """Leading sbatch options, each with its value (``-p gpu``, ``-pgpu``, ``--time=10``: one
    ``#SBATCH`` line each), and then the command; an explicit ``--`` ends the options."""
    options: list[str] = []
    index = 0
    while index < len(args):
        word = args[index]
        if word == "--":
            return options, args[index + 1 :]
        if not word.startswith("-") or word == "-":
            break
        index += 1
        takes_value = (
            word not in _LONG_FLAGS and "=" not in word
            if word.startswith("--")
            else len(word) == 2 and word[1] in _SHORT_WITH_VALUE
        )
        if takes_value and index < len(args):
            word = f"{word} {shlex.quote(args[index])}"  # one #SBATCH line: quoted if spaced
            index += 1
        options.append(word)
    return options, args[index:]


# submit's own options: after an sbatch option they would reach sbatch (and -N/--nodes is ours)
_OWN_OPTIONS = frozenset({
    "--nodes", "-N", "--max-retry", "--spare-nodes", "--job", "--state-dir", "--hang-timeout-s",
    "--inject-fault", "--dry-run", "--nats", "--advertise", "--master", "--auth-file",
})  # fmt: skip


def _refuse_own_options(options: list[str]) -> None:
    for option in options:
        name = option.split("=", 1)[0].split(" ", 1)[0]
        if name in _OWN_OPTIONS or (name.startswith("-N") and not name.startswith("--")):
            raise typer.BadParameter(
                f"{name} after an sbatch option; put aegis's options first "
                "(aegis slurm submit --nodes 2 -p gpu -- CMD)",
                param_hint="CMD",
            )


def _command(cmd: list[str]) -> tuple[str, ...]:
    return tuple(["bash", "-c", cmd[0]] if len(cmd) == 1 else cmd)


# Options of both commands, one alias each, so a command's function stays short.
Job = Annotated[str, typer.Option(help="Job name (a DNS label).", callback=options.slurm_job_name)]


def _nats(text: str) -> typer.models.OptionInfo:
    made: typer.models.OptionInfo = typer.Option(help=text, callback=options.nats_url)
    return made


def submit(  # noqa: PLR0913 (a typer command: one parameter per option)
    cmd: Annotated[
        list[str], typer.Argument(help="[sbatch options, e.g. -p gpu --time=10] then the command.")
    ],
    nodes: Annotated[int, typer.Option(min=1, help="Pods (one per node).")] = 1,
    max_retry: Annotated[int, typer.Option(min=0, help="Fault budget.")] = 3,
    spare_nodes: Annotated[int, typer.Option(min=0, help="Extra nodes for replacements.")] = 1,
    job: Job = "job",
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Shared directory for logs and the store (default ./.aegis/JOB)."),
    ] = None,
    hang_timeout_s: Annotated[
        float | None,
        typer.Option(min=0, help="0: no hang watchdog; default: calibrated by each agent."),
    ] = None,
    health_s: options.HealthEvery = 30.0,
    inject_fault: Annotated[list[str] | None, typer.Option(help="NODE:CHECK (chaos).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the script, do not submit.")] = False,
    nats: Annotated[str | None, _nats("A NATS server all nodes reach (default: embedded).")] = None,
    advertise: Annotated[
        str | None, typer.Option(help="How the agents reach the batch step's master.")
    ] = None,
    master: Annotated[
        str | None,
        typer.Option(help="Use this running aegis master (HOST:GRPC_PORT,...); needs --nats."),
    ] = None,
    auth_file: Annotated[
        Path | None, typer.Option(help="With --master: its --auth-file (on a shared filesystem).")
    ] = None,
) -> None:
    """Write an sbatch script that runs CMD on --nodes nodes under Aegis and submit it."""
    sbatch_options, command = split_sbatch_options(cmd)
    _refuse_own_options(sbatch_options)
    if not command:
        raise typer.BadParameter("no command given", param_hint="CMD")
    run_cmd.parse_injections(inject_fault or [])
    _check_master_options(master, nats, auth_file)
    state = (state_dir or Path.cwd() / ".aegis" / job).resolve()
    spec = commands.SubmitSpec(
        job=job, nodes=nodes, spare_nodes=spare_nodes, max_retry=max_retry, state_dir=state,
        command=_command(command), sbatch_options=tuple(sbatch_options),
        inject=tuple(inject_fault or ()), hang_timeout_s=hang_timeout_s, health_s=health_s,
        nats_url=nats, advertise=advertise, master=master,
        auth_file=auth_file.resolve() if auth_file is not None else None,
    )  # fmt: skip
    script = commands.batch_script(spec)
    if dry_run:
        print(script, end="")
        raise typer.Exit(0)
    paths.made_dir(state)  # one that is a file, or cannot be made: one line
    path = state / "job.sbatch"
    path.write_text(script)
    result = asyncio.run(commands.SubprocessCommands()(["sbatch", "--parsable", str(path)]))
    if result.returncode != 0:
        print(f"aegis: sbatch failed: {result.stderr.strip()}", file=sys.stderr)
        raise typer.Exit(1)
    print(f"aegis slurm: submitted job {result.stdout.strip()} ({path}); state in {state}")


def _check_master_options(master: str | None, nats: str | None, auth_file: Path | None) -> None:
    if master is not None and nats is None:
        raise typer.BadParameter(
            "needs --nats (the NATS server of that master)", param_hint="--master"
        )
    if auth_file is not None and master is None:
        raise typer.BadParameter("only with --master", param_hint="--auth-file")
    if auth_file is not None and not auth_file.is_file():
        raise typer.BadParameter(f"no such file: {auth_file}", param_hint="--auth-file")


def run_coordinator(  # noqa: PLR0913 (a typer command: one parameter per option)
    cmd: Annotated[list[str], typer.Argument(help="The training command (after --).")],
    job: Job,
    state_dir: Annotated[Path, typer.Option(help="Shared directory for logs and the store.")],
    nodes: Annotated[int, typer.Option(min=1, help="Pods (one per node).")] = 1,
    max_retry: Annotated[int, typer.Option(min=0, help="Fault budget.")] = 3,
    advertise: Annotated[str, typer.Option(help="How agents reach this host.")] = "127.0.0.1",
    nats: Annotated[str | None, _nats("Use this NATS server (no auth).")] = None,
    hang_timeout_s: Annotated[float | None, typer.Option(min=0)] = None,
    health_s: options.HealthEvery = 30.0,
    heartbeat_timeout_s: Annotated[float, typer.Option(min=0.5)] = 5.0,
    join_timeout_s: options.JoinTimeout = 600.0,
    grace_s: Annotated[float, typer.Option(min=0)] = 5.0,
    status_file: Annotated[Path | None, typer.Option(help="Write the final status here.")] = None,
    inject_fault: Annotated[list[str] | None, typer.Option(help="NODE:CHECK (chaos).")] = None,
    master: Annotated[
        str | None, typer.Option(help="Use this running aegis master (HOST:GRPC_PORT,...).")
    ] = None,
    auth_file: Annotated[Path | None, typer.Option(help="With --master: its keys.")] = None,
) -> None:
    """Inside an allocation: the master (or --master's) and one srun step per pod, until
    Succeed or Failed."""
    _check_master_options(master, nats, auth_file)
    settings = coordinator.CoordinatorSettings(
        command=_command(cmd), job=job, nodes=nodes, max_retry=max_retry, state_dir=state_dir,
        advertise=advertise, nats_url=nats, hang_timeout_s=hang_timeout_s, health_s=health_s,
        heartbeat_timeout_s=heartbeat_timeout_s, join_timeout_s=join_timeout_s, grace_s=grace_s,
        status_file=status_file, inject=run_cmd.parse_injections(inject_fault or []),
        master=master, auth_file=auth_file,
    )  # fmt: skip
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    result = asyncio.run(coordinator.run_coordinator(settings))
    status = result.status
    drained = ", ".join(f"{n} ({r})" for n, r in result.drained) or "none"
    print(
        f"aegis slurm: job {result.spec.job} {status.phase.value}; recover_count "
        f"{status.recover_count}/{result.spec.max_retry}; drained: {drained}"
    )
    raise typer.Exit(result.exit_code)
