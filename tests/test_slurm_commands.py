"""The Slurm platform's pure parts and its decisions, without Slurm: the batch script, the srun
and scontrol command lines, the requeue budget, and draining through the SlurmCommands port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from aegis.adapters.memory import MemoryStore
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.cli import slurm_cmd
from aegis.core import events as ev
from aegis.core.model import JobSpec, NodeName, PodName, initial_status
from aegis.master import control
from aegis.master.records import submit_job
from aegis.master.service import STATUS_BUCKET
from aegis.platforms.process_pods import Pod
from aegis.platforms.slurm import commands, coordinator
from aegis.platforms.slurm.platform import SlurmPlatform, SlurmSettings
from aegis.wire import status_json
from tests.waits import async_wait_until


class RecordingSlurm:
    def __init__(self, stdout: str = "", returncode: int = 0) -> None:
        self.calls: list[list[str]] = []
        self.stdout, self.returncode = stdout, returncode

    async def __call__(self, argv: Sequence[str]) -> commands.CommandResult:
        self.calls.append(list(argv))
        return commands.CommandResult(self.returncode, self.stdout, "")


def _spec(tmp_path: Path, **extra: object) -> commands.SubmitSpec:
    base: dict[str, object] = {"job": "t", "nodes": 2, "spare_nodes": 1, "max_retry": 3}
    base |= {"state_dir": tmp_path, "command": ("python", "train.py")}
    base.update(extra)
    return commands.SubmitSpec(**base)  # type: ignore[arg-type]


def test_batch_script_requeues_and_asks_for_pods_plus_spares(tmp_path: Path) -> None:
    script = commands.batch_script(_spec(tmp_path, sbatch_options=("--partition=gpu", "-t 10")))
    assert script.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --requeue\n" in script
    assert "#SBATCH --partition=gpu\n" in script and "#SBATCH -t 10\n" in script
    last = script.strip().splitlines()[-1]
    assert last.startswith("exec ") and " slurm coordinator " in last
    assert last.endswith("-- python train.py") and "--max-retry 3" in last
    assert " --health-s 30.0 " in last  # the agents' looks at their GPUs, as aegis run's
    watched = commands.batch_script(_spec(tmp_path, health_s=0.0)).strip().splitlines()[-1]
    assert " --health-s 0.0 " in watched  # 0: no looks


def test_batch_script_hands_the_job_to_an_existing_master_when_asked(tmp_path: Path) -> None:
    auth = tmp_path / "auth.json"
    script = commands.batch_script(
        _spec(tmp_path, master="m1:7000,m2:7000", nats_url="nats://n:4222", auth_file=auth)
    )
    last = script.strip().splitlines()[-1]
    for option in ("--master m1:7000,m2:7000", "--nats nats://n:4222", f"--auth-file {auth}"):
        assert f" {option} " in last
    assert last.endswith("-- python train.py")
    plain = commands.batch_script(_spec(tmp_path)).strip().splitlines()[-1]
    assert "--master" not in plain and "--nats" not in plain  # default: all in the batch step


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--master", "h:1"], "needs --nats"),
        (["-p", "gpu", "--nodes", "2"], "--nodes after an sbatch option; put aegis's options"),
        (["--time=5", "-N", "2"], "-N after an sbatch option"),
        (["--auth-file", "/nonexistent"], "only with --master"),
        (["--master", "h:1", "--nats", "nats://h:4222", "--auth-file", "/nonexistent"],
         "no such file: /nonexistent"),
    ],
)  # fmt: skip
def test_submit_refuses_master_options_that_cannot_work_in_one_line(
    args: list[str], message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aegis", "slurm", "submit", "--dry-run", *args, "--", "python"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "options", "command"),
    [
        (["-pgpu", "--time=10", "python", "-u"], ["-pgpu", "--time=10"], ["python", "-u"]),
        (["-p", "gpu", "python", "x"], ["-p gpu"], ["python", "x"]),  # a separate value
        (["--partition", "gpu", "-t", "10", "torchrun", "x"],
         ["--partition gpu", "-t 10"], ["torchrun", "x"]),
        (["--exclusive", "--hold", "python"], ["--exclusive", "--hold"], ["python"]),  # flags
        (["-H", "-k", "python"], ["-H", "-k"], ["python"]),  # short flags
        (["-p", "gpu", "--", "-weird-name", "x"], ["-p gpu"], ["-weird-name", "x"]),
        (["-p"], ["-p"], []),  # no command: the caller says so
        (["-J", "my job", "--nice", "python"], ["-J 'my job'", "--nice"], ["python"]),
    ],
)  # fmt: skip
def test_sbatch_options_and_their_values_come_before_the_command(
    args: list[str], options: list[str], command: list[str]
) -> None:
    assert slurm_cmd.split_sbatch_options(args) == (options, command)


def test_srun_pins_one_agent_to_its_node() -> None:
    step = commands.AgentStep(
        job="t", namespace="default", pod="t-1", node="n2", master="h:1",
        token_file=Path("/s/tok"), command=("python", "x"),
    )  # fmt: skip
    argv = commands.srun_argv(step)
    assert argv[0] == "srun" and "--nodelist=n2" in argv and "--nodes=1" in argv
    assert "--export=ALL,AEGIS_NODE=n2" in argv
    assert argv[argv.index("--pod") + 1] == "t-1"
    assert argv[-3:] == ["--", "python", "x"]
    assert argv[argv.index("--health-s") + 1] == "30.0"
    assert commands.srun_argv(replace(step, health_s=2.5)).count("2.5") == 1
    assert "--rejoin" not in argv  # its first start: it may run on its own without a master
    again = commands.srun_argv(replace(step, rejoin=True))
    assert again[again.index("--") - 1] == "--rejoin"  # placed again in a running job


def test_inject_fault_reaches_only_its_node() -> None:
    env = commands.step_env({"AEGIS_INJECT_FAULT": "io", "PATH": "/bin"}, frozenset({"gpu"}))
    assert env["AEGIS_INJECT_FAULT"] == "gpu"
    assert "AEGIS_INJECT_FAULT" not in commands.step_env({"AEGIS_INJECT_FAULT": "io"}, frozenset())


def test_drain_reason_says_aegis_and_why() -> None:
    argv = commands.drain_argv("n2", "gpu check failed:\n  ECC")
    assert argv == ["scontrol", "update", "nodename=n2", "state=drain",
                    "reason=aegis: gpu check failed: ECC"]  # fmt: skip


async def test_blacklisted_node_is_drained_and_never_used_again(tmp_path: Path) -> None:
    slurm = RecordingSlurm()
    platform = SlurmPlatform(
        SlurmSettings(nodes=("n1", "n2"), spares=("n3",), command=("true",), log_dir=tmp_path),
        slurm,
    )
    platform.used_nodes |= {"n1", "n2"}
    await platform.blacklist_node("t", "n2", "gpu check failed")
    assert slurm.calls == [commands.drain_argv("n2", "gpu check failed")]
    assert platform.drained == [("n2", "gpu check failed")]
    platform.used_nodes.discard("n2")
    assert platform._spare() == "n3"


class ScriptedSlurm:
    """Answers by command name (sbatch, squeue, scancel), recording every call."""

    def __init__(self, answers: dict[str, commands.CommandResult]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    async def __call__(self, argv: Sequence[str]) -> commands.CommandResult:
        self.calls.append(list(argv))
        return self.answers.get(argv[0], commands.CommandResult(0, "", ""))


def _no_spare(tmp_path: Path, slurm: ScriptedSlurm) -> tuple[SlurmPlatform, list[object]]:
    events: list[object] = []
    platform = SlurmPlatform(
        SlurmSettings(nodes=("n1", "n2"), spares=(), command=("true",), log_dir=tmp_path,
                      node_request_s=0.3, node_poll_s=0.01, partition="gpu"),
        slurm,
    )  # fmt: skip
    platform.attach(events.append, namespace="default", job="t",
                    pods={PodName("t-0"): "n1", PodName("t-1"): "n2"}, master="h:1",
                    token="tok")  # fmt: skip
    platform.pods = {p: Pod(p, n) for p, n in platform.initial.items()}
    platform.used_nodes |= {"n1", "n2"}
    platform.blacklist["n2"] = "gpu"
    return platform, events


@pytest.mark.parametrize(
    ("answers", "cancelled"),
    [
        ({"sbatch": commands.CommandResult(1, "", "sbatch: error: QOSMaxNodeLimit")}, False),
        ({"sbatch": commands.CommandResult(0, "77;cluster\n", ""),
          "squeue": commands.CommandResult(0, "PENDING ", "")}, True),  # never granted in time
        ({"sbatch": commands.CommandResult(0, "77\n", ""),
          "squeue": commands.CommandResult(0, "", "")}, True),  # gone from the queue (refused)
    ],
)  # fmt: skip
async def test_a_node_that_slurm_does_not_grant_stops_the_job_with_its_reason(
    tmp_path: Path, answers: dict[str, commands.CommandResult], cancelled: bool
) -> None:
    slurm = ScriptedSlurm(answers)
    platform, events = _no_spare(tmp_path, slurm)
    await platform._replace(PodName("t-1"), same_node=False, reason="gpu")
    assert events == [ev.QuitRequested("no healthy node left for t-1")]
    request = slurm.calls[0]
    assert request[0] == "sbatch" and "--exclude=n1,n2" in request and "--nodes=1" in request
    assert "--partition=gpu" in request
    assert (["scancel", "77"] in slurm.calls) is cancelled
    assert platform.requested == {}


async def test_stopping_the_job_gives_up_a_pending_node_request_and_cancels_it(
    tmp_path: Path,
) -> None:
    slurm = ScriptedSlurm({"sbatch": commands.CommandResult(0, "77\n", ""),
                           "squeue": commands.CommandResult(0, "PENDING\n", "")})  # fmt: skip
    platform, events = _no_spare(tmp_path, slurm)
    platform.settings = replace(platform.settings, node_request_s=600.0)
    moving = asyncio.create_task(platform._replace(PodName("t-1"), same_node=False, reason="x"))
    await async_wait_until(lambda: any(c[0] == "squeue" for c in slurm.calls), 10, "a poll")
    async with asyncio.timeout(10):  # not the 600 s the request would wait
        await platform.stop_all()
        await moving
    assert ["scancel", "77"] in slurm.calls
    assert events == [ev.QuitRequested("no healthy node left for t-1")]  # moot, job is over


def test_a_requested_node_asks_for_what_the_allocation_has() -> None:
    env = {"SLURM_JOB_ACCOUNT": "ml", "SLURM_JOB_QOS": "high", "SLURM_MEM_PER_NODE": "64000",
           "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_CPUS_ON_NODE": "32"}  # fmt: skip
    options = commands.holder_options(env)
    assert set(options) == {"--account=ml", "--qos=high", "--mem=64000M",
                            "--gpus-per-node=4", "--cpus-per-task=32"}  # fmt: skip
    argv = commands.request_node_argv("t-node", ["n1"], Path("/o"), "gpu", options)
    assert argv[-1] == "--wrap=exec sleep infinity" and "--gpus-per-node=4" in argv
    assert commands.holder_options({}) == ()


async def test_a_granted_node_gets_the_pods_step_in_the_holding_job(tmp_path: Path) -> None:
    slurm = ScriptedSlurm({"sbatch": commands.CommandResult(0, "77\n", ""),
                           "squeue": commands.CommandResult(0, "RUNNING n9\n", "")})  # fmt: skip
    platform, events = _no_spare(tmp_path, slurm)
    spawned: list[str] = []

    async def spawn(state: Pod) -> bool:
        spawned.append(f"{state.name}@{state.node}:{platform.requested.get(state.node)}")
        return True  # started

    platform._spawn = spawn  # type: ignore[method-assign]
    await platform._replace(PodName("t-1"), same_node=False, reason="gpu")
    assert spawned == ["t-1@n9:77"] and platform.requested == {"n9": "77"}
    assert events == [ev.PodRestarted(PodName("t-1"), NodeName("n9"), "n9")]
    assert "n9" in platform.known_nodes()
    await platform.stop_all()
    assert slurm.calls[-1] == ["scancel", "77"] and platform.requested == {}
    step = commands.AgentStep(job="t", namespace="default", pod="t-1", node="n9", master="h:1",
                              token_file=tmp_path, command=("x",), job_id="77")  # fmt: skip
    assert commands.srun_argv(step)[:2] == ["srun", "--jobid=77"]


async def test_failed_drain_is_logged_not_recorded(tmp_path: Path) -> None:
    platform = SlurmPlatform(
        SlurmSettings(nodes=("n1",), spares=(), command=("true",), log_dir=tmp_path),
        RecordingSlurm(returncode=1),
    )
    await platform.blacklist_node("t", "n1", "bad")
    assert platform.drained == [] and "n1" in platform.blacklist


async def test_a_real_command_that_fails_on_stderr_is_a_result_not_an_exception() -> None:
    """The real runner decodes what a failing command says (sbatch, scontrol write errors to
    stderr), invalid bytes included."""
    script = (
        "import sys; sys.stdout.write('out'); sys.stderr.buffer.write(b'bad \\xff'); sys.exit(3)"
    )
    result = await commands.SubprocessCommands()([sys.executable, "-c", script])
    assert (result.returncode, result.stdout) == (3, "out")
    assert result.stderr.startswith("bad ") and result.stderr.endswith("\ufffd")


async def test_allocated_nodes_are_expanded_by_scontrol() -> None:
    slurm = RecordingSlurm(stdout="n1\nn2\nn3\n")
    nodes = await coordinator.allocated_nodes(slurm, {"SLURM_JOB_NODELIST": "n[1-3]"})
    assert nodes == ["n1", "n2", "n3"]
    assert slurm.calls == [["scontrol", "show", "hostnames", "n[1-3]"]]


async def test_requeued_attempt_starts_with_what_is_left_of_the_budget(tmp_path: Path) -> None:
    store = MemoryStore()
    settings = coordinator.CoordinatorSettings(command=("x",), job="t", nodes=2, max_retry=3,
                                               state_dir=tmp_path)  # fmt: skip
    assert await coordinator.budget_left(store, settings, 0) == (3, None)
    spec = JobSpec("t", "default", 2, 3)
    status = initial_status(spec)
    status = replace(status, recover_count=2)
    payload = json.dumps(status_json.to_dict(spec, status)).encode()
    await store.put("default.t", payload, expected_revision=None)
    budget, previous = await coordinator.budget_left(store, settings, 1)
    assert budget == 1 and previous is not None and previous.recover_count == 2
    assert coordinator.attempt_job("t", 1) == "t-r1"
    # Attempt 2 finds attempt 1's record first when there is one.
    spec1 = JobSpec("t-r1", "default", 2, 1)
    again = replace(initial_status(spec1), recover_count=1)
    await store.put("default.t-r1", json.dumps(status_json.to_dict(spec1, again)).encode(),
                    expected_revision=None)  # fmt: skip
    assert (await coordinator.budget_left(store, settings, 2))[0] == 0


async def test_ctl_drain_drains_the_node_in_slurm_and_undrain_resumes_it(tmp_path: Path) -> None:
    slurm = RecordingSlurm()
    platform = SlurmPlatform(
        SlurmSettings(nodes=("n1", "n2"), spares=("n3",), command=("true",), log_dir=tmp_path),
        slurm,
    )
    platform.used_nodes |= {"n1", "n2"}

    def ask(command: control.Command, node: str) -> control.ControlRequest:
        return control.ControlRequest(command, "_INBOX.x", nodes=[node], reason="bios update")

    reply = await control.handle(ask("drain", "n3"), lambda ns, job: None, lambda: [platform])
    assert reply == control.ControlReply(True, "drained n3: no pod runs there, nothing to move")
    assert slurm.calls == [commands.drain_argv("n3", "bios update")]
    assert platform.blacklist == {"n3": "drained: bios update"} and platform._spare() is None
    reply = await control.handle(ask("undrain", "n3"), lambda ns, job: None, lambda: [platform])
    assert reply.ok and slurm.calls[-1] == ["scontrol", "update", "nodename=n3", "state=resume"]
    assert platform.blacklist == {} and platform._spare() == "n3"
    reply = await control.handle(ask("drain", "n9"), lambda ns, job: None, lambda: [platform])
    assert reply == control.ControlReply(False, "unknown node 'n9' (known: n1, n2, n3)")
    assert len(slurm.calls) == 2


@pytest.fixture
async def master_store() -> AsyncIterator[tuple[str, NatsBus, KvStore]]:
    """A NATS server whose status bucket holds job t (attempt 0), as a running master's."""
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    bus = await NatsBus.connect(server.url, None, name="test")
    try:
        store = await KvStore.open(bus, STATUS_BUCKET)
        await submit_job(store, JobSpec("t", "default", 1, 3), ["n1"], "tok")
        yield server.url, bus, store
    finally:
        with contextlib.suppress(Exception):
            await bus.close()
        await asyncio.to_thread(server.stop)


