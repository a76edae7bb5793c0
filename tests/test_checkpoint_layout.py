"""The pure rules of the shared-memory layout for pods that run several ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

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
