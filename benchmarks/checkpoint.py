"""Checkpoint stall and restore, side by side in one run (DESIGN section 7).

Usage: python benchmarks/checkpoint.py [--size-mb 1024] [--dir /tmp/aegis-ckpt-bench]

Training stall = how long the training loop is blocked by one save of the same state to the same
disk directory:
- torch.save:   ``torch.save(state, file)`` (page cache; no fsync) and the same followed by fsync;
- dcp async:    ``torch.distributed.checkpoint.async_save`` (world of 1, gloo) until it returns,
                with DCP's ``FileSystemWriter`` and with ``aegis.checkpoint.dcp.Writer``;
- aegis:        ``aegis.checkpoint`` ``Saver.save`` (copy into shared memory, hand-off to the
                saver daemon which persists, checksums, fsyncs and commits in the background).
Each is measured cold (first save) and steady (a later save, as in a training loop). Restore =
time to get the state back in a fresh reader: aegis from shared memory (after an in-place restart)
vs aegis from disk vs torch.load, with the page cache dropped when allowed (root) and warm; for
DCP, ``dcp.load`` into allocated tensors with ``aegis.checkpoint.dcp.Reader`` (shared memory, and
disk) vs DCP's ``FileSystemReader`` (page cache dropped, or evicted with fadvise, and warm).
Ratios are printed against torch.save's stall, one memcpy of the state and the disk restores,
measured in this run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aegis.checkpoint import api, layout, nested, process
from aegis.spawn.ports import free_port


def make_state(size_mb: int) -> dict[str, Any]:
    """Model-like state: weights + two Adam moments, tensors of 1-16 MB, plus small values."""
    torch.manual_seed(0)
    n = size_mb * 262144 // 3  # float32 elements per part (weights, exp_avg, exp_avg_sq)
    sizes, left, k = [], n, 0
    while left > 0:
        part = min(left, (1 + k % 4) * 1048576)
        sizes.append(part)
        left -= part
        k += 1
    weights = {f"layer{i}.weight": torch.randn(s) for i, s in enumerate(sizes)}
    moments = {
        i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(s), "exp_avg_sq": torch.rand(s)}
        for i, s in enumerate(sizes)
    }
    optimizer = {
        "state": moments,
        "param_groups": [{"lr": 1e-3, "params": list(range(len(sizes)))}],
    }
    return {"model": weights, "optimizer": optimizer, "step": 100}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def bench_torch_save(state: dict[str, Any], where: Path) -> dict[str, float]:
    path = where / "torch.pt"
    cold, _ = timed(lambda: torch.save(state, path))
    steady, _ = timed(lambda: torch.save(state, path))

    def durable() -> None:
        torch.save(state, path)
        with path.open("rb+") as f:
            os.fsync(f.fileno())

    fsynced, _ = timed(durable)
    return {"cold": cold, "steady": steady, "fsync": fsynced}


def bench_memcpy(state: dict[str, Any]) -> float:
    """One copy of every tensor of the state into allocated (touched) tensors: the baseline,
    the fastest of 3 with torch's threads and 3 with one (on a shared machine a parallel copy_
    can be slower than a single thread's: the baseline is the best this machine did)."""
    tensors = [t for t in nested.leaves(state) if isinstance(t, torch.Tensor)]
    targets = [torch.zeros_like(t) for t in tensors]

    def copy() -> None:
        for target, t in zip(targets, tensors, strict=True):
            target.copy_(t)

    threads = torch.get_num_threads()
    best = min(timed(copy)[0] for _ in range(3))
    torch.set_num_threads(1)
    try:
        return min(best, *(timed(copy)[0] for _ in range(3)))
    finally:
        torch.set_num_threads(threads)


def allocated_like(state: Any) -> Any:
    """A template to load into: tensors of the same shapes, allocated and touched."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: allocated_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [allocated_like(v) for v in state]
    return state


def evict(where: Path) -> bool:
    """Take ``where``'s files out of the page cache: drop_caches as root, else fadvise."""
    if drop_caches():
        return True
    for path in where.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return False


