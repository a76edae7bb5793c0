"""The pure rules of the shared-memory layout: pods that run several ranks, and the names of
slots and step directories (only the ones Aegis writes count)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aegis.checkpoint import daemon, outage, store
from aegis.checkpoint import layout as lay


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),  # not under a launcher: the pod's own slots
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, None),  # what the agent itself sets
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, 3),  # torchrun --nproc-per-node 8
        ({"LOCAL_WORLD_SIZE": "2"}, 0),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "eight"}, None),
    ],
)
def test_a_process_uses_its_local_ranks_slots_only_where_the_pod_runs_several(
    env: dict[str, str], expected: int | None
) -> None:
    assert lay.local_rank_of(env) == expected


@pytest.mark.parametrize(
    ("expected", "committed", "answer"),
    [
        (2, [[2, 4], [2]], False),  # rank 1 has not committed 4
        (2, [[2, 4], [2, 4]], True),
        (2, [[4]], False),  # rank 1 has not saved yet
        (0, [[4]], False),  # the local world size is not known yet
        (1, [[4]], True),
    ],
)
def test_a_step_is_the_pods_once_every_local_rank_has_it(
    expected: int, committed: list[list[int]], answer: bool
) -> None:
    assert lay.pod_committed(4, expected, committed) is answer


def test_pending_steps_of_the_local_ranks_count_as_the_pods(tmp_path: Path) -> None:
    for where, step, done in ((tmp_path, 1, True), (tmp_path / "local-1", 3, False),
                              (tmp_path / "local-0", 2, True)):  # fmt: skip
        where.mkdir(exist_ok=True)
        lay.slot_json(where, step).write_text("{}")
        if done:
            lay.committed_marker(where, step).write_bytes(b"")
    assert [d.name for d in lay.local_dirs(tmp_path)] == ["local-0", "local-1"]
    assert lay.pending(tmp_path) == [] and lay.pending_anywhere(tmp_path) == [3]


@pytest.mark.parametrize(
    ("entry", "number"),
    [("slot-5.json", 5), ("slot-0.json", 0), ("slot-12.json", 12),
     ("slot-05.json", None), ("slot-00.json", None), ("slot-\u0665.json", None),
     ("slot-\uff15.json", None), ("slot-5.json\n", None), ("slot-.json", None),
     ("slot-+5.json", None), ("xslot-5.json", None)],
)  # fmt: skip
def test_a_slot_name_counts_only_with_its_number_written_as_aegis_writes_it(
    entry: str, number: int | None, tmp_path: Path
) -> None:
    (tmp_path / entry).touch()
    assert lay.slot_steps(tmp_path) == ([] if number is None else [number])


def test_odd_step_and_slot_names_are_left_alone_by_listing_and_pruning(tmp_path: Path) -> None:
    """``step-0100`` is not step 100: counted as such it made prune delete step 1."""
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    for name in ("step-1", "step-2", "step-3", "step-0100", "step-\u0669", "step-07"):
        (ckpt / name).mkdir(parents=True)
    for name in ("local-1", "local-01"):
        (shm / name).mkdir(parents=True)
    for name in ("slot-3.json", "slot-05.json", "slot-\u0665.json"):
        (shm / name).touch()
    assert lay.disk_steps(ckpt) == [1, 2, 3]
    assert lay.slot_steps(shm) == [3]
    assert [d.name for d in lay.local_dirs(shm)] == ["local-1"]
    store.prune(ckpt, 3)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["step-1", "step-2", "step-3", "step-0100", "step-\u0669", "step-07"])  # fmt: skip


def test_daemon_waits_a_poll_when_the_slot_it_listed_is_gone(tmp_path: Path) -> None:
    """Waiting no time at all on a slot that stays missing spun a core for the job's life."""
    where = daemon.Where(tmp_path, tmp_path, tmp_path / "ckpt")
    shared = daemon.Shared(outage.StoreState())
    assert daemon.attempt(where, 5, shared, 0.0, 3, 0.25) == 0.25
