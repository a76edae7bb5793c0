"""The input time (a rank slow *before* the collective): the training side measures it with a
one-shot global forward pre-hook (aegis.autoprogress), the agent reads it from the progress
file, and the master's StragglerWatch judges it beside the step ends (core/stragglers.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from aegis import autoprogress
from aegis import training as progress
from aegis.agent import watchdog
from aegis.core import stragglers
from aegis.core.model import PodName
from aegis.master.pace import StragglerWatch

PERIOD_S = 0.04


def test_input_window_is_each_pods_median_in_steps_less_the_median_pods() -> None:
    inputs = {"a": [0.004, 0.006, 0.005], "b": [0.005, 0.005, 0.004], "c": [0.025, 0.024, 0.026]}
    w = stragglers.input_window(inputs, PERIOD_S, min_samples=3)
    assert w is not None and w.period_s == PERIOD_S
    assert w.lateness == {
        "a": pytest.approx(0.0), "b": pytest.approx(0.0), "c": pytest.approx(0.5)
    }  # fmt: skip
    assert stragglers.late_in(w, stragglers.StragglerSettings()) == "c"
    # too few samples, one pod, no period: no window
    assert stragglers.input_window({"a": [0.1], "b": [0.1, 0.2]}, PERIOD_S, 2) is None
    assert stragglers.input_window({"a": [0.1]}, PERIOD_S) is None
    assert stragglers.input_window(inputs, 0.0) is None


def test_combined_scores_add_each_signals_part() -> None:
    end = [stragglers.Window({"a": 0.3, "b": 0.0}, PERIOD_S)]
    late_input = [stragglers.Window({"a": 0.0, "b": 0.5, "c": 0.1}, PERIOD_S)]
    assert stragglers.combined(end, late_input) == {
        "a": pytest.approx(0.3), "b": pytest.approx(0.5), "c": pytest.approx(0.1)
    }  # fmt: skip
    assert stragglers.combined() == {}


def feed(
    watch: StragglerWatch, pods: int, seconds: float, input_of: dict[str, float], seed: int = 1
) -> list[stragglers.Straggler | None]:
    """A synchronous job whose pods all end each step together (a rank slow before the
    collective holds them all up), beating four times a second; pod p's input time is
    ``input_of[p]`` (5 ms by default) plus noise. What the watch named after each beat."""
    rng = random.Random(seed)
    named = []
    for n in range(int(seconds * 4)):
        now = n / 4
        step = int(now / PERIOD_S)
        for i in range(pods):
            pod = f"j-{i}"
            ended = step * PERIOD_S + rng.uniform(0, 0.0005)
            took = input_of.get(pod, 0.005) + rng.uniform(-0.002, 0.002)
            watch.step_seen(1, PodName(pod), step, ended, now, now + 0.001, took)
        named.append(watch.named)
    return named


@pytest.mark.parametrize("pods", [3, 4, 8])
def test_a_pod_slow_before_the_collective_is_named_by_its_input_time_alone(pods: int) -> None:
    watch = StragglerWatch(stragglers.StragglerSettings(window_s=2.0))
    named = feed(watch, pods, 30.0, {"j-1": 0.025})  # 20 ms more: half a step
    last = named[-1]
    assert last is not None and last.pod == "j-1" and last.signal == "input", last
    assert "steps later into its forward, late in" in last.why
    # the step ends alone see nothing: every pod ends with its peers
    assert stragglers.straggler(tuple(watch.history), watch.settings) is None
    assert all(abs(v) < 0.1 for v in watch.end_scores().values()), watch.end_scores()
    assert watch.scores()["j-1"] == pytest.approx(0.5, abs=0.1)
    # it takes several windows: not named in the first ones
    assert named[: 4 * 6] == [None] * 24


def test_healthy_input_times_name_nobody_and_old_agents_send_none() -> None:
    for seed in range(10):
        watch = StragglerWatch(stragglers.StragglerSettings(window_s=2.0))
        assert set(feed(watch, 4, 30.0, {}, seed)) == {None}
        assert watch.input_history
    old = StragglerWatch(stragglers.StragglerSettings(window_s=2.0))
    for n in range(120):  # beats without an input time (an older agent): no input windows
        for i in range(3):
            old.step_seen(1, PodName(f"j-{i}"), n, n * 0.25, n * 0.25, n * 0.25 + 0.001)
    assert old.history and not old.input_history


@pytest.fixture
def shared() -> Iterator[watchdog.ProgressFile]:
    made = watchdog.ProgressFile()
    yield made
    made.close()


# A step, a pause of 50 ms (the "data loader"), a forward: what the hook measures, and that it
# is armed after a step and gone after the forward.
PROBE = """
import time, torch
from torch.nn.modules import module
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(4)).sum().backward()
opt.step()
armed = len(module._global_forward_pre_hooks)
time.sleep(0.05)
model(torch.ones(4))
print(armed, len(module._global_forward_pre_hooks))
"""


def test_the_input_time_is_measured_once_per_step_by_a_hook_that_then_leaves(
    shared: watchdog.ProgressFile,
) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), progress.ENV_VAR: shared.path}
    path = autoprogress.pythonpath(env)
    assert path is not None
    env["PYTHONPATH"] = path
    assert shared.input_s() is None  # nothing measured yet
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                            text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "0"]  # armed by the step, removed by the forward
    measured = shared.input_s()
    assert measured is not None and measured >= 0.05, measured
    seen = shared.read()
    assert seen is not None and seen[0] == 1
    shared.reset()
    assert shared.input_s() is None
