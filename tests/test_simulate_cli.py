"""``aegis simulate`` on the command line: output, JSON, usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aegis.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "simulate" / "settings.toml"


def test_simulate_prints_both_policies_when_run_at_16384_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["simulate", "--days", "2", "--seed", "3", "--settings", str(EXAMPLE)])
    out = capsys.readouterr().out
    assert code == 0
    assert "16,384 GPUs (2,048 nodes x 8)" in out
    assert "restart-from-checkpoint" in out
    side_by_side = out[out.index("side by side") :].splitlines()
    policies = [line.split()[0] for line in side_by_side[1:3]]
    assert policies == ["restart-from-checkpoint", "aegis"]
    assert all(line.rstrip().endswith("%") for line in side_by_side[1:3])
    assert ">90%" in out
    assert ">=97%" in out
    for cause in ("detection", "recovery", "rollback", "checkpoint"):
        assert cause in out
    assert "auto" in out


def test_simulate_json_reports_ratio_lost_time_and_levels_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--gpus", "64", "--days", "5", "--trace", "exponential", "--mtbf-h", "6"]
    code = main([*argv, "--ckpt-interval", "30", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0
    assert record["ckpt_interval_min"] == 30.0
    assert record["ckpt_interval_auto"] is False
    assert 0.0 < record["effective_training_time_ratio"] < 1.0
    lost = sum(record["lost_h"].values())
    assert abs(lost + record["useful_h"] - record["wall_h"]) < 1e-6
    assert sum(record["faults_by_cause"].values()) == record["faults"]
    assert record["job_failed"] is False
    assert "restart-from-checkpoint" in record["compare"]


def test_simulate_is_reproducible_when_the_seed_is_the_same(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--gpus", "256", "--days", "20", "--trace", "exponential", "--mtbf-h"]
    records = []
    for _ in range(2):
        assert main([*argv, "4", "--seed", "9", "--json", "--no-compare"]) == 0
        record = json.loads(capsys.readouterr().out)
        record.pop("runtime_s")
        records.append(record)
    assert records[0] == records[1]


def test_simulate_reports_failed_when_max_retry_is_small(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--gpus", "64", "--days", "3", "--trace", "exponential", "--mtbf-h", "2"]
    assert main([*argv, "--max-retry", "2", "--no-compare"]) == 0
    assert "would have FAILED" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--trace", "exponential"],
        ["simulate", "--mtbf-h", "3"],
        ["simulate", "--ckpt-interval", "often"],
        ["simulate", "--ckpt-interval", "0"],
        ["simulate", "--policy", "pray"],
    ],
)
def test_simulate_exits_2_when_usage_is_wrong(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "aegis: error:" in capsys.readouterr().err


def test_simulate_exits_2_when_the_settings_file_is_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[aegis]\nnope = 1\n")
    assert main(["simulate", "--days", "1", "--settings", str(path)]) == 2
    assert "aegis: error:" in capsys.readouterr().err
