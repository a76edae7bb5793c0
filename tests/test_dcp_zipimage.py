"""The planned ``torch.save`` image of one tensor, and the DCP slot's rules (no processes)."""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from aegis.checkpoint import store
from aegis.checkpoint.dcp import slot, torchsave, writer, zipimage


def fill(pieces: list[zipimage.Piece], raw: bytes) -> bytes:
    out = []
    for piece in pieces:
        match piece:
            case zipimage.Literal(data):
                out.append(data)
            case zipimage.Data(nbytes):
                assert nbytes == len(raw)
                out.append(raw)
            case zipimage.Crc():
                out.append(zlib.crc32(raw).to_bytes(4, "little"))
    return b"".join(out)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


TENSORS = [
    torch.randn(3, 5),
    torch.randn(7).to(torch.bfloat16),
    torch.arange(12, dtype=torch.int64).reshape(2, 3, 2),
    torch.tensor([True, False, True]),
    torch.tensor(2.5, dtype=torch.float64),
    torch.empty(0, 4),
]


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_image_loads_with_torch_load_when_filled_with_the_tensor_bytes(
    tensor: torch.Tensor,
) -> None:
    pieces = torchsave.image(tensor.dtype, tuple(tensor.shape))
    image = fill(pieces, raw_bytes(tensor))
    assert len(image) == zipimage.length(pieces)
    assert zipfile.ZipFile(io.BytesIO(image)).testzip() is None
    got = torch.load(io.BytesIO(image), weights_only=True)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


def test_image_aligns_the_data_to_64_bytes_when_planned() -> None:
    tensor = torch.randn(10)
    image = fill(torchsave.image(tensor.dtype, (10,)), raw_bytes(tensor))
    member = zipfile.ZipFile(io.BytesIO(image)).getinfo("archive/data/0")
    start = image.index(b"archive/data/0") + len("archive/data/0")
    extra_len = int.from_bytes(
        image[member.header_offset + 28 : member.header_offset + 30], "little"
    )
    assert (start + extra_len) % 64 == 0


def test_image_uses_zip64_fields_when_sizes_pass_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zipimage, "ZIP64_FROM", 8)
    tensor = torch.randn(4, 4)
    image = fill(zipimage.plan("archive", torchsave.records(tensor.dtype, (4, 4))),
                 raw_bytes(tensor))  # fmt: skip
    assert b"PK\x06\x06" in image  # the ZIP64 end of central directory
    assert zipfile.ZipFile(io.BytesIO(image)).testzip() is None
    assert torch.equal(torch.load(io.BytesIO(image), weights_only=True), tensor)


def test_image_fails_its_crc_check_when_a_data_byte_flips() -> None:
    tensor = torch.randn(64)
    image = bytearray(fill(torchsave.image(tensor.dtype, (64,)), raw_bytes(tensor)))
    image[image.index(raw_bytes(tensor)) + 100] ^= 0xFF
    assert zipfile.ZipFile(io.BytesIO(bytes(image))).testzip() == "archive/data/0"


def test_default_root_is_beside_the_pods_when_under_the_agent() -> None:
    agent = {"AEGIS_CKPT_DIR": "/ck/job/pod-1", "AEGIS_POD": "pod-1"}
    assert slot.default_root(agent) == Path("/ck/job/dcp")
    assert slot.default_root({"AEGIS_CKPT_DIR": "/ck/mine"}) == Path("/ck/mine/dcp")
    assert slot.default_root({**agent, "AEGIS_DCP_DIR": "/elsewhere"}) == Path("/elsewhere")
    assert slot.default_root({}) is None


def test_next_step_follows_the_newest_known_or_the_resume_step(tmp_path: Path) -> None:
    shm, root = tmp_path / "shm", tmp_path / "dcp"
    assert slot.next_step(shm, root, None) == 1
    shm.mkdir()
    (shm / "slot-4.json").write_text("{}")
    (root / "step-6").mkdir(parents=True)
    assert slot.next_step(shm, root, None) == 7
    assert slot.next_step(shm, root, 3) == 4  # resumed from 3: the later steps are abandoned


