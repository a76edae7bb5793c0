"""Which step directories the saver daemon deletes once a step is committed: never the steps
of the timeline the job goes on with, whatever an abandoned one left above them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from aegis.checkpoint import api, daemon, outage, store
from aegis.checkpoint import layout as lay
from aegis.checkpoint.dcp import slot as dcp_slot
from aegis.master import safe_points


@pytest.mark.parametrize(
    ("steps", "keep", "committed", "gone"),
    [
        ([10, 20, 30, 40], 3, 40, [10]),
        ([10, 20, 30], 3, 30, []),
        ([20, 25, 30, 40], 3, 25, [30, 40]),  # 30, 40: a timeline a restart rewound from
        ([5, 10, 20, 25, 28, 30, 40], 3, 28, [5, 10, 30, 40]),
        ([10, 20, 30, 40], 3, None, [10]),  # no step named: the newest by number
    ],
)
def test_pruning_deletes_an_abandoned_timeline_above_the_commit_and_keeps_the_newest_below(
    steps: list[int], keep: int, committed: int | None, gone: list[int]
) -> None:
    assert store.to_prune(steps, keep, committed) == gone


@pytest.mark.parametrize(
    ("steps", "keep", "committed", "hold", "gone"),
    [
        ([10, 15, 20, 25, 30], 3, 30, 10, []),  # the job resumes from 10: 10 and newer stay
        ([5, 10, 15, 20, 25, 30], 3, 30, 10, [5]),  # older than the job's step: pruned
        ([10, 20, 30, 40], 3, 40, 40, [10]),  # the job caught up: ``keep`` alone
        ([10, 20, 30, 40], 3, 40, None, [10]),  # nothing said (no master): ``keep`` alone
        ([10, 20, 30, 40, 50], 3, 30, 10, [40, 50]),  # an abandoned timeline still goes
        # the store stays down: the held step, then only the newest 16 (the master remembers
        # no older commit of a pod, so the job cannot move to one)
        ([10, *range(12, 52, 2)], 3, 50, 10, list(range(12, 20, 2))),
    ],
)
def test_pruning_keeps_every_step_from_the_one_the_job_may_resume_from(
    steps: list[int], keep: int, committed: int, hold: int | None, gone: list[int]
) -> None:
    assert store.to_prune(steps, keep, committed, hold) == gone


@pytest.mark.parametrize(("hold", "left"), [(None, [30, 40, 50]), (20, [20, 30, 40, 50]),
                                            (10, [10, 20, 30, 40, 50])])  # fmt: skip
def test_dcp_steps_the_job_may_resume_from_are_kept(
    tmp_path: Path, hold: int | None, left: list[int]
) -> None:
    for step in (10, 20, 30, 40, 50):
        lay.step_dir(tmp_path, step).mkdir()
        (lay.step_dir(tmp_path, step) / dcp_slot.METADATA).write_bytes(b"")
    dcp_slot.prune(tmp_path, 3, hold)
    assert lay.disk_steps(tmp_path) == left


def test_a_dcp_save_in_progress_above_the_jobs_step_is_not_pruned(tmp_path: Path) -> None:
    """A restart rewound to 20 (the job's step), below the abandoned timeline's complete 30-50;
    step 21's files are coming in, with no ``.metadata`` yet: it stays (it was deleted under
    the peers' files, and the coordinator then waited for them in vain). An incomplete step
    below the job's step is debris, and goes."""
    for step in (10, 20, 30, 40, 50):
        lay.step_dir(tmp_path, step).mkdir()
        (lay.step_dir(tmp_path, step) / dcp_slot.METADATA).write_bytes(b"")
    for step in (15, 21):
        lay.step_dir(tmp_path, step).mkdir()
    dcp_slot.prune(tmp_path, 3, 20)
    assert lay.disk_steps(tmp_path) == [20, 21, 30, 40, 50]


def test_the_saver_holds_as_many_newest_steps_as_the_master_remembers_commits() -> None:
    assert lay.HELD_NEWEST == safe_points.KEPT_STEPS


def test_a_pod_ahead_of_the_job_keeps_the_jobs_committed_step_on_disk(tmp_path: Path) -> None:
    """The daemon reads the step the agent was told (``hold-from`` in the pod's shared memory):
    a pod that committed 20-50 while the job is committed at 20 (another pod's store is down)
    keeps 20. By ``keep`` alone it pruned 20, and its restart found nothing to resume from."""
    shm, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    saver = api.Saver(api.SaverSettings(shm, ckpt))
    _save_and_commit(saver, 10)
    lay.hold_from(shm, 20)
    for step in (20, 30, 40, 50):
        saver.save(step, {"w": torch.full((4,), float(step))})
        daemon.attempt(daemon.Where(shm, shm, ckpt), step, _shared(), 0.0, 3, 0.01)
    assert lay.disk_steps(ckpt) == [20, 30, 40, 50]
    lay.hold_from(shm, 50)  # the job caught up: back to ``keep``
    saver.save(60, {"w": torch.full((4,), 60.0)})
    daemon.attempt(daemon.Where(shm, shm, ckpt), 60, _shared(), 0.0, 3, 0.01)
    assert lay.disk_steps(ckpt) == [40, 50, 60]
    restarted = api.Saver(api.SaverSettings(tmp_path / "other-shm", ckpt, resume_step=50))
    loaded = restarted.load_latest()
    assert loaded is not None and loaded[0] == 50


def _shared() -> daemon.Shared:
    return daemon.Shared(outage.StoreState())


def _save_and_commit(saver: api.Saver, step: int) -> None:
    """``Saver.save``, then what the saver daemon does with the slot (keep 3, its default)."""
    saver.save(step, {"w": torch.full((4,), float(step))})
    assert saver.settings.ckpt_dir is not None
    daemon.commit_one(saver.settings.shm_dir, saver.settings.ckpt_dir, step, 0.0, 3)


def test_steps_saved_after_a_rewind_survive_the_abandoned_higher_steps_on_disk(
    tmp_path: Path,
) -> None:
    """A restart rewinds to step 20 after 30 and 40 were committed; 25 and 28 are saved. Counted
    by number, 30 and 40 stayed and 25 went: a replacement node told to resume from 25 (the
    newest step every pod committed) found nothing to load."""
    shm, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    for step in (20, 30, 40):
        _save_and_commit(api.Saver(api.SaverSettings(shm, ckpt)), step)
    resumed = api.Saver(api.SaverSettings(shm, ckpt, resume_step=20))
    loaded = resumed.load_latest()
    assert loaded is not None and loaded[0] == 20
    for step in (25, 28):
        _save_and_commit(resumed, step)
    assert lay.disk_steps(ckpt) == [20, 25, 28]
    elsewhere = api.Saver(api.SaverSettings(tmp_path / "new-node-shm", ckpt, resume_step=25))
    loaded = elsewhere.load_latest()
    assert loaded is not None
    assert loaded[0] == 25 and torch.equal(loaded[1]["w"], torch.full((4,), 25.0))


@pytest.mark.parametrize(
    ("resume", "loaded", "said"),
    [
        (None, 7, None), (None, None, None), (20, 20, None), (0, None, None),  # as told
        (20, 10, "it loads step 10, its peers step 20"),
        (20, None, "it loads nothing (a fresh start), its peers step 20"),
    ],
)  # fmt: skip
def test_a_rank_that_cannot_resume_from_the_jobs_step_says_so(
    resume: int | None, loaded: int | None, said: str | None
) -> None:
    note = lay.resume_note(resume, loaded)
    assert note == said if said is None else note is not None and note.endswith(said)


def test_a_rank_missing_the_jobs_step_warns_as_it_loads_an_older_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its peers resume from the job's step (every pod committed it); this rank lost it (its
    store pruned it, say): it loads what it has, and the log says the ranks now differ."""
    shm, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    for step in (10, 20):
        _save_and_commit(api.Saver(api.SaverSettings(shm, ckpt)), step)
    for path in (lay.slot_json(shm, 20), lay.committed_marker(shm, 20)):
        path.unlink()
    shutil.rmtree(lay.step_dir(ckpt, 20))
    with caplog.at_level("WARNING", logger="aegis.checkpoint.api"):
        loaded = api.Saver(api.SaverSettings(shm, ckpt, resume_step=20)).load_latest()
    assert loaded is not None and loaded[0] == 10
    assert "the job resumes from step 20, which this rank does not have" in caplog.text


@pytest.mark.parametrize(("metadata", "left"), [((0, 0), [30, 40]),  # the coordinator prunes
                                                (None, [10, 20, 30, 40])])  # fmt: skip
def test_a_failed_attempt_at_a_dcp_step_prunes_what_the_job_no_longer_holds(
    tmp_path: Path, metadata: tuple[int, int] | None, left: list[int]
) -> None:
    """``daemon.make_room`` after a failed attempt at step 50 of a DCP checkpoint: its
    coordinator prunes the DCP directory as after a commit (the job moved on to 30, keep 2);
    another rank leaves it alone, as it does after its commits."""
    shm, root = tmp_path / "shm", tmp_path / "dcp"
    shm.mkdir()
    for step in (10, 20, 30, 40):
        lay.step_dir(root, step).mkdir(parents=True)
        (lay.step_dir(root, step) / dcp_slot.METADATA).write_bytes(b"")
    slot = dcp_slot.DcpSlot(50, 0, 0, lay.step_dir(root, 50), (), (0, 0), metadata)
    lay.slot_json(shm, 50).write_text(json.dumps(slot.to_json()))
    daemon.make_room(shm, tmp_path / "aegis-store", 50, 2, 30)
    assert lay.disk_steps(root) == left
