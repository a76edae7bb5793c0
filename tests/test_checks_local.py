"""io, runtime, hang, budgets and the environment report, on real resources."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aegis.checks import base, env, group, local, suites
from aegis.core.recovery import CheckType


def mount_tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir()
    argv = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root/CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "full", "size=1m")


@pytest.fixture
def readonly_fs(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "ro", "ro,size=1m")


async def test_io_passes_with_rate_when_directory_is_healthy(tmp_path: Path) -> None:
    outcome = await local.io_check(base.CheckSettings(scratch_dir=tmp_path / "ckpt", io_size_mb=2))
    assert outcome.passed, outcome.result
    assert "MB/s write+fsync+read of 2 MB" in outcome.result
    assert not list((tmp_path / "ckpt").iterdir())


async def test_io_fails_no_space_when_filesystem_is_full(full_fs: Path) -> None:
    outcome = await local.io_check(base.CheckSettings(scratch_dir=full_fs, io_size_mb=4))
    assert not outcome.passed
    assert "no space left (ENOSPC)" in outcome.result
    assert not list(full_fs.iterdir())  # the partial file is removed


async def test_io_fails_read_only_when_mount_is_read_only(readonly_fs: Path) -> None:
    outcome = await local.io_check(base.CheckSettings(scratch_dir=readonly_fs, io_size_mb=1))
    assert not outcome.passed
    assert "read-only file system (EROFS)" in outcome.result


async def test_io_fails_below_floor_when_rate_is_under_floor(tmp_path: Path) -> None:
    settings = base.CheckSettings(scratch_dir=tmp_path, io_size_mb=1, io_floor_mb_s=1e12)
    outcome = await local.io_check(settings)
    assert not outcome.passed and "below the floor" in outcome.result


def test_io_fails_naming_the_megabyte_when_the_device_returns_other_bytes(tmp_path: Path) -> None:
    """The file is really written and fsynced; the reader flips one byte of MB 2 on the way
    back, as a failing device or controller would."""

    def corrupting(path: Path) -> io.BytesIO:
        data = bytearray(path.read_bytes())
        data[2 * 1024 * 1024 + 17] ^= 0xFF
        return io.BytesIO(bytes(data))

    outcome = local._io(tmp_path, 4, 0.0, read_back=corrupting)
    assert not outcome.passed
    assert outcome.result == f"read back differs at MB 2 in {tmp_path}"
    assert not list(tmp_path.glob(".aegis-io-check-*"))  # the probe file is removed anyway


def test_runtime_fails_with_the_reason_when_torch_does_not_import(tmp_path: Path) -> None:
    """A broken install (torch that raises on import, as with a missing CUDA library) seen by
    ``aegis check runtime`` in its own process: failed, with the import error as the reason."""
    broken = tmp_path / "site" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise ImportError("libcudart.so.12: cannot open shared object file")\n'
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-m", "aegis", "check", "runtime", "--json"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    assert result["passed"] is False
    assert result["result"] == (
        "torch does not import: ImportError: libcudart.so.12: cannot open shared object file"
    )


async def test_run_one_fails_with_timeout_when_check_overruns_budget() -> None:
    async def stuck(settings: base.CheckSettings) -> base.Outcome:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    settings = base.CheckSettings(budgets_s={CheckType.IO: 0.05})
    result = await base.run_one(CheckType.IO, stuck, settings)
    assert not result.passed and result.result.startswith("timeout")


async def test_run_one_fails_injected_when_check_is_in_inject() -> None:
    settings = base.CheckSettings(inject=frozenset({"hang"}))
    result = await base.run_one(CheckType.HANG, local.hang_check, settings)
    assert not result.passed and result.result == base.INJECTED


async def test_runtime_reports_environment_and_checks_cuda_expectation() -> None:
    outcome = await group.runtime_check(base.CheckSettings())
    assert outcome.passed, outcome.result
    report = env.parse_report(outcome.result)
    assert (
        report is not None and report.torch.startswith("2.13") and report.python.startswith("3.11")
    )
    assert report == env.environment_report()
    failed = await group.runtime_check(base.CheckSettings(require_gpu=True))
    assert not failed.passed and failed.result.startswith("CUDA not available, expected")
    assert env.parse_report(failed.result) == report


async def test_hang_fails_when_watchdog_says_hung() -> None:
    assert (await local.hang_check(base.CheckSettings())).passed
    hung = await local.hang_check(base.CheckSettings(hung=True))
    assert not hung.passed and "no progress" in hung.result


def test_multiple_versions_names_fields_and_pods_when_reports_differ() -> None:
    same = env.EnvReport(python="3.11.7", torch="2.13.0", cuda="12.4", nccl="2.21.5")
    other = env.EnvReport(python="3.11.7", torch="2.12.1", cuda="12.4", nccl="2.20.3")
    assert env.multiple_versions({"pod-0": same, "pod-1": same}) is None
    verdict = env.multiple_versions({"pod-0": same, "pod-1": other, "pod-2": same})
    assert verdict == (
        "multiple versions: torch 2.12.1 (pod-1) / 2.13.0 (pod-0, pod-2); "
        "nccl 2.20.3 (pod-1) / 2.21.5 (pod-0, pod-2)"
    )
    assert env.parse_report(env.format_report(other)) == other
    assert env.parse_report("timeout after 10 s") is None


async def test_troubleshoot_runs_local_checks_only_when_no_group(tmp_path: Path) -> None:
    results = await suites.troubleshoot(base.CheckSettings(scratch_dir=tmp_path, io_size_mb=1))
    assert [r.check_type for r in results] == [
        CheckType.IO, CheckType.GPU, CheckType.RUNTIME, CheckType.RDMA, CheckType.HANG
    ]  # fmt: skip
    assert all(r.passed for r in results), results
    by_type = {r.check_type: r for r in results}
    assert by_type[CheckType.GPU].not_applicable and by_type[CheckType.RDMA].not_applicable
    boot = await suites.bootcheck(base.CheckSettings())
    assert [r.check_type for r in boot] == [CheckType.RUNTIME]
