"""One rank of a small FSDP2 job (CPU, gloo) that saves or loads a DCP checkpoint.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's), plus Aegis's
AEGIS_CKPT_SHM / AEGIS_DCP_DIR for the Writer and Reader. Arguments: actions done in turn on
one model (built from seed 0), each ``kind:key=value,...``:
  train                                       one optimizer step
  save:[writer=aegis|fs][,async=1][,id=X][,expect=FILE]
                                              dcp.save / dcp.async_save; rank 0 writes the
                                              saved state, gathered in full, to FILE
  load:[reader=aegis|fs][,id=X],expect=FILE,report=FILE
                                              into a model built from another seed; rank 0
                                              reports (json) the tensors that differ from
                                              FILE's, and the step and source Aegis chose
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import aegis.checkpoint.dcp


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Linear(8, 3)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(4, 16)).pow(2).sum().backward()
        optim.step()


def state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = dsd.get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full(v) for v in value]
    return value


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
        return [] if ok else [where]
    if isinstance(want, dict):
        return [d for k in want for d in differences(got.get(k), want[k], f"{where}/{k}")]
    if isinstance(want, list):
        return [d for i, w in enumerate(want) for d in differences(got[i], w, f"{where}/{i}")]
    return [] if got == want else [where]


def save(model: torch.nn.Module, optim: torch.optim.Optimizer, opts: dict[str, str]) -> None:
    sd = state(model, optim)
    if opts.get("writer", "aegis") == "aegis":
        writer: Any = aegis.checkpoint.dcp.Writer()
    else:
        writer = dcp.FileSystemWriter(opts["id"])
    checkpoint_id = opts.get("id") if opts.get("writer", "aegis") == "aegis" else None
    if opts.get("async"):
        dcp.async_save(sd, storage_writer=writer, checkpoint_id=checkpoint_id).result()
    else:
        dcp.save(sd, storage_writer=writer, checkpoint_id=checkpoint_id)
    expected = full(state(model, optim))
    if dist.get_rank() == 0 and "expect" in opts:
        torch.save(expected, opts["expect"])


def load(opts: dict[str, str]) -> None:
    model, optim = build(1)
    sd = state(model, optim)
    if opts.get("reader", "aegis") == "aegis":
        reader: Any = aegis.checkpoint.dcp.Reader()
        checkpoint_id = opts.get("id")
    else:
        reader = dcp.FileSystemReader(opts["id"])
        checkpoint_id = None
    dcp.load(sd, storage_reader=reader, checkpoint_id=checkpoint_id)
    dsd.set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = full(state(model, optim))
    if dist.get_rank() == 0:
        want = torch.load(opts["expect"], weights_only=False)
        report = {
            "differences": differences(got, want),
            "step": getattr(reader, "step", None),
            "source": getattr(reader, "source", None),
            "world": dist.get_world_size(),
        }
        Path(opts["report"]).write_text(json.dumps(report))


def main() -> int:
    dist.init_process_group("gloo")
    try:
        model, optim = build(0)
        for action in sys.argv[1:]:
            kind, _, rest = action.partition(":")
            opts = dict(kv.partition("=")[::2] for kv in rest.split(",") if kv)
            if kind == "train":
                train(model, optim, 1)
            elif kind == "save":
                save(model, optim, opts)
            elif kind == "load":
                load(opts)
            else:
                raise SystemExit(f"unknown action {action!r}")
            print(f"rank {dist.get_rank()}: {action} done", flush=True)
        dist.barrier()  # no rank (rank 0 holds the store) leaves while another still works
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # torch's own teardown at interpreter exit once aborted a rank whose every action was done
    # ("terminate called without an active exception": a gloo thread left joinable, exit
    # status -6; seen once in a clean-clone CI run); the work is done and the group destroyed
    os._exit(code)
