"""A job's check configuration (``AegisJob.spec.checks`` -> ``AEGIS_CHECKS`` -> the agent):
parsed strictly, applied to troubleshooting (which checks, their budgets), refused in one line,
and followed by real agents in a real run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aegis.checks import config, suites
from aegis.checks.base import CheckSettings
from aegis.core.phases import Phase
from aegis.core.recovery import CheckType
from aegis.platforms import local_run
from tests import agent_waits as waits

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"


def test_the_configuration_parses_names_and_budgets() -> None:
    got = config.from_env({config.ENV: '{"enabled": ["io", "hang"], "budgets_s": {"io": 60}}'})
    assert got.enabled == {CheckType.IO, CheckType.HANG}
    assert got.budgets_s == {CheckType.IO: 60.0}
    assert config.from_env({}) == config.ChecksConfig()  # absent: every check, default budgets


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("{nope", "AEGIS_CHECKS is not JSON"),
        ("[]", "AEGIS_CHECKS: expected an object, got list"),
        (
            '{"enabled": ["io", "disk"]}',
            "AEGIS_CHECKS: enabled: unknown check 'disk' (one of io, gpu,",
        ),
        ('{"enabled": "io"}', "AEGIS_CHECKS: enabled: expected a list"),
        ('{"enabled": []}', "AEGIS_CHECKS: enabled: name at least one check"),
        (
            '{"budgets_s": {"gpu": -1}}',
            "AEGIS_CHECKS: budgets_s.gpu: expected seconds above 0, got -1",
        ),
        (
            '{"budgets_s": {"gpu": true}}',
            "AEGIS_CHECKS: budgets_s.gpu: expected seconds above 0, got True",
        ),
        ('{"budget": {}}', "AEGIS_CHECKS: unknown field(s): budget"),
    ],
)
def test_a_bad_configuration_says_what_is_wrong(raw: str, reason: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(reason)):
        config.from_env({config.ENV: raw})


async def test_troubleshooting_runs_only_the_enabled_checks(tmp_path: Path) -> None:
    settings = CheckSettings(
        scratch_dir=tmp_path, enabled=frozenset({CheckType.IO, CheckType.HANG})
    )
    results = await suites.troubleshoot(settings)
    assert [r.check_type for r in results] == [CheckType.IO, CheckType.HANG]
    assert all(r.passed for r in results)
    boot = await suites.bootcheck(settings)  # bootcheck keeps its own two checks
    assert [r.check_type for r in boot] == [CheckType.RUNTIME]  # no group: no collective


async def test_a_configured_budget_is_the_one_a_check_is_held_to(tmp_path: Path) -> None:
    settings = CheckSettings(
        scratch_dir=tmp_path,
        enabled=frozenset({CheckType.IO}),
        budgets_s={CheckType.IO: 0.000_001},
        io_size_mb=64,
    )
    [result] = await suites.troubleshoot(settings)
    assert not result.passed and result.timed_out
    assert result.result == "timeout after 1e-06 s"


def test_the_agent_refuses_a_bad_configuration_in_one_line_and_exit_2(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    env = {**os.environ, config.ENV: '{"enabled": ["disk"]}'}
    proc = subprocess.run(
        [*waits.AGENT, "--master", "127.0.0.1:1", "--job", "j", "--pod", "j-0",
         "--token-file", str(token), "--", "true"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aegis agent: error: AEGIS_CHECKS: enabled: ")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_real_agents_run_only_the_configured_checks_when_troubleshooting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash starts troubleshooting; every pod answers with exactly the enabled checks."""
    enabled = ["io", "runtime", "allreduce_connect", "hang"]
    monkeypatch.setenv(config.ENV, json.dumps({"enabled": enabled, "budgets_s": {"io": 20}}))
    settings = local_run.RunSettings(
        command=(sys.executable, str(TRAIN), "--steps", "6", "--ckpt-every", "2",
                 "--ckpt-dir", str(tmp_path / "ckpt"), "--exit-at-step", "3", "--exit-rank", "1"),
        nodes=2, spare_nodes=0, max_retry=2, job="cfg", grace_s=2.0, log_dir=tmp_path / "logs",
    )  # fmt: skip
    result = await local_run.run_local(settings)
    assert result.status.phase is Phase.SUCCEED and result.status.recover_count == 1
    answers = [
        record["data"]["response"]["results"]
        for record in map(json.loads, (result.log_dir / "events.jsonl").open())
        if record.get("phase") == "Troubleshooting"
        and record.get("data", {}).get("kind") == "checks"
    ]
    assert len(answers) == 2  # one per pod
    for results in answers:
        assert [r["check_type"] for r in results] == enabled