def bench_dcp(state: dict[str, Any], where: Path, shm: Path) -> dict[str, float] | str:
    """DCP figures (DCP's filesystem writer and reader vs Aegis's), or why they could not run."""
    try:
        return _bench_dcp(state, where, shm)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _bench_dcp(state: dict[str, Any], where: Path, shm: Path) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import async_save

    from aegis.checkpoint.dcp import reader, writer

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    out: dict[str, float] = {}
    env = {"AEGIS_CKPT_SHM": str(shm), "AEGIS_DCP_DIR": str(where / "aegis-dcp")}
    settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=where / "aegis-dcp-pod")
    daemon = subprocess.Popen(settings.argv())
    template = allocated_like(state)
    try:
        for step in (1, 2, 3, 4):
            fs = FileSystemWriter(where / f"dcp-fs-{step}")
            stall, future = timed(functools.partial(async_save, state, storage_writer=fs))
            done, _ = timed(future.result)
            out[f"fs{step}"], out[f"fs{step}_durable"] = stall, stall + done
        for step in (1, 2, 3, 4, 5):
            ours = writer.Writer(environ=env)
            stall, future = timed(functools.partial(async_save, state, storage_writer=ours))
            done, _ = timed(functools.partial(wait_saved, future, shm, step))
            out[f"aegis{step}"], out[f"aegis{step}_durable"] = stall, stall + done
        for name in ("shm_1", "shm_2", "shm_3"):
            out[name], _ = timed(lambda: load(template, storage_reader=reader.Reader(environ=env)))
        out["fs_warm"], _ = timed(lambda: load(
            template, storage_reader=FileSystemReader(where / "dcp-fs-4")))  # fmt: skip
        out["dropped"] = float(evict(where))
        out["fs_cold"], _ = timed(lambda: load(
            template, storage_reader=FileSystemReader(where / "dcp-fs-4")))  # fmt: skip
        no_shm = {**env, "AEGIS_CKPT_SHM": str(shm / "absent")}
        evict(where)
        out["aegis_disk_cold"], _ = timed(lambda: load(
            template, storage_reader=reader.Reader(environ=no_shm)))  # fmt: skip
    finally:
        daemon.kill()
        daemon.wait()
        dist.destroy_process_group()
    out["memcpy"] = bench_memcpy(state)  # again, after: the best of both is the baseline
    out["fs_cold_stall"] = out["fs1"]
    out["fs_steady"] = min(out[f"fs{s}"] for s in (2, 3, 4))
    out["fs_steady_durable"] = min(out[f"fs{s}_durable"] for s in (2, 3, 4))
    out["aegis_cold"] = out["aegis1"]  # both buffers are new in saves 1 and 2
    out["aegis_steady"] = min(out[f"aegis{s}"] for s in (3, 4, 5))
    out["aegis_steady_durable"] = min(out[f"aegis{s}_durable"] for s in (3, 4, 5))
    out["shm"] = min(out["shm_1"], out["shm_2"], out["shm_3"])
    return out


def wait_saved(future: Any, shm: Path, step: int) -> None:
    """Until the async save's ``future`` is done, then until the daemon committed ``step``."""
    future.result()
    wait_marker(shm, step)


def wait_marker(shm: Path, step: int) -> None:
    while not layout.committed_marker(shm, step).exists():
        time.sleep(0.002)


def bench_aegis(state: dict[str, Any], shm: Path, ckpt: Path) -> dict[str, float]:
    settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=ckpt)
    daemon = subprocess.Popen(settings.argv())
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
    out: dict[str, float] = {}
    try:
        for step in (1, 2, 3, 4):
            stall, _ = timed(functools.partial(saver.save, step, state))
            committed, _ = timed(functools.partial(wait_commit, saver, step))
            out[f"save{step}"], out[f"save{step}_durable"] = stall, stall + committed
    finally:
        daemon.kill()
        daemon.wait()
    out["cold"], out["steady"] = out["save1"], min(out["save3"], out["save4"])
    out["steady_durable"] = min(out["save3_durable"], out["save4_durable"])
    return out


