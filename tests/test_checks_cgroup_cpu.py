"""allreduce_perf counts the time a pod's CPU limit held it back (checks/cgroup_cpu.py): the
kernel puts a throttled thread's wait in its run delay, which the compute figure leaves out as
load, so a pod capped at a fifth of a CPU rated at full speed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aegis.checks import cgroup_cpu

HYBRID_CGROUP = """9:name=systemd:/
4:memory:/process_api/daa67ca1
2:cpuacct:/
1:cpu:/jobs/pod-7
0::/
"""
HYBRID_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# a container with its own cgroup namespace: its cgroup is the mount's root
CONTAINER_CGROUP = "0::/\n"
CONTAINER_MOUNTS = "1208 1190 0:30 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw,nsdelegate\n"
# a host's view of a Kubernetes container two levels below the pod's cgroup
NESTED_CGROUP = "0::/kubepods.slice/pod-a/cri-b\n"
NESTED_MOUNTS = "25 1 0:22 / /sys/fs/cgroup rw shared:4 - cgroup2 cgroup2 rw\n"


def test_the_cpu_stat_of_the_process_cgroup_and_of_every_one_above_it_is_read() -> None:
    assert cgroup_cpu.stat_files(HYBRID_CGROUP, HYBRID_MOUNTS) == [
        Path("/sys/fs/cgroup/cpu/jobs/pod-7/cpu.stat"),
        Path("/sys/fs/cgroup/cpu/jobs/cpu.stat"),
        Path("/sys/fs/cgroup/cpu/cpu.stat"),
    ]
    assert cgroup_cpu.stat_files(CONTAINER_CGROUP, CONTAINER_MOUNTS) == [
        Path("/sys/fs/cgroup/cpu.stat")
    ]
    assert cgroup_cpu.stat_files(NESTED_CGROUP, NESTED_MOUNTS) == [
        Path("/sys/fs/cgroup/kubepods.slice/pod-a/cri-b/cpu.stat"),
        Path("/sys/fs/cgroup/kubepods.slice/pod-a/cpu.stat"),
        Path("/sys/fs/cgroup/kubepods.slice/cpu.stat"),
        Path("/sys/fs/cgroup/cpu.stat"),
    ]


def test_no_cpu_hierarchy_or_a_cgroup_outside_the_mount_reads_nothing() -> None:
    assert cgroup_cpu.stat_files("", HYBRID_MOUNTS) == []
    assert cgroup_cpu.stat_files("4:memory:/a\n", HYBRID_MOUNTS) == []
    assert cgroup_cpu.stat_files("1:cpu:/a\n", "garbage\n31 23 - x\n") == []
    mount_of_b = "32 31 0:29 /b /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    assert cgroup_cpu.stat_files("1:cpu:/a/c\n", mount_of_b) == []


def test_throttled_time_is_summed_over_both_formats_and_unreadable_files_count_nothing(
    tmp_path: Path,
) -> None:
    v1, v2, bad = tmp_path / "v1", tmp_path / "v2", tmp_path / "bad"
    v1.write_text("nr_periods 29\nnr_throttled 26\nthrottled_time 2051543566\n")
    v2.write_text("usage_usec 9\nthrottled_usec 500000\nnr_bursts 0\n")
    bad.write_text("throttled_time lots\nthrottled_usec\n")
    got = cgroup_cpu.throttled_s([v1, v2, bad, tmp_path / "missing"])
    assert got == pytest.approx(2.551543566)


def test_a_wait_for_a_cpu_is_left_out_and_a_wait_for_the_limit_counts() -> None:
    assert cgroup_cpu.busy_s(2.0, 1.6, 0.0) == pytest.approx(0.4)  # load: left out
    assert cgroup_cpu.busy_s(2.0, 1.6, 1.6) == pytest.approx(2.0)  # the limit: counted
    assert cgroup_cpu.busy_s(2.0, 1.6, 1.0) == pytest.approx(1.4)  # both
    assert cgroup_cpu.busy_s(2.0, 0.1, 0.9) == pytest.approx(2.0)  # (an ancestor's, others')
    assert cgroup_cpu.busy_s(2.0, 2.0, 0.0) == pytest.approx(0.1)  # at least 5 %


@contextlib.contextmanager
def capped_cgroup(share: float) -> Iterator[Path]:
    """A new cgroup allowed ``share`` of one CPU (v1 cpu controller or v2 ``cpu.max``); yields
    its ``cgroup.procs``."""
    name = f"aegis-test-{uuid.uuid4().hex[:8]}"
    period = 100_000
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists():
        where, limit, value = v1 / name, "cpu.cfs_quota_us", str(int(share * period))
    elif "cpu" in _read(v2 / "cgroup.subtree_control").split():
        where, limit, value = v2 / name, "cpu.max", f"{int(share * period)} {period}"
    else:
        pytest.skip("no cgroup cpu controller to cap a process with")
    try:
        where.mkdir()
    except OSError as exc:  # a read-only /sys/fs/cgroup (a container)
        pytest.skip(f"cannot make a cgroup here: {exc}")
    try:
        (where / limit).write_text(value)
        yield where / "cgroup.procs"
    finally:
        where.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


CHILD = """
import os, sys
import torch
from aegis.checks import perf
torch.set_num_threads(1)
if sys.argv[1]:
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
print(perf._compute(torch, 128, 1.2, 0.3))
"""


def figure(procs: str) -> float:
    """One process's compute figure (GFLOP/s of its best 0.3-s window in 1.2 s), measured once
    it joined the cgroup whose ``cgroup.procs`` is ``procs`` ("": where it is)."""
    command = [sys.executable, "-c", CHILD, procs]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip())


@pytest.mark.skipif(os.geteuid() != 0, reason="making a cgroup needs root")
def test_a_pod_held_to_a_fifth_of_a_cpu_by_its_limit_rates_slow_against_a_free_one() -> None:
    with capped_cgroup(0.2) as procs:
        capped = figure(str(procs))
    free = figure("")
    assert capped / free < 0.6, (capped, free)  # 0.2-0.3 here; 0.9-1.1 before
