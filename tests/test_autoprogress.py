"""Progress and early crash reports for scripts that never import aegis (aegis.autoprogress).

Real interpreters with the agent's ``sitecustomize`` on their ``PYTHONPATH``; real supervisors
(cold, warm from a zygote, ``torchrun`` inside a ``bash -c`` wrapper).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from aegis import autoprogress, forking
from aegis import training as progress
from aegis.agent import ports, reaper, supervisor, warm, watchdog
from aegis.core.phases import Phase
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.wire import messages as m
from tests import agent_waits as waits
from tests import venvs
from tests.waits import async_wait_until

PYTHON = sys.executable
STEPS = str(waits.BIN / "plain_steps.py")
PLAIN_DDP = str(waits.BIN / "plain_ddp.py")


@pytest.fixture
def shared() -> Iterator[watchdog.ProgressFile]:
    made = watchdog.ProgressFile()
    yield made
    made.close()


def agent_env(shared: watchdog.ProgressFile | None, **extra: str) -> dict[str, str]:
    """What a process of the job sees (the supervisor's additions), or only the PYTHONPATH."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **extra}
    if shared is not None:
        env[progress.ENV_VAR] = shared.path
    path = autoprogress.pythonpath(env)
    assert path is not None
    env["PYTHONPATH"] = path
    return env


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def step_seen(shared: watchdog.ProgressFile) -> int | None:
    seen = shared.read()
    return None if seen is None else seen[0]


def test_pythonpath_puts_the_site_dir_first_once_and_can_be_turned_off() -> None:
    assert autoprogress.pythonpath({}) == autoprogress.SITE_DIR
    theirs = {"PYTHONPATH": f"/a:{autoprogress.SITE_DIR}:/b"}
    assert autoprogress.pythonpath(theirs) == os.pathsep.join([autoprogress.SITE_DIR, "/a", "/b"])
    assert autoprogress.pythonpath({autoprogress.OFF_VAR: "0"}) is None


@pytest.mark.parametrize(
    ("args", "extra", "expected"),
    [
        (["5"], {}, 5),
        (["4", "--optimizers", "3"], {}, 4),  # one optimizer per parameter: iterations count
        (["3"], {autoprogress.RESUME_STEP_VAR: "100"}, 103),  # the step the master resumed from
        (["6", "--progress-after", "2", "1000"], {}, 1000),  # aegis.progress takes precedence
    ],
)
def test_plain_script_reports_optimizer_steps_when_run_under_an_agent(
    shared: watchdog.ProgressFile, args: list[str], extra: dict[str, str], expected: int
) -> None:
    result = run([PYTHON, STEPS, *args], agent_env(shared, **extra))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("STARTED\n")  # torch is not imported before the script does
    assert step_seen(shared) == expected


def test_uncaught_exception_is_reported_after_the_traceback_without_an_aegis_import(
    shared: watchdog.ProgressFile,
) -> None:
    result = run([PYTHON, STEPS, "1", "--end", "raise"], agent_env(shared))
    assert result.returncode == 1
    *_, traceback_line, last = result.stderr.splitlines()
    assert traceback_line == "RuntimeError: plain script raised"
    said = progress.dying_pid(last)
    assert said is not None and said[0] == "RuntimeError"


PROBE = (
    "import sys; print(sys.excepthook is sys.__excepthook__, 'aegis' in sys.modules, "
    "getattr(sys, 'user_site_ran', False), sys.modules['sitecustomize'].__file__, "
    f"{autoprogress.SITE_DIR!r} in sys.path, 'torch' in sys.modules)"
)


def user_site(tmp_path: Path, body: str) -> str:
    (tmp_path / "sitecustomize.py").write_text(body)
    return str(tmp_path)


def test_a_process_that_is_not_under_an_agent_is_left_as_it_was(tmp_path: Path) -> None:
    env = agent_env(None)
    env["PYTHONPATH"] += os.pathsep + user_site(tmp_path, "import sys\nsys.user_site_ran = 1\n")
    result = run([PYTHON, "-c", PROBE], env)
    ours = os.path.join(autoprogress.SITE_DIR, "sitecustomize.py")
    assert result.stdout.split() == ["True", "False", "1", str(tmp_path / "sitecustomize.py"),
                                     "False", "False"], result.stderr  # fmt: skip
    result = run([PYTHON, "-c", PROBE], agent_env(None))  # no sitecustomize of the user's
    assert result.stdout.split() == ["True", "False", "False", ours, "False", "False"]


def test_the_users_sitecustomize_runs_first_under_an_agent_errors_included(
    shared: watchdog.ProgressFile, tmp_path: Path
) -> None:
    env = agent_env(shared)
    env["PYTHONPATH"] += os.pathsep + user_site(tmp_path, "import sys\nsys.user_site_ran = 1\n")
    result = run([PYTHON, "-c", PROBE], env)
    assert result.stdout.split() == ["False", "True", "1", str(tmp_path / "sitecustomize.py"),
                                     "False", "False"], result.stderr  # fmt: skip
    broken = tmp_path / "broken"
    broken.mkdir()
    env = agent_env(shared)
    env["PYTHONPATH"] += os.pathsep + user_site(broken, "raise ValueError('user site')\n")
    probe = (
        "import sys; print(sys.excepthook is sys.__excepthook__, 'sitecustomize' in sys.modules)"
    )
    result = run([PYTHON, "-c", probe], env)
    assert "Error in sitecustomize" in result.stderr and "user site" in result.stderr
    assert result.stdout.split() == ["False", "False"]  # as without us, but with the hooks


# -- under a real supervisor ------------------------------------------------------------------


@pytest.fixture
async def the_reaper() -> AsyncIterator[reaper.Reaper]:
    async with reaper.Reaper() as r:
        yield r


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_WRONLY)
    yield fd
    os.close(fd)