def wait_commit(saver: api.Saver, step: int) -> None:
    while step not in saver.committed_steps():
        time.sleep(0.002)


def bench_restore(
    shm: Path, ckpt: Path, torch_file: Path, cold: bool, template: dict[str, Any]
) -> dict[str, float]:
    out: dict[str, float] = {}
    fresh = api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt)
    out["shm"], got = timed(lambda: api.Saver(fresh).load_latest())
    assert got is not None and got[0] == 4
    del got
    out["shm_template"], got = timed(lambda: api.Saver(fresh).load_latest(template))
    assert got is not None and got[0] == 4
    del got
    no_shm = api.SaverSettings(shm_dir=shm / "absent", ckpt_dir=ckpt)
    if cold:
        drop_caches()
    out["aegis_disk"], got = timed(lambda: api.Saver(no_shm).load_latest())
    assert got is not None and got[0] == 4
    if cold:
        drop_caches()
    out["torch_load"], _ = timed(lambda: torch.load(torch_file, weights_only=True))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/aegis-ckpt-bench"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    where = args.dir
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    shm = Path("/dev/shm") / f"aegis-bench-{os.getpid()}"
    state = make_state(args.size_mb)
    total = sum(e.nbytes for e in _entries(state))
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; nproc {os.cpu_count()}, "
          f"{platform.machine()}, torch {torch.__version__}; "
          f"state {total / 1e6:.0f} MB; disk {where}")  # fmt: skip
    try:
        ts = bench_torch_save(state, where)
        memcpy = bench_memcpy(state)
        dc = bench_dcp(state, where, Path(f"{shm}-dcp"))
        ae = bench_aegis(state, shm, where / "aegis")
        cold = drop_caches()
        restore_cold = bench_restore(shm, where / "aegis", where / "torch.pt", True, state)
        restore_warm = bench_restore(shm, where / "aegis", where / "torch.pt", False, state)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(f"{shm}-dcp", ignore_errors=True)
    report(ts, dc, ae, restore_cold, restore_warm, cold)
    report_dcp(dc, memcpy)
    shutil.rmtree(where, ignore_errors=True)
    return 0


def _entries(state: dict[str, Any]) -> list[layout.TensorEntry]:
    tensors = [t for t in nested.leaves(state) if isinstance(t, torch.Tensor)]
    return [layout.TensorEntry("", (), 0, t.numel() * t.element_size()) for t in tensors]


