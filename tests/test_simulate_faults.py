"""The fault traces, the mapping of each cause to Aegis's action through the real core, settings."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from aegis.core.model import JobSpec
from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel
from aegis.tools.simulate import faults as flt
from aegis.tools.simulate import recovery_costs as rc
from aegis.tools.simulate import settings as sim_settings
from aegis.tools.simulate.core_driver import CoreDriver
from aegis.tools.simulate.faults import FaultKind

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "simulate" / "settings.toml"
LLAMA3 = flt.TraceSpec(flt.TraceKind.LLAMA3, nodes=2048, horizon_s=54 * flt.DAY_S)


def _driver(workers: int = 4) -> CoreDriver:
    return CoreDriver(JobSpec(job="t", namespace="default", worker_num=workers, max_retry=50))


def test_llama3_trace_has_about_419_faults_when_54_days_on_2048_nodes() -> None:
    counts = [len(flt.generate(LLAMA3, random.Random(seed))) for seed in range(10)]
    assert abs(sum(counts) / len(counts) - 419) < 25
    assert math.isclose(LLAMA3.job_mtbf_s() / 3600.0, 54 * 24 / 419, rel_tol=1e-9)


def test_llama3_rate_scales_with_nodes_when_the_job_is_smaller() -> None:
    half = flt.TraceSpec(flt.TraceKind.LLAMA3, nodes=1024, horizon_s=LLAMA3.horizon_s)
    assert math.isclose(half.job_mtbf_s(), 2 * LLAMA3.job_mtbf_s())


def test_trace_is_sorted_and_within_the_horizon_when_generated() -> None:
    trace = flt.generate(LLAMA3, random.Random(3))
    times = [fault.time_s for fault in trace]
    assert times == sorted(times)
    assert all(0 <= t < LLAMA3.horizon_s for t in times)
    assert all(0 <= fault.node < 2048 for fault in trace)


def test_exponential_trace_needs_a_positive_mtbf() -> None:
    with pytest.raises(ValueError, match="MTBF"):
        flt.TraceSpec(flt.TraceKind.EXPONENTIAL, nodes=1, horizon_s=1.0).job_mtbf_s()


def test_cause_mix_follows_llama3_table_5() -> None:
    by_name = {cause.name: cause for cause in flt.LLAMA3_CAUSES}
    assert len(by_name) == 18
    # The table's counts: they sum to its 419 interruptions; its percentages are count / 419.
    assert sum(cause.count for cause in flt.LLAMA3_CAUSES) == flt.LLAMA3_INTERRUPTIONS == 419
    for name, count, pct in (
        ("GPU HBM3 memory", 72, 17.2),
        ("software bug", 54, 12.9),
        ("GPU system processor", 17, 4.1),
        ("power supply", 3, 0.7),
    ):
        assert by_name[name].count == count
        assert round(100 * count / 419, 1) == pct
    assert by_name["faulty GPU"].count == 148  # printed as 30.1 % beside it: 35.3 % of 419
    assert by_name["software bug"].kind is FaultKind.CRASH_RESTART
    assert by_name["host maintenance"].kind is FaultKind.NODE_LOST
    assert by_name["NCCL watchdog timeouts"].kind is FaultKind.HANG_RESTART
    assert by_name["network switch/cable"].kind is FaultKind.HANG_REPLACE
    assert by_name["GPU thermal interface + sensor"].kind is FaultKind.SLOW
    assert math.isclose(sum(flt.share_by_kind().values()), 1.0)


@pytest.mark.parametrize(
    ("kind", "level", "rounds", "replaced"),
    [
        (FaultKind.CRASH_RESTART, RecoveryLevel.IN_PLACE, 1, 0),
        (FaultKind.HANG_RESTART, RecoveryLevel.IN_PLACE, 1, 0),
        (FaultKind.SLOW, RecoveryLevel.IN_PLACE, 1, 0),
        (FaultKind.CRASH_CONTAINER, RecoveryLevel.CONTAINER, 2, 1),
        (FaultKind.CRASH_REPLACE, RecoveryLevel.NODE, 2, 1),
        (FaultKind.HANG_REPLACE, RecoveryLevel.NODE, 2, 1),
        (FaultKind.NODE_LOST, RecoveryLevel.NODE, 1, 1),
    ],
)
def test_core_chooses_the_recovery_level_when_a_fault_of_each_kind_arrives(
    kind: FaultKind, level: RecoveryLevel, rounds: int, replaced: int
) -> None:
    driver = _driver()
    outcome = driver.fault(kind, 1, 10.0)
    assert (outcome.level, outcome.rounds, outcome.replaced) == (level, rounds, replaced)
    assert not outcome.failed
    assert driver.status.phase is Phase.RUN_COMMAND
    assert driver.status.recover_count == 1


@pytest.mark.parametrize("kind", [FaultKind.HANG_RESTART, FaultKind.SLOW])
def test_core_evicts_the_marked_pod_at_the_next_checkpoint_when_it_hung_or_was_slow(
    kind: FaultKind,
) -> None:
    driver = _driver()
    driver.fault(kind, 2, 10.0)
    outcome = driver.checkpoint(1, 20.0)
    assert outcome is not None
    assert outcome.level is RecoveryLevel.EVICT_SLOW
    assert outcome.replaced == 1
    assert driver.checkpoint(2, 30.0) is None  # evicted once, not again


def test_core_does_not_evict_a_replacement_when_the_hung_pod_was_already_replaced() -> None:
    driver = _driver()
    driver.fault(FaultKind.HANG_REPLACE, 2, 10.0)
    assert driver.checkpoint(1, 20.0) is None


def test_core_declares_failed_when_faults_exceed_max_retry() -> None:
    driver = CoreDriver(JobSpec(job="t", namespace="default", worker_num=3, max_retry=2))
    outcomes = [driver.fault(FaultKind.CRASH_RESTART, rank, 1.0) for rank in (0, 1)]
    assert not any(outcome.failed for outcome in outcomes)
    assert driver.fault(FaultKind.CRASH_REPLACE, 2, 2.0).failed
    assert driver.status.phase is Phase.FAILED


def test_costs_reload_from_memory_in_place_and_from_disk_after_a_node_change() -> None:
    settings = sim_settings.AegisSettings()
    in_place = rc.aegis_cost(
        FaultKind.CRASH_RESTART, _driver().fault(FaultKind.CRASH_RESTART, 0, 0), settings
    )
    assert in_place.rollback is rc.Rollback.MEMORY
    assert in_place.detection_s == settings.detect_crash_s
    assert (
        in_place.recovery_s
        == settings.troubleshoot_s + settings.in_place_restart_s + settings.load_shm_s
    )
    node = rc.aegis_cost(
        FaultKind.HANG_REPLACE, _driver().fault(FaultKind.HANG_REPLACE, 0, 0), settings
    )
    assert node.rollback is rc.Rollback.DURABLE
    assert node.detection_s == settings.detect_hang_s
    assert (
        node.recovery_s
        == 2 * settings.troubleshoot_s + settings.node_replace_s + settings.load_disk_s
    )
    baseline = rc.baseline_cost(sim_settings.BaselineSettings())
    assert (baseline.detection_s, baseline.rollback) == (600.0, rc.Rollback.DURABLE)


def test_settings_example_decodes_to_the_documented_defaults() -> None:
    assert sim_settings.load(EXAMPLE) == sim_settings.SimSettings()


def test_settings_json_overrides_one_field_when_given(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"baseline": {"detect_s": 300}}')
    settings = sim_settings.load(path)
    assert settings.baseline.detect_s == 300.0
    assert settings.aegis == sim_settings.AegisSettings()


@pytest.mark.parametrize(
    "text",
    ["[aegis]\nbogus_s = 1.0\n", "[aegis]\nload_disk_s = -1.0\n", "[aegis]\nload_disk_s = 'x'\n"],
)
def test_settings_are_rejected_when_a_key_is_unknown_negative_or_mistyped(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(sim_settings.SettingsError):
        sim_settings.load(path)