def make(
    argv: list[str], the_reaper: reaper.Reaper, devnull: int, prewarm: warm.PrewarmSettings | None
) -> tuple[supervisor.Supervisor, ports.RecordingReports]:
    reports = ports.RecordingReports()
    settings = supervisor.SupervisorSettings(
        grace_s=5.0, hang_timeout_s=0.0, stdout_fd=devnull, stderr_fd=devnull, prewarm=prewarm
    )
    return supervisor.Supervisor(argv, settings, the_reaper, reports), reports


@pytest.mark.timeout(240)
@pytest.mark.timing
async def test_zygote_is_made_once_a_plain_script_steps_and_its_warm_child_reports(
    the_reaper: reaper.Reaper, devnull: int
) -> None:
    # only a step can make the next zygote: the fallback after a start without one is an hour
    prewarm = warm.PrewarmSettings(prepare_after_s=3600.0, settle_s=0.0)
    sup, _ = make([PYTHON, STEPS, "3", "--end", "pause"], the_reaper, devnull, prewarm)
    async with sup:
        await sup.start()  # from the zygote made for it
        zygotes = sup.zygotes
        assert zygotes is not None and zygotes.made == 1
        await async_wait_until(lambda: sup.last_step == 3, 120, "the first child's steps")
        await async_wait_until(lambda: zygotes.made == 2, 120, "the next zygote")
        zygote = await zygotes.ready()
        assert zygote is not None and "torch" in zygote.info["modules"]
        learned = Path(zygotes.learn_path)  # written at a warm child's first step
        assert "torch.optim.optimizer" in learned.read_text().split()
        learned.unlink()
        await sup.restart()
        pid = sup.pid
        assert pid is not None and psutil.Process(pid).ppid() != os.getpid()  # warm
        await async_wait_until(lambda: sup.last_step == 3, 120, "the warm child's steps")
        await async_wait_until(learned.exists, 120, "the learned modules")


IMPORTS = """
import importlib
for name in ("aegis.autoprogress", "aegis.agent", "torch", "msgspec"):
    try:
        importlib.import_module(name)
        print(name, "yes")
    except ImportError:
        print(name, "no")
"""


@pytest.fixture(scope="module")
def foreign_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The interpreter of another environment than the agent's (a job in its own virtualenv):
    the same Python and torch, no aegis."""
    python = venvs.venv(tmp_path_factory.mktemp("foreign"), [venvs.SITE])
    said = subprocess.run([python, "-c", IMPORTS], capture_output=True, text=True, check=True,
                          env=venvs.without_pythonpath(), timeout=120).stdout.split()  # fmt: skip
    assert said[1::2] == ["no", "no", "yes", "yes"]
    return python


def test_a_job_interpreter_without_aegis_gets_the_agents_aegis_and_nothing_else(
    tmp_path: Path,
) -> None:
    """Under the agent's ``PYTHONPATH`` a bare interpreter imports the agent's aegis, and still
    none of the agent environment's other packages (its torch, its msgspec)."""
    python = venvs.venv(tmp_path / "bare")
    env = {**venvs.without_pythonpath(), "PYTHONPATH": autoprogress.pythonpath({}) or ""}
    said = subprocess.run([python, "-c", IMPORTS], capture_output=True, text=True, check=True,
                          env=env, timeout=120).stdout.split()  # fmt: skip
    assert said[1::2] == ["yes", "yes", "no", "no"]