def test_prune_keeps_the_newest_complete_checkpoints_when_there_are_more(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        (tmp_path / f"step-{step}").mkdir()
        if step != 5:  # step 5 is being written
            (tmp_path / f"step-{step}" / slot.METADATA).write_bytes(b"")
    slot.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4", "step-5"]


def test_coordinator_slot_is_abandoned_when_other_ranks_files_never_come(tmp_path: Path) -> None:
    shm, where = tmp_path / "shm", tmp_path / "dcp" / "step-3"
    shm.mkdir()
    (shm / "buf-0").write_bytes(b"\0" * 64)
    blob = b"literal-bytes" + b"METADATA"
    dcp = slot.DcpSlot(
        step=3, buffer=0, data_bytes=64, directory=where,
        files=(slot.FileSpec("__0_0.distcp", (("lit", 0, 13), ("buf", 0, 8), ("crc", 0, 8))),),
        index=(0, 0), metadata=(13, 8), wait_for=("__1_0.distcp",),
    )  # fmt: skip
    slot.hand_off(shm, dcp, blob)
    with pytest.raises(slot.AbandonedStepError):
        slot.persist(shm, dcp, keep=3, wait_s=0.0)
    assert slot.read(shm, 3) is None  # dropped: the daemon goes on, nothing is committed
    assert not (where / slot.METADATA).exists()
    data = (where / "__0_0.distcp").read_bytes()
    assert data == b"literal-bytes" + b"\0" * 8 + zlib.crc32(b"\0" * 8).to_bytes(4, "little")


def _slot(where: Path, *, coordinator: bool, wait_for: tuple[str, ...] = ()) -> slot.DcpSlot:
    return slot.DcpSlot(
        step=3, buffer=0, data_bytes=64, directory=where,
        files=(slot.FileSpec(writer.file_name(0 if coordinator else 1, "b"),
                             (("lit", 0, 13), ("buf", 0, 8), ("crc", 0, 8))),),
        index=(0, 0), metadata=(13, 8) if coordinator else None, wait_for=wait_for,
    )  # fmt: skip


def _shm(tmp_path: Path) -> Path:
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "buf-0").write_bytes(b"\0" * 64)
    return shm


def test_the_coordinator_never_takes_an_earlier_saves_file_for_its_peers(tmp_path: Path) -> None:
    """Step 3 saved again after a restart: the peer's file of the first, unfinished save is
    still there, and it is not the file the coordinator waits for."""
    shm, where = _shm(tmp_path), tmp_path / "dcp" / "step-3"
    where.mkdir(parents=True)
    (where / writer.file_name(1, "a")).write_bytes(b"the first save's")
    dcp = _slot(where, coordinator=True, wait_for=(writer.file_name(1, "b"),))
    slot.hand_off(shm, dcp, b"literal-bytes" + b"METADATA")
    with pytest.raises(slot.AbandonedStepError):
        slot.persist(shm, dcp, keep=3, wait_s=0.0)
    assert not (where / slot.METADATA).exists()
    assert writer.file_name(1, "a") != writer.file_name(1, "b")


def test_a_file_of_a_replaced_slot_never_goes_into_place(tmp_path: Path) -> None:
    """What was read of a slot replaced meanwhile may mix two saves: no file of it is left
    where the coordinator would take it; read whole, it goes into place."""
    shm, where = _shm(tmp_path), tmp_path / "dcp" / "step-3"
    dcp = _slot(where, coordinator=False)
    slot.hand_off(shm, dcp, b"literal-bytes")
    with pytest.raises(store.SlotReplacedError):
        slot.persist(shm, dcp, keep=3, still_handed=lambda: False)
    assert list(where.iterdir()) == []  # neither the file nor its temporary copy
    assert slot.persist(shm, dcp, keep=3, still_handed=lambda: True) == where
    assert sorted(p.name for p in where.iterdir()) == [writer.file_name(1, "b")]


def test_the_coordinator_writes_no_metadata_when_its_slot_is_replaced_while_it_waits(
    tmp_path: Path,
) -> None:
    shm, where = _shm(tmp_path), tmp_path / "dcp" / "step-3"
    where.mkdir(parents=True)
    (where / writer.file_name(1, "b")).write_bytes(b"the peer's")
    dcp = _slot(where, coordinator=True, wait_for=(writer.file_name(1, "b"),))
    slot.hand_off(shm, dcp, b"literal-bytes" + b"METADATA")
    answers = iter([True, False])  # its own file read whole; replaced before .metadata
    with pytest.raises(store.SlotReplacedError):
        slot.persist(shm, dcp, keep=3, still_handed=lambda: next(answers))
    assert sorted(p.name for p in where.iterdir()) == sorted(
        [writer.file_name(0, "b"), writer.file_name(1, "b")]
    )  # no .metadata, and no temporary copy of it


def test_the_coordinator_stops_waiting_for_its_peers_when_its_slot_is_replaced(
    tmp_path: Path,
) -> None:
    """After a restart the step is saved anew: the first save's peers' files will never come,
    and the coordinator's daemon goes on with the new save at once, not after ``wait_s``."""
    shm, where = _shm(tmp_path), tmp_path / "dcp" / "step-3"
    dcp = _slot(where, coordinator=True, wait_for=(writer.file_name(1, "b"),))
    slot.hand_off(shm, dcp, b"literal-bytes" + b"METADATA")
    answers = iter([True, True, False])  # its own file read whole; replaced while it waits
    with pytest.raises(store.SlotReplacedError):
        slot.persist(shm, dcp, keep=3, wait_s=120.0, still_handed=lambda: next(answers))
    assert sorted(p.name for p in where.iterdir()) == [writer.file_name(0, "b")]
