"""A CUDA training job for the GPU check (``benchmarks/gpu/cuda_recovery.sh``).

``python3 cuda_train.py OUT CKPT [--backend nccl|gloo] [--device cuda|cpu] [--dcp] [--steps N]
[--ckpt-every K] [--crash-at S] [--crash-rank R] [--width W]
[--step-time-s T]``

A plain DDP script that never imports ``aegis`` (zero code change): its model and optimizer live on
the GPU, rank 0 saves them with ``torch.save`` into CKPT every K steps and every rank resumes from
the newest file. With ``--dcp`` it saves and loads with torch's own ``dcp.save``/``dcp.load`` and
``aegis.checkpoint.dcp.Writer``/``Reader`` instead (the one change that puts its CUDA tensors into
the pod's shared memory). Rank R raises an exception at step S of the first incarnation (a software
fault: Aegis restarts every rank in place, warm where it can).

It appends JSON lines to OUT/rank-<RANK>.jsonl: ``start`` (the incarnation, whether CUDA was
initialised before the script touched it, whether its parent process has the CUDA driver mapped,
the step it resumed from and whether the resumed weights are bit-identical to the ones saved at
that step, and whether it is a zygote's warm child), ``step`` (wall time of every step), ``crash``
and ``end``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

WARM = "torch" in sys.modules  # a zygote's child: torch was imported before the script ran

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("ckpt", type=Path)
    p.add_argument("--backend", default="nccl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dcp", action="store_true")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=35)
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--step-time-s", type=float, default=0.1)  # the rest of a step (data, logging)
    return p.parse_args()


def maps_cuda(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return any(b"libcuda.so" in line for line in maps)
    except OSError:
        return False


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
    except OSError:
        return ""
    return " ".join(os.path.basename(a.decode(errors="replace")) for a in argv[:3])


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for value in model.state_dict().values():
        h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Record:
    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"rank-{rank}.jsonl"

    def __call__(self, event: str, **fields: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def newest(ckpt: Path) -> Path | None:
    found = sorted(ckpt.glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def resume_plain(ckpt: Path, model: nn.Module, opt: torch.optim.Optimizer, dev: Any) -> int:
    latest = newest(ckpt)
    if latest is None:
        return 0
    state = torch.load(latest, map_location=dev, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return int(state["step"])


def save_plain(ckpt: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = ckpt / f".ckpt-{step}.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
    tmp.rename(ckpt / f"ckpt-{step}.pt")


def main() -> None:  # noqa: PLR0915 (a training script, read top to bottom)
    a = parse()
    rank = int(os.environ["RANK"])
    incarnation = int(os.environ.get("AEGIS_RESTART_COUNT", "0"))
    record = Record(a.out, rank)
    cuda_before = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(a.backend)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(a.width, a.width), nn.ReLU()]
    model = nn.Sequential(*layers).to(dev)
    ids = [dev] if dev.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    a.ckpt.mkdir(parents=True, exist_ok=True)
    source = "disk"
    if a.dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        from aegis.checkpoint.dcp import Reader, Writer

        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optim": osd, "step": torch.tensor(0)}
        reader = Reader()
        try:
            load(state, storage_reader=reader)
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            start = int(state["step"])
            source = str(reader.source)
        except dcp.api.CheckpointException:
            start = 0
    else:
        start = resume_plain(a.ckpt, model, opt, dev)
    saved = a.out / f"digest-{rank}-{start}.txt"
    match = saved.read_text() == digest(model) if start else None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    parent = os.getppid()
    record("start", incarnation=incarnation, warm=WARM, pid=os.getpid(), cuda_before=cuda_before,
           parent=command_of(parent), parent_cuda=maps_cuda(parent), resumed_from=start,
           match=match, source=source, device=str(dev), name=name)  # fmt: skip
    gen = torch.Generator(device=dev)
    for step in range(start + 1, a.steps + 1):
        gen.manual_seed(step * 100 + rank)
        x = torch.randn(256, a.width, device=dev, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        time.sleep(a.step_time_s)
        record("step", step=step, incarnation=incarnation)
        if step % a.ckpt_every == 0:
            t0 = time.time()
            if a.dcp:
                msd, osd = get_state_dict(model, opt)
                # dcp.save by attribute at each call: the agent's autoprogress wraps that one (a
                # save it sees is a safe point); the package re-exports it without an __all__
                dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)},  # type: ignore[attr-defined]
                         storage_writer=Writer())  # fmt: skip
            elif rank == 0:
                save_plain(a.ckpt, step, model, opt)
            (a.out / f"digest-{rank}-{step}.txt").write_text(digest(model))
            record("save", step=step, seconds=time.time() - t0)
        if step == a.crash_at and rank == a.crash_rank and incarnation == 0:
            record("crash", step=step)
            raise RuntimeError(f"injected crash at step {step}")
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    record("end", incarnation=incarnation, peak_bytes=peak)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