@pytest.mark.timeout(240)
async def test_a_job_whose_interpreter_has_no_aegis_still_gets_the_hooks_and_warm_starts(
    the_reaper: reaper.Reaper, devnull: int, foreign_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent in its own environment, the job in another: its interpreter gets the agent's
    aegis (and nothing else of that environment), so steps and the dying report still come and
    the zygote still forks it (before: no step, an exit status for a reason, three zygotes that
    failed on ``from aegis import ...`` and cold starts)."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    prewarm = warm.PrewarmSettings(prepare_after_s=3600.0, settle_s=0.0)
    sup, reports = make([foreign_python, STEPS, "3", "--end", "raise"], the_reaper, devnull,
                        prewarm)  # fmt: skip
    async with sup:
        await sup.start()
        pid = sup.pid
        assert pid is not None and psutil.Process(pid).ppid() != os.getpid()  # from a zygote
        zygotes = sup.zygotes
        assert zygotes is not None and zygotes.made == 1
        async with asyncio.timeout(120):
            await reports.wait_for("dying")
        report = await sup.wait()
        assert sup.last_step == 3  # the optimizer step hook
    assert reports.dying[0].exception == "RuntimeError" and report.exit_status == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("warm_start", [False, True])
async def test_plain_script_is_reported_dying_before_it_has_exited(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path, warm_start: bool
) -> None:
    gate = tmp_path / "let-it-exit"
    prewarm = warm.PrewarmSettings(prepare_after_s=0.0, settle_s=0.0) if warm_start else None
    argv = [PYTHON, STEPS, "2", "--end", "raise", "--hold-exit", str(gate)]
    sup, reports = make(argv, the_reaper, devnull, prewarm)
    async with sup:
        await sup.start()
        pid = sup.pid
        assert pid is not None
        forked = psutil.Process(pid).ppid() != os.getpid()
        async with asyncio.timeout(120):
            await reports.wait_for("dying")
        assert not waits.gone(pid) and reports.exits == []  # still exiting (held in atexit)
        assert (reports.dying[0].pid, reports.dying[0].exception) == (pid, "RuntimeError")
        assert sup.last_step == 2
        gate.touch()
        report = await sup.wait()
    assert report.exit_status == 1 and forked is warm_start


@pytest.mark.timeout(240)
async def test_torchrun_workers_in_a_bash_wrapper_report_their_steps(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path
) -> None:
    gate = tmp_path / "rank-0-may-go-on"
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                PLAIN_DDP, "--steps", "3", "--step-time-s", "0", "--ckpt-dir", str(tmp_path),
                "--solo", "1:2", "--solo", f"0:4:{gate}"]  # fmt: skip
    # not the last command: bash forks torchrun instead of exec'ing it
    sup, _ = make(["bash", "-c", " ".join(torchrun) + "; exit $?"], the_reaper, devnull, None)
    async with sup:
        await sup.start()
        # rank 1 alone: 3 steps in step with rank 0, 2 on its own; rank 0 waits for the gate
        await async_wait_until(lambda: sup.last_step == 5, 180, "rank 1's steps")
        gate.touch()
        report = await sup.wait()
        assert report.exit_status == 0
        assert sup.last_step == 7  # rank 0's own 3 + 4


# -- end to end: aegis run ---------------------------------------------------------------------


