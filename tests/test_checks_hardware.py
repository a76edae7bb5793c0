"""gpu and rdma verdicts on recorded outputs of real hardware; the real paths here (no GPU/HCA)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest

from aegis.checks import base, gpu, rdma
from tests import fake_pynvml

DATA = Path(__file__).parent / "data"


class Recorded:
    def __init__(self, snapshot: gpu.GpuSnapshot | None) -> None:
        self.snapshot = snapshot

    def read(self) -> gpu.GpuSnapshot | None:
        return self.snapshot


def recorded(name: str) -> tuple[gpu.GpuSnapshot, dict[str, object]]:
    raw = json.loads((DATA / name).read_text())
    return msgspec.convert(raw["snapshot"], gpu.GpuSnapshot), raw["expect"]


@pytest.mark.parametrize(
    "name",
    ["nvml_a100_healthy.json", "nvml_a100_uncorrected_ecc.json", "nvml_v100_retired_pending.json"],
)
async def test_gpu_verdict_matches_recording_when_judging_recorded_nvml(name: str) -> None:
    snapshot, expect = recorded(name)
    outcome = await gpu.gpu_check_with(Recorded(snapshot), base.CheckSettings())
    assert outcome.passed is expect["passed"], outcome.result
    for text in expect["contains"]:  # type: ignore[attr-defined]
        assert text in outcome.result
    assert not outcome.not_applicable


def test_gpu_fails_when_count_differs_from_expected() -> None:
    snapshot, _ = recorded("nvml_a100_healthy.json")
    outcome = gpu.judge(snapshot, require_gpu=True, expected=4)
    assert not outcome.passed and "8 GPU(s) visible, 4 expected" in outcome.result


def test_gpu_is_not_applicable_unless_required_when_no_gpu() -> None:
    assert gpu.judge(None, require_gpu=False, expected=None).not_applicable
    empty = gpu.GpuSnapshot(driver_version="535.104.05", devices=[])
    assert gpu.judge(empty, require_gpu=False, expected=None).not_applicable
    required = gpu.judge(None, require_gpu=True, expected=None)
    assert not required.passed and "must have GPUs" in required.result


async def test_gpu_real_nvml_is_not_applicable_when_node_has_no_gpu() -> None:
    if gpu.RealNvml().read() is not None:
        pytest.skip("this machine has an NVIDIA driver")
    outcome = await gpu.gpu_check(base.CheckSettings())
    assert outcome.passed and outcome.not_applicable


@pytest.mark.parametrize(
    "name",
    ["nvml_a100_healthy.json", "nvml_a100_uncorrected_ecc.json", "nvml_v100_retired_pending.json"],
)
@pytest.mark.parametrize("driver_as_bytes", [False, True])  # older nvidia-ml-py returns bytes
async def test_real_nvml_reads_what_the_recorded_gpus_reported(
    name: str, driver_as_bytes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RealNvml's calls, answered by a pynvml stand-in from the recording (unsupported readings
    raise "Not Supported"), give back exactly the recorded snapshot and its verdict."""
    raw = json.loads((DATA / name).read_text())
    fake = fake_pynvml.module(raw["snapshot"], driver_as_bytes=driver_as_bytes)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    snapshot = gpu.RealNvml(xid_wait_ms=1).read()
    assert snapshot == msgspec.convert(raw["snapshot"], gpu.GpuSnapshot)
    assert fake.calls == ["init", "shutdown"]  # type: ignore[attr-defined]
    outcome = await gpu.gpu_check_with(gpu.RealNvml(xid_wait_ms=1), base.CheckSettings())
    assert outcome.passed is raw["expect"]["passed"]


def test_real_nvml_is_none_when_the_driver_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.failing_init())
    assert gpu.RealNvml().read() is None


def fake_sysfs(root: Path, only: tuple[str, ...] | None = None) -> Path:
    files = json.loads((DATA / "rdma_mlx5.json").read_text())["files"]
    for rel, content in files.items():
        if only is None or rel.split("/")[0] in only:
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    return root


async def test_rdma_fails_naming_down_port_when_one_port_is_down(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path / "infiniband")
    ports = rdma.read_ports(root)
    assert [(p.device, p.port, p.state, p.phys_state) for p in ports] == [
        ("mlx5_0", 1, "ACTIVE", "LinkUp"),
        ("mlx5_1", 1, "DOWN", "Disabled"),
        ("mlx5_2", 1, "ACTIVE", "LinkUp"),
    ]
    outcome = await rdma.rdma_check(base.CheckSettings(rdma_root=root, expect_rdma=True))
    assert not outcome.passed
    assert outcome.result == "1 of 3 RDMA port(s) not active: mlx5_1/1 DOWN/Disabled"


async def test_rdma_passes_when_all_ports_active(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path / "infiniband", only=("mlx5_0", "mlx5_2"))
    outcome = await rdma.rdma_check(base.CheckSettings(rdma_root=root))
    assert outcome.passed, outcome.result
    assert "2 RDMA device(s), 2 port(s) ACTIVE/LinkUp" in outcome.result


async def test_rdma_not_applicable_unless_expected_when_no_device(tmp_path: Path) -> None:
    missing = base.CheckSettings(rdma_root=tmp_path / "none")
    assert (await rdma.rdma_check(missing)).not_applicable
    expected = base.CheckSettings(rdma_root=tmp_path / "none", expect_rdma=True)
    assert not (await rdma.rdma_check(expected)).passed
    real = await rdma.rdma_check(base.CheckSettings())
    if Path("/sys/class/infiniband").is_dir():
        pytest.skip("this machine has RDMA devices")
    assert real.not_applicable