def report(ts: dict[str, float], dc: dict[str, float] | str, ae: dict[str, float],
           rc: dict[str, float], rw: dict[str, float], cold: bool) -> None:  # fmt: skip
    print("| stall of one save (s) | cold (1st save) | steady | until durable (steady) |")
    print("|---|---|---|---|")
    print(f"| torch.save | {ts['cold']:.3f} | {ts['steady']:.3f} | {ts['fsync']:.3f} (+fsync) |")
    if isinstance(dc, str):
        print(f"| dcp.async_save | n/a | n/a | n/a ({dc}) |")
    else:
        print(f"| dcp.async_save (FileSystemWriter) | {dc['fs_cold_stall']:.3f} | "
              f"{dc['fs_steady']:.3f} | {dc['fs_steady_durable']:.3f} |")  # fmt: skip
    print(f"| aegis.checkpoint.save | {ae['cold']:.3f} | {ae['steady']:.3f} | "
          f"{ae['steady_durable']:.3f} (daemon: checksums, fsync, commit) |")  # fmt: skip
    print(f"aegis stall / torch.save stall: steady {ae['steady'] / ts['steady']:.3f}, "
          f"cold {ae['cold'] / ts['cold']:.3f}; "
          f"vs torch.save+fsync {ae['steady'] / ts['fsync']:.3f}")  # fmt: skip
    if not isinstance(dc, str):
        print(f"aegis stall / dcp.async_save stall (steady): {ae['steady'] / dc['fs_steady']:.3f}")
    label = "page cache dropped" if cold else "page cache NOT dropped (no permission)"
    print(f"| restore (s) | {label} | page cache warm |")
    print("|---|---|---|")
    for key, name in (("shm", "aegis, shared memory"),
                      ("shm_template", "aegis, shared memory into allocated tensors"),
                      ("aegis_disk", "aegis, disk"),
                      ("torch_load", "torch.load")):  # fmt: skip
        print(f"| {name} | {rc[key]:.3f} | {rw[key]:.3f} |")
    print(f"into allocated tensors: aegis disk {rc['aegis_disk'] / rc['shm_template']:.1f}x, "
          f"torch.load {rc['torch_load'] / rc['shm_template']:.1f}x slower than shm")  # fmt: skip
    print(f"disk/shm restore speed-up: aegis disk {rc['aegis_disk'] / rc['shm']:.1f}x, "
          f"torch.load {rc['torch_load'] / rc['shm']:.1f}x "
          f"(warm: {rw['aegis_disk'] / rw['shm']:.1f}x, "
          f"{rw['torch_load'] / rw['shm']:.1f}x)")  # fmt: skip


def report_dcp(dc: dict[str, float] | str, memcpy: float) -> None:
    """The DCP path; steady figures are the best of the later saves (and restores), the memcpy
    the best of 3 before and 3 after, so that a noisy machine does not make one side look bad."""
    if not isinstance(dc, str):
        memcpy = min(memcpy, dc["memcpy"])
    print(f"one memcpy of the state (baseline): {memcpy:.3f} s")
    if isinstance(dc, str):
        print(f"DCP path: n/a ({dc})")
        return
    print("| dcp.async_save, stall (s) | cold (1st save) | steady | until durable (steady) |")
    print("|---|---|---|---|")
    print(f"| DCP FileSystemWriter | {dc['fs_cold_stall']:.3f} | {dc['fs_steady']:.3f} | "
          f"{dc['fs_steady_durable']:.3f} |")  # fmt: skip
    print(f"| aegis.checkpoint.dcp.Writer | {dc['aegis_cold']:.3f} | {dc['aegis_steady']:.3f} | "
          f"{dc['aegis_steady_durable']:.3f} (daemon: DCP files, fsync, commit) |")  # fmt: skip
    cache = "page cache dropped" if dc["dropped"] else "page cache evicted (fadvise)"
    print(f"| dcp.load into allocated tensors (s) | time | ({cache} for disk reads) |")
    print("|---|---|---|")
    print(f"| aegis Reader, shared memory | {dc['shm']:.3f} | |")
    print(f"| aegis Reader, disk, cold | {dc['aegis_disk_cold']:.3f} | |")
    print(f"| DCP FileSystemReader, cold | {dc['fs_cold']:.3f} | |")
    print(f"| DCP FileSystemReader, warm | {dc['fs_warm']:.3f} | |")
    print(f"aegis dcp stall / memcpy: {dc['aegis_steady'] / memcpy:.2f} (goal <= 1.5); "
          f"/ DCP FileSystemWriter stall: {dc['aegis_steady'] / dc['fs_steady']:.3f}")  # fmt: skip
    print(f"aegis shm restore / memcpy: {dc['shm'] / memcpy:.2f} (goal <= 1.5); "
          f"DCP FileSystemReader cold / aegis shm: {dc['fs_cold'] / dc['shm']:.1f}x (goal >= 10), "
          f"warm: {dc['fs_warm'] / dc['shm']:.1f}x")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
