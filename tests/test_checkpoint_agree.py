"""Under torch.distributed, ``aegis.checkpoint.load_latest`` loads the same step on every rank:
a rank whose copy of the job's step is damaged (its node replaced, so read from disk, and that
copy corrupt) takes its peers back with it. Before, that rank alone went back a step and the
job went on with its ranks at different steps. Real processes, real gloo, real files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from aegis.checkpoint import api, collective, daemon

pytestmark = pytest.mark.timeout(300)

RANKS = 2
STEPS = (1, 2, 3)

LOADER = """
import json, sys
import torch.distributed as dist
from pathlib import Path
from aegis.checkpoint import api
import torch
rank, store, shm, ckpt, agree = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
settings = api.SaverSettings(shm_dir=Path(shm), ckpt_dir=Path(ckpt), resume_step=3)
template = {"w": torch.full((1024,), -1.0)}  # the model as built, before a resume
loaded = api.Saver(settings).load_latest(template, agree=agree == "yes")
dist.barrier()
print(json.dumps(None if loaded is None else [loaded[0], float(loaded[1]["w"][0])]))
print(json.dumps(float(template["w"][0])))
dist.destroy_process_group()
"""


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[list[tuple[Path, Path]]]:
    """Each rank's shared memory and checkpoint directory, steps 1 to 3 saved and committed
    (rank r's state at step s: ``w`` = 1000 r + s)."""
    tag = uuid.uuid4().hex[:8]
    pairs = [(Path("/dev/shm") / f"aegis-agree-{tag}-{r}", tmp_path / f"ckpt-{r}") for r in (0, 1)]
    for rank, (shm, ckpt) in enumerate(pairs):
        saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
        for step in STEPS:
            saver.save(step, {"w": torch.full((1024,), 1000.0 * rank + step)})
            daemon.commit_one(shm, ckpt, step, 0.0, keep=5)
    yield pairs
    for shm, _ in pairs:
        shutil.rmtree(shm, ignore_errors=True)


def _corrupt(ckpt: Path, step: int) -> None:
    data = ckpt / f"step-{step}" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))


def _load(tmp_path: Path, dirs: list[tuple[Path, Path]], agree: bool = True) -> list[object]:
    """What each rank loaded: [step, w] or None."""
    store = tmp_path / f"store-{uuid.uuid4().hex[:8]}"
    said = "yes" if agree else "no"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOADER, str(rank), str(store), str(shm), str(ckpt), said],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, (shm, ckpt) in enumerate(dirs)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err
    loaded = [json.loads(out.strip().splitlines()[-2]) for out, _ in outs]
    templates = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for got, weights in zip(loaded, templates, strict=True):  # the template holds what loaded
        assert weights == (-1.0 if got is None else got[1]), (loaded, templates)
    return loaded


def test_every_rank_loads_the_job_step_when_all_have_it(
    tmp_path: Path, dirs: list[tuple[Path, Path]]
) -> None:
    assert _load(tmp_path, dirs) == [[3, 3.0], [3, 1003.0]]


def test_a_rank_whose_copy_is_corrupt_takes_every_rank_back_with_it(
    tmp_path: Path, dirs: list[tuple[Path, Path]]
) -> None:
    """Rank 1's node was replaced (its shared memory is empty) and its copy of step 3 on disk
    is damaged: it loads step 2, and rank 0, which has step 3 in shared memory, goes back to
    step 2 too (from shared memory: it still holds it)."""
    shm1, ckpt1 = dirs[1]
    shutil.rmtree(shm1)
    _corrupt(ckpt1, 3)
    assert _load(tmp_path, dirs) == [[2, 2.0], [2, 1002.0]]
    # a script that opts out loads alone, as before
    assert _load(tmp_path, dirs, agree=False) == [[3, 3.0], [2, 1002.0]]


def test_the_ranks_go_back_until_every_one_can_load_the_same_step(
    tmp_path: Path, dirs: list[tuple[Path, Path]]
) -> None:
    """Rank 1 cannot load step 3; rank 0, sent back to step 2, cannot load that one (torn on
    disk, gone from its shared memory): both end at step 1, in two rounds of agreement."""
    for shm, _ in dirs:
        shutil.rmtree(shm)
    _corrupt(dirs[1][1], 3)
    (dirs[0][1] / "step-2" / "COMMIT").unlink()
    assert _load(tmp_path, dirs) == [[1, 1.0], [1, 1001.0]]
    _corrupt(dirs[0][1], 1)  # and with nothing in common: a fresh start for both
    assert _load(tmp_path, dirs) == [None, None]


def test_a_rank_taken_back_to_a_fresh_start_keeps_its_template_as_built(
    tmp_path: Path, dirs: list[tuple[Path, Path]]
) -> None:
    """Rank 0 has step 3 in shared memory; rank 1 can load nothing (a new node, its copies
    damaged): both start afresh, and rank 0's model is not left with step 3's weights (the
    template is written only once the ranks agreed; a reviewer found it written before)."""
    shm1, ckpt1 = dirs[1]
    shutil.rmtree(shm1)
    for step in STEPS:
        _corrupt(ckpt1, step)
    assert _load(tmp_path, dirs) == [None, None]  # (and each template still at -1)


@pytest.mark.parametrize(
    ("steps", "bound"),
    [([3, 3], None), ([3, 2], 2), ([2, 3, 2], 2), ([-1, 5], -1), ([-1, -1], None), ([7], None)],
)
def test_step_bound_is_the_oldest_step_loaded_until_all_agree(
    steps: list[int], bound: int | None
) -> None:
    assert collective.step_bound(steps) == bound


def test_alone_it_loads_once_and_gathers_nothing() -> None:
    calls: list[int | None] = []

    def load(at_most: int | None) -> tuple[int, object] | None:
        calls.append(at_most)
        return (4, "state")

    assert collective.agree_on_step(load) == (4, "state") and calls == [None]