def _on_master(tmp_path: Path, url: str) -> coordinator.CoordinatorSettings:
    return coordinator.CoordinatorSettings(
        command=("true",), job="t", nodes=1, max_retry=3, state_dir=tmp_path, master="h:1",
        nats_url=url,
    )  # fmt: skip


async def test_a_job_name_already_in_the_masters_store_is_refused_in_one_line(
    tmp_path: Path, master_store: tuple[str, NatsBus, KvStore]
) -> None:
    """Two allocations submitting the same --job to one running master: the second is told
    so, before any step starts (no traceback, nothing overwritten)."""
    slurm = ScriptedSlurm({})
    with pytest.raises(SystemExit, match="job t is already in the master's store"):
        await coordinator._run_on_master(_on_master(tmp_path, master_store[0]), ["n1"], 0, slurm)
    assert not any(call[0] == "srun" for call in slurm.calls)


async def test_a_requeued_attempt_stops_the_one_the_running_master_still_leads(
    tmp_path: Path, master_store: tuple[str, NatsBus, KvStore]
) -> None:
    """With --master, the lost allocation's attempt lives on in the master (nobody serves
    it): the requeued attempt asks the master to stop it, naming itself as the reason."""
    url, bus, store = master_store
    asked: list[control.ControlRequest] = []

    async def master(subject: str, payload: bytes) -> None:
        request = msgspec.json.decode(payload, type=control.ControlRequest)
        asked.append(request)
        reply = msgspec.json.encode(control.ControlReply(True, "stopped"))
        await bus.publish(request.reply_to, reply)

    await bus.subscribe(control.CONTROL_SUBJECT, master)
    await coordinator._supersede(bus, store, None, _on_master(tmp_path, url), 2)  # t is last
    assert [(r.command, r.job, r.reason) for r in asked] == [
        ("stop", "t", "requeued: attempt 2 (t-r2) took over")
    ]