def zygotes_idle() -> int:
    """Ready zygotes among this process's descendants (they rename themselves once ready)."""
    count = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            count += child.name() == "aegis-zygote"
    return count


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_plain_ddp_script_steps_reach_the_master_and_its_crash_is_reported_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AEGIS_LOG_LEVEL", "INFO")  # the agents say how each rank started
    gate = tmp_path / "crash-now"
    command = (PYTHON, PLAIN_DDP, "--steps", "100000", "--ckpt-every", "5",
               "--step-time-s", "0.02", "--ckpt-dir", str(tmp_path / "ckpt"),
               "--crash-at-step", "5", "--crash-rank", "1", "--crash-when", str(gate),
               "--stop-after-crash", "10")  # fmt: skip
    settings = local_run.RunSettings(
        command=command, nodes=3, spare_nodes=0, max_retry=2, job="plain",
        heartbeat_timeout_s=10.0, grace_s=3.0, log_dir=tmp_path / "logs",
    )  # fmt: skip
    steps: dict[str, list[int]] = {}

    def listen(runner: JobRunner, platform: object) -> None:
        def on_heartbeat(r: JobRunner, msg: m.Message) -> None:
            if isinstance(msg.data, m.HeartbeatData) and msg.data.step is not None:
                steps.setdefault(msg.pod, []).append(msg.data.step)

        runner.heartbeat_listeners.append(on_heartbeat)

    async def crash_once_every_pod_has_its_next_interpreter() -> None:
        # each pod's next zygote is made only once its rank has stepped (or after 60 s); the
        # first start's zygotes are nannies by the time every pod has reported a step
        await async_wait_until(
            lambda: len(steps) == 3 and zygotes_idle() == 3, 240, "3 ready zygotes"
        )
        gate.touch()

    crasher = asyncio.create_task(crash_once_every_pod_has_its_next_interpreter())
    result = await local_run.run_local(settings, observe=listen)
    await crasher
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert sorted(steps) == ["plain-0", "plain-1", "plain-2"] and all(
        max(seen) >= 5 for seen in steps.values()
    ), steps  # the heartbeats carried the optimizer steps
    events = [json.loads(line) for line in (result.log_dir / "events.jsonl").open()]
    assert not any(e.get("phase") == "Troubleshooting" for e in events)
    errors = [e for e in events if e.get("type") == "Error"]
    assert [(e["pod"], e["data"]["fault_class"]) for e in errors] == [
        ("plain-1", "python_traceback")
    ]
    said = errors[0]["data"]["reason"]  # the traceback's own last line
    assert said.startswith("uncaught RuntimeError: injected crash of rank 1 at step "), said
    assert said.endswith(" (reported as the process exits)"), said
    for pod in ("plain-0", "plain-1", "plain-2"):
        log = (result.log_dir / "pods" / f"{pod}.log").read_text()
        assert re.search(r"started \S+ as pid \d+ \(restart 1, warm\)", log), log


@pytest.mark.timeout(240)
async def test_a_warm_child_has_the_blas_pool_of_a_cold_start(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path
) -> None:
    # numpy's OpenBLAS starts threads as it loads: the zygote loads it with none (else it could
    # never fork: a cold start every time), its child gets the pool its environment asks for
    out = tmp_path / "threads"
    script = str(waits.BIN / "blas_threads.py")
    cold = subprocess.run([PYTHON, script, str(out)], check=True, timeout=120)
    assert cold.returncode == 0
    cold_threads = int(out.read_text().split()[0])
    assert cold_threads == forking.blas_threads({})
    prewarm = warm.PrewarmSettings(modules=("numpy",), prepare_after_s=3600.0, settle_s=0.0)
    sup, _ = make([PYTHON, script, str(out)], the_reaper, devnull, prewarm)
    out.unlink()
    async with sup:
        await sup.start()
        assert sup.zygotes is not None and sup.zygotes.made == 1
        await async_wait_until(out.exists, 120, "the warm child's answer")
        threads, parent = map(int, out.read_text().split())
        assert parent != os.getpid()  # forked from the zygote: warm
        assert threads == cold_threads


def test_a_save_counts_as_a_checkpoint_only_when_it_holds_training_state() -> None:
    import torch
    from torch import nn

    model = nn.Linear(2, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints = [
        model,
        optimizer,
        model.state_dict(),
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 40},
        [torch.zeros(4)],
    ]
    assert all(autoprogress.holds_state(c) for c in checkpoints)
    dumps = [
        {"loss": 0.25, "acc": torch.tensor(0.9), "names": ["a", "b"]},
        torch.tensor(1.5),
        [0.1, 0.2, 0.3],
        "text",
        None,
        # a tensor beyond the first STATE_LOOKS objects looked at (the last one first)
        [torch.zeros(2)] + [torch.tensor(float(k)) for k in range(autoprogress.STATE_LOOKS)],
    ]
    assert not any(autoprogress.holds_state(d) for d in dumps)
