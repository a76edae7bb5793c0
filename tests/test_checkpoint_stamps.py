"""Every slot says the incarnation of the training that saved it (its ``AEGIS_RESTART_COUNT``),
and the saver daemon's commit line says it too: real savers, the daemon's own commit, real
files. A slot or a line that does not say it (an older Aegis), or says it malformed, is of an
unknown incarnation (-1) and commits as before."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from aegis.checkpoint import api, daemon, process
from aegis.checkpoint import layout as lay
from aegis.checkpoint.dcp import slot as dcp_slot


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (3, 3), (None, -1), (-1, -1), (-4, -1), ("3", -1), (True, -1), (2.0, -1), ([1], -1)],
)
def test_an_incarnation_is_a_restart_count_and_anything_else_is_unknown(
    value: object, expected: int
) -> None:
    assert lay.incarnation_of(value) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, -1),  # not under an agent
        ({"AEGIS_RESTART_COUNT": "0"}, 0),
        ({"AEGIS_RESTART_COUNT": "12"}, 12),
        ({"AEGIS_RESTART_COUNT": ""}, -1),
        ({"AEGIS_RESTART_COUNT": "-1"}, -1),
        ({"AEGIS_RESTART_COUNT": "two"}, -1),
        ({"AEGIS_RESTART_COUNT": "\u0663"}, -1),  # an Arabic-Indic 3: a digit, not ours
    ],
)
def test_a_training_process_knows_its_incarnation_from_the_agents_environment(
    env: dict[str, str], expected: int
) -> None:
    assert lay.incarnation_in(env) == expected


def test_a_pods_commit_is_of_the_oldest_incarnation_of_its_local_ranks_slots() -> None:
    assert lay.pod_incarnation([2, 2]) == 2
    assert lay.pod_incarnation([2, 1]) == 1  # one rank's slot is of the older timeline
    assert lay.pod_incarnation([2, -1]) == -1  # one rank's slot does not say
    assert lay.pod_incarnation([]) == -1


def _env(root: Path, restart_count: str | None, **more: str) -> dict[str, str]:
    env = {"AEGIS_CKPT_SHM": str(root / "shm"), "AEGIS_CKPT_DIR": str(root / "ckpt"), **more}
    if restart_count is not None:
        env["AEGIS_RESTART_COUNT"] = restart_count
    return env


def _lines(shm: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (shm / lay.COMMITS_LOG).read_text().splitlines()]


def test_the_commit_line_says_the_incarnation_that_saved_the_slot(tmp_path: Path) -> None:
    saver = api.Saver(api.SaverSettings.from_env(_env(tmp_path, "2")))
    saver.save(10, {"w": torch.ones(4)})
    assert json.loads(lay.slot_json(tmp_path / "shm", 10).read_text())["incarnation"] == 2
    daemon.commit_one(tmp_path / "shm", tmp_path / "ckpt", 10, 0.0, 3)
    assert [(c["step"], c["incarnation"]) for c in _lines(tmp_path / "shm")] == [(10, 2)]
    loaded = api.Saver(api.SaverSettings(tmp_path / "no-shm", tmp_path / "ckpt")).load_latest()
    assert loaded is not None and loaded[0] == 10  # the disk copy loads as before


@pytest.mark.parametrize("stamp", ["absent", "malformed"])
async def test_a_slot_that_does_not_say_its_incarnation_commits_and_is_reported_as_unknown(
    tmp_path: Path, stamp: str
) -> None:
    """A slot handed off by an older Aegis (no ``incarnation``) or with a malformed one."""
    shm = tmp_path / "shm"
    api.Saver(api.SaverSettings.from_env(_env(tmp_path, "1"))).save(10, {"w": torch.ones(4)})
    slot = json.loads(lay.slot_json(shm, 10).read_text())
    if stamp == "absent":
        del slot["incarnation"]
    else:
        slot["incarnation"] = "1"
    lay.slot_json(shm, 10).write_text(json.dumps(slot))
    daemon.commit_one(shm, tmp_path / "ckpt", 10, 0.0, 3)
    with (shm / lay.COMMITS_LOG).open("a") as out:  # an older daemon's line
        out.write(json.dumps({"step": 12, "path": "p", "ts": 0.0}) + "\n")
    seen: list[tuple[int, int]] = []

    async def stamped(step: int, incarnation: int) -> None:
        seen.append((step, incarnation))

    tail = process.DaemonProcess(process.DaemonSettings(shm, tmp_path / "ckpt"),
                                 on_stamped_commit=stamped)  # fmt: skip
    assert await tail.poll_commits() == [10, 12]
    assert seen == [(10, -1), (12, -1)]


async def test_a_commit_lines_incarnation_reaches_both_callbacks(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    with (shm / lay.COMMITS_LOG).open("a") as out:
        for record in ({"step": 4, "incarnation": 0}, {"step": 6, "incarnation": 1},
                       {"step": 8, "incarnation": -7}, ["not", "a", "commit"]):  # fmt: skip
            out.write(json.dumps(record) + "\n")
    plain: list[int] = []
    stamped: list[tuple[int, int]] = []

    async def on_commit(step: int) -> None:
        plain.append(step)

    async def on_stamped(step: int, incarnation: int) -> None:
        stamped.append((step, incarnation))

    tail = process.DaemonProcess(process.DaemonSettings(shm, tmp_path / "ckpt"),
                                 on_commit=on_commit, on_stamped_commit=on_stamped)  # fmt: skip
    assert await tail.poll_commits() == [4, 6, 8]
    assert plain == [4, 6, 8] and stamped == [(4, 0), (6, 1), (8, -1)]


def test_a_pods_commit_of_local_ranks_says_the_oldest_incarnation_of_their_slots(
    tmp_path: Path,
) -> None:
    """Two local ranks: rank 0's slot of step 6 is of the abandoned timeline (incarnation 0),
    rank 1's of the new one (1): the pod's commit is the older's."""
    pod, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    shared = daemon.Shared(daemon.resumed_state(pod))
    for rank, restart_count in ((0, "0"), (1, "1")):
        env = _env(tmp_path, restart_count, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        saver = api.Saver(api.SaverSettings.from_env(env))
        saver.save(6, {"w": torch.ones(4)})
        where = daemon.Where(pod, saver.settings.shm_dir, saver.settings.ckpt_dir or ckpt)
        final = daemon.commit_one(where.slots, where.ckpt, 6, 0.0, 3)
        daemon.announce(where, 6, final, shared)
    assert [(c["step"], c["incarnation"]) for c in _lines(pod / "local-0")] == [(6, 0)]
    assert [(c["step"], c["incarnation"]) for c in _lines(pod / "local-1")] == [(6, 1)]
    assert [(c["step"], c["incarnation"]) for c in _lines(pod)] == [(6, 0)]


def test_a_dcp_slot_says_its_incarnation_and_its_commit_line_too(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from aegis.checkpoint.dcp import Writer

    shm = tmp_path / "shm"
    with warnings.catch_warnings():  # one process, no process group: DCP says it saves alone
        warnings.simplefilter("ignore", UserWarning)
        writer = Writer(tmp_path / "dcp", environ=_env(tmp_path, "3"))
        dcp.save({"w": torch.ones(4)}, storage_writer=writer)
    [step] = lay.slot_steps(shm)
    handed = dcp_slot.read(shm, step)
    assert handed is not None and handed.incarnation == 3
    daemon.commit_one(shm, tmp_path / "ckpt", step, 0.0, 3)
    assert [(c["step"], c["incarnation"]) for c in _lines(shm)] == [(step, 3)]
    older = handed.to_json()
    del older["incarnation"]
    assert dcp_slot.DcpSlot.from_json(older).incarnation == -1
